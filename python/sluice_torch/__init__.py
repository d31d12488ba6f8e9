"""sluice's sparse layer for PyTorch: a drop-in for torch.nn.Linear.

    import sluice_torch
    layer = sluice_torch.SparseLinear(784, 256, sparsity=0.9)       # random mask
    layer = sluice_torch.SparseLinear.from_linear(linear, sparsity=0.9)  # magnitude pruning
    layer = sluice_torch.SparseLinear.from_mask(weight, mask, bias)

Inputs are [..., in_features] float32 or bfloat16 tensors (float64: a float64 reference
forward, for gradient checks); under torch.autocast("cpu") a float32 input is taken in
bfloat16, as torch.nn.Linear's is. Products run on as many threads as torch's own where a
count was asked for (torch.set_num_threads, OMP_NUM_THREADS), else on every CPU. The values (one per mask position) and the bias are
parameters for a torch optimizer; with ``sluice_optimizer="adam"`` (or "sgd", "adamw")
they stay in sluice's ModelMemory instead: backward hands it the gradient (several backward
passes before a step add up, as ``.grad`` does: gradient accumulation) and ``layer.step()``
applies their sum.

``state_dict()`` holds the mask too (``mask_indices``: the values' flat positions
row * in_features + column), and the values and bias also of a sluice_optimizer layer;
``load_state_dict`` takes that mask, so a layer built with another mask (another seed)
loads to compute what the saved one did. A sluice_optimizer layer's state_dict holds its
optimizer too (``optimizer_state``: its ModelMemory's checkpoint, with the moments, the
step and the settings, as a torch optimizer's own state_dict holds them), so a run resumes
where it stopped; ``layer.lr`` reads and sets its learning rate between steps.
copy.deepcopy and pickling (torch.save of a module) keep that optimizer's state too;
torch.jit.save keeps the values, not the optimizer's state.
"""
import math
import operator
import os

import torch

__all__ = ["SparseLinear", "sparse_linear"]

