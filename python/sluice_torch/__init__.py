"""sluice's sparse layer for PyTorch: a drop-in for torch.nn.Linear.

    import sluice_torch
    layer = sluice_torch.SparseLinear(784, 256, sparsity=0.9)       # random mask
    layer = sluice_torch.SparseLinear.from_linear(linear, sparsity=0.9)  # magnitude pruning
    layer = sluice_torch.SparseLinear.from_mask(weight, mask, bias)

Inputs are [..., in_features] float32 or bfloat16 tensors (float64: a float64 reference
forward, for gradient checks). The values (one per mask position) and the bias are
parameters for a torch optimizer; with ``sluice_optimizer="adam"`` (or "sgd", "adamw")
they stay in sluice's ModelMemory instead: backward hands it the gradient and
``layer.step()`` applies it.
"""
import math
import os

import torch

__all__ = ["SparseLinear", "sparse_linear"]

torch.ops.load_library(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sluice_torch.so"))


def sparse_linear(x, values, bias, layer):
    """y = x W^T + b through a torch.classes.sluice.Layer (differentiable in all three)."""
    return torch.ops.sluice.sparse_linear(x, values, bias, layer)


class SparseLinear(torch.nn.Module):
    """y = x W^T + b with W sparse, run by sluice's engine."""

    def __init__(self, in_features, out_features, bias=True, sparsity=0.9, *,
                 sluice_optimizer=None, lr=1e-3, weight_decay=0.0, _weight=None, _mask=None,
                 _bias=None):
        super().__init__()
        if _weight is None:
            if not 0.0 <= sparsity < 1.0:
                raise ValueError(f"sparsity {sparsity} is not in [0, 1)")
            # As torch.nn.Linear initialises, over the fan-in each row keeps; the mask is
            # drawn from torch's generator too (torch.manual_seed reproduces both).
            kept = max(1.0, in_features * (1.0 - sparsity))
            bound = 1.0 / math.sqrt(kept)
            _weight = torch.empty(out_features, in_features).uniform_(-bound, bound)
            n = in_features * out_features
            keep = max(1, round((1.0 - sparsity) * n))
            _mask = torch.zeros(n)
            _mask[torch.randperm(n)[:keep]] = 1.0
            _mask = _mask.view(out_features, in_features)
            if bias:
                b = 1.0 / math.sqrt(in_features)
                _bias = torch.empty(out_features).uniform_(-b, b)
        self.in_features = in_features
        self.out_features = out_features
        owned = sluice_optimizer is not None
        self.layer = torch.ops.sluice.make_layer(
            _weight.detach().float(), None if _mask is None else _mask.detach().float(),
            sparsity, None if _bias is None else _bias.detach().float(), owned,
            sluice_optimizer or "adam", lr, weight_decay)
        if owned:
            # No parameters: an empty tensor that wants a gradient stands in for the
            # values, so that autograd runs the backward (which submits the gradient).
            self.values = None
            self.bias = None
            self._stand_in = torch.empty(0, requires_grad=True)
        else:
            self.values = torch.nn.Parameter(self.layer.values())
            self.bias = torch.nn.Parameter(self.layer.bias()) if _bias is not None else None

    @classmethod
    def from_linear(cls, linear, sparsity=0.9, **kwargs):
        """Magnitude pruning of a torch.nn.Linear: its largest (1 - sparsity) weights."""
        return cls(linear.in_features, linear.out_features, sparsity=sparsity,
                   _weight=linear.weight, _bias=linear.bias, **kwargs)

    @classmethod
    def from_mask(cls, weight, mask, bias=None, **kwargs):
        """weight [out, in] where mask is non-zero."""
        return cls(weight.shape[1], weight.shape[0], _weight=weight, _mask=mask, _bias=bias,
                   **kwargs)

    def forward(self, x):
        values = self.values if self.values is not None else self._stand_in
        return torch.ops.sluice.sparse_linear(x, values, self.bias, self.layer)

    def step(self):
        """Applies the ModelMemory's optimizer (sluice_optimizer layers only)."""
        return self.layer.step()

    def dense_weight(self):
        """W as a dense [out, in] tensor, zeros off the mask."""
        values = self.values if self.values is not None else self.layer.values()
        return self.layer.dense(values.detach())

    def mask(self):
        return self.layer.mask()

    def extra_repr(self):
        nnz = self.layer.nnz()
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"sparsity={1 - nnz / (self.in_features * self.out_features):.4f}, "
                f"sluice_owned={self.layer.sluice_owned()}")