torch.ops.load_library(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sluice_torch.so"))


def sparse_linear(x, values, bias, layer):
    """y = x W^T + b through a torch.classes.sluice.Layer (differentiable in all three)."""
    return torch.ops.sluice.sparse_linear(x, values, bias, layer)


def _random_positions(n, keep):
    """`keep` distinct positions in [0, n), increasing, uniformly drawn from torch's
    generator; for keep much below n, without a tensor of n positions."""
    if 4 * keep >= n:  # n positions take little beside the layer's keep values
        return torch.randperm(n)[:keep].sort().values
    chosen = torch.empty(0, dtype=torch.int64)
    while chosen.numel() < keep:  # draws with repeats; their distinct set is uniform
        draws = torch.randint(0, n, (2 * (keep - chosen.numel()),), dtype=torch.int64)
        chosen = torch.cat([chosen, draws]).unique()
    return chosen[torch.randperm(chosen.numel())[:keep]].sort().values


class SparseLinear(torch.nn.Module):
    """y = x W^T + b with W sparse, run by sluice's engine."""

    def __init__(self, in_features, out_features, bias=True, sparsity=0.9, *,
                 sluice_optimizer=None, lr=1e-3, weight_decay=0.0, _weight=None, _mask=None,
                 _bias=None):
        super().__init__()
        in_features, out_features = operator.index(in_features), operator.index(out_features)
        if in_features < 1 or out_features < 1:
            raise ValueError(f"a layer of {in_features} inputs and {out_features} outputs: "
                             "both must be at least 1")
        if _weight is None:
            if not 0.0 <= sparsity < 1.0:
                raise ValueError(f"sparsity {sparsity} is not in [0, 1)")
            # As torch.nn.Linear initialises, over the fan-in each row keeps; the mask is
            # drawn from torch's generator too (torch.manual_seed reproduces both), and
            # no dense [out, in] tensor is made: the layer holds its non-zeros alone.
            n = in_features * out_features
            keep = max(1, round((1.0 - sparsity) * n))
            bound = 1.0 / math.sqrt(max(1.0, in_features * (1.0 - sparsity)))
            positions = _random_positions(n, keep)
            drawn = torch.empty(keep).uniform_(-bound, bound)
            if bias:
                b = 1.0 / math.sqrt(in_features)
                _bias = torch.empty(out_features).uniform_(-b, b)
        elif _weight.dim() != 2:
            raise ValueError(f"weight of shape {tuple(_weight.shape)}: it must be [out, in]")
        if _bias is not None and tuple(_bias.shape) != (out_features,):
            raise ValueError(f"bias of shape {tuple(_bias.shape)} for {out_features} outputs")
        self.in_features = in_features
        self.out_features = out_features
        owned = sluice_optimizer is not None
        self._optimizer = (sluice_optimizer or "adam", lr, weight_decay)
        self._has_bias = _bias is not None
        _bias = None if _bias is None else _bias.detach().float()
        if _weight is None:
            self.layer = torch.ops.sluice.make_layer_at(positions, drawn, in_features,
                                                        out_features, _bias, owned,
                                                        *self._optimizer)
        else:
            self.layer = torch.ops.sluice.make_layer(
                _weight.detach().float(), None if _mask is None else _mask.detach().float(),
                sparsity, _bias, owned, *self._optimizer)
        if owned:
            # No parameters: an empty tensor that wants a gradient stands in for the
            # values, so that autograd runs the backward (which hands in the gradient).
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
        if weight.dim() != 2:
            raise ValueError(f"weight of shape {tuple(weight.shape)}: it must be [out, in]")
        return cls(weight.shape[1], weight.shape[0], _weight=weight, _mask=mask, _bias=bias,
                   **kwargs)

    def forward(self, x):
        values = self.values if self.values is not None else self._stand_in
        return torch.ops.sluice.sparse_linear(x, values, self.bias, self.layer)

    def step(self):
        """Applies the ModelMemory's optimizer (sluice_optimizer layers only)."""
        return self.layer.step()

    @property
    def lr(self):
        """The ModelMemory optimizer's learning rate; set it between steps to schedule it."""
        return self.layer.optimizer_settings()[1]

    @lr.setter
    def lr(self, value):
        if not self.layer.sluice_owned():
            raise RuntimeError("sluice_torch: this layer's weights are torch parameters; set "
                               "the learning rate of the torch optimizer that steps them")
        self.layer.set_learning_rate(float(value))
        self._optimizer = self.layer.optimizer_settings()

    def zero_grad(self, set_to_none=False):
        """Module.zero_grad, and for a sluice_optimizer layer drops the gradient its backward
        passes handed the ModelMemory since the last step. (A Python module holding this
        layer zeroes its parameters' grads only: call this layer's zero_grad too.)"""
        super().zero_grad(set_to_none)
        if self.values is None:
            self.layer.discard_gradient()

    def __getstate__(self):
        state = self.__dict__.copy()
        if self.layer.sluice_owned():
            # The ModelMemory whole (values, moments, step), as the state_dict holds it: the
            # layer's own pickling (TorchScript's) keeps its values alone, and a copy that
            # restarts Adam would hand its state_dict's fresh moments to whatever loads it.
            del state["layer"]
            state["_sluice_state"] = self.layer.optimizer_state()
        return state

    def __setstate__(self, state):
        saved = state.pop("_sluice_state", None)
        super().__setstate__(state)
        if saved is not None:
            self.layer = torch.ops.sluice.make_layer_from_state(saved)

    def dense_weight(self):
        """W as a dense [out, in] tensor, zeros off the mask."""
        values = self.values if self.values is not None else self.layer.values()
        return self.layer.dense(values.detach())

    def mask(self):
        return self.layer.mask()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "mask_indices"] = self.layer.mask_indices()
        if self.layer.sluice_owned():
            destination[prefix + "values"] = self.layer.values()
            if self._has_bias:
                destination[prefix + "bias"] = self.layer.bias()
            destination[prefix + "optimizer_state"] = self.layer.optimizer_state()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        owned = self.layer.sluice_owned()
        saved_state = state_dict.get(prefix + "optimizer_state")
        if owned and saved_state is not None:
            if problem := self._load_optimizer_state(saved_state, state_dict, prefix):
                error_msgs.append(f"sluice SparseLinear {prefix or '(top)'}: {problem}")
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
            ours = {prefix + key for key in self._OWN_KEYS}
            unexpected_keys[:] = [k for k in unexpected_keys if k not in ours]
            return
        indices = state_dict.get(prefix + "mask_indices")
        values = state_dict.get(prefix + "values")
        bias = state_dict.get(prefix + "bias")
        if not self._has_bias:
            bias = None  # (strict: super() reports it unexpected)
        elif bias is None:  # (strict: reported missing, by super() or below)
            bias = self.layer.bias() if owned else self.bias
        if indices is None:  # saved before the mask was: its values are for this mask
            if strict and not owned:  # (an owned layer's missing keys are listed below)
                missing_keys.append(prefix + "mask_indices")
        elif problem := self._state_problem(indices, values, bias):
            error_msgs.append(f"sluice SparseLinear {prefix or '(top)'}: {problem}")
            return
        elif owned or not torch.equal(indices, self.layer.mask_indices()):
            self.layer = torch.ops.sluice.make_layer_at(
                indices, values.detach().float(), self.in_features, self.out_features,
                None if bias is None else bias.detach().float(), owned, *self._optimizer)
            if not owned:  # sized for the new mask; the values are copied in below
                self.values.data = torch.empty(values.numel())
                self.values.grad = None  # the old mask's: it fits no position of the new
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        # An owned layer has no parameters: its saved values and bias are ours, as the mask.
        # Its optimizer's state may be missing (saved before it was kept: it starts afresh);
        # a torch-held layer leaves that to a torch optimizer.
        ours = {prefix + "mask_indices"}
        if owned:
            ours |= {prefix + "values"} | ({prefix + "bias"} if self._has_bias else set())
            if strict:
                missing_keys.extend(k for k in sorted(ours) if k not in state_dict)
        ours.add(prefix + "optimizer_state")
        unexpected_keys[:] = [k for k in unexpected_keys if k not in ours]

    _OWN_KEYS = ("mask_indices", "values", "bias", "optimizer_state")

    def _load_optimizer_state(self, saved_state, state_dict, prefix):
        """Loads a sluice_optimizer layer's saved ModelMemory (what is wrong: None, fine)."""
        try:
            layer = torch.ops.sluice.make_layer_from_state(saved_state)
        except RuntimeError as e:
            return str(e).splitlines()[0]
        shape = (layer.in_features(), layer.out_features())
        if shape != (self.in_features, self.out_features):
            return (f"optimizer_state of a layer of {shape[0]} inputs and {shape[1]} outputs, "
                    f"not {self.in_features} and {self.out_features}")
        if (layer.bias() is not None) != self._has_bias:
            return "optimizer_state " + ("has no bias" if self._has_bias else "has a bias")
        # The copies saved beside it must agree: an edited one would silently be lost.
        for key, mine in (("mask_indices", layer.mask_indices()), ("values", layer.values()),
                          ("bias", layer.bias())):
            theirs = state_dict.get(prefix + key)
            if theirs is not None and mine is not None and not torch.equal(theirs, mine):
                return f"{key} differs from optimizer_state's (load one or the other)"
        self.layer = layer
        self._optimizer = layer.optimizer_settings()
        return None

    def _state_problem(self, indices, values, bias):
        """What is wrong with a saved mask, values and bias for this layer (None: fine)."""
        n = self.in_features * self.out_features
        if values is None:
            return "values missing"
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            return f"bias of shape {tuple(bias.shape)} for {self.out_features} outputs"
        if indices.dtype != torch.int64 or indices.dim() != 1:
            return "mask_indices must be a 1-D int64 tensor"
        if values.dim() != 1 or values.numel() != indices.numel():
            return f"{tuple(values.shape)} values for {indices.numel()} mask positions"
        if indices.numel() and (indices[0] < 0 or indices[-1] >= n or
                                bool((indices[1:] <= indices[:-1]).any())):
            return f"mask_indices are not increasing positions below {n}"
        return None

    def extra_repr(self):
        nnz = self.layer.nnz()
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"sparsity={1 - nnz / (self.in_features * self.out_features):.4f}, "
                f"sluice_owned={self.layer.sluice_owned()}")
