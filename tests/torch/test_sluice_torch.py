"""The Python module sluice_torch under Debian's python3-torch: gradcheck of the op,
drop-in equality with a masked torch.nn.Linear, the constructors, sluice's optimizer."""
import unittest

import torch

import sluice_torch


def relative(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


class GradCheck(unittest.TestCase):
    def test_float64_forward_against_finite_differences(self):
        # float64 runs the float64 reference forward; its backward is the engine's (fp32),
        # checked against float64 finite differences of that forward.
        torch.manual_seed(0)
        weight = torch.randn(7, 11)
        mask = (torch.rand(7, 11) < 0.4).float()
        layer = sluice_torch.SparseLinear.from_mask(weight, mask, torch.randn(7))
        x = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
        values = layer.values.detach().double().requires_grad_(True)
        bias = layer.bias.detach().double().requires_grad_(True)
        self.assertTrue(torch.autograd.gradcheck(
            lambda x, v, b: sluice_torch.sparse_linear(x, v, b, layer.layer),
            (x, values, bias), eps=1e-6, atol=1e-5, rtol=1e-4))

    def test_a_wrong_gradient_fails_gradcheck(self):
        # The check above can fail: scale the engine's input gradient and it does.
        torch.manual_seed(1)
        layer = sluice_torch.SparseLinear(6, 4, sparsity=0.5)
        x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)

        class Wrong(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                return 1.01 * g

        with self.assertRaisesRegex(RuntimeError, "Jacobian mismatch"):
            torch.autograd.gradcheck(lambda x: layer(Wrong.apply(x)), (x,), eps=1e-6,
                                     atol=1e-5, rtol=1e-4)


class DropIn(unittest.TestCase):
    def test_matches_masked_dense_linear(self):
        torch.manual_seed(2)
        linear = torch.nn.Linear(53, 37)
        layer = sluice_torch.SparseLinear.from_linear(linear, sparsity=0.8)
        mask = layer.mask().float()
        self.assertEqual(int(mask.sum()), round(0.2 * 53 * 37))
        x = torch.randn(29, 53, requires_grad=True)
        xd = x.detach().clone().requires_grad_(True)
        w = linear.weight.detach().clone().requires_grad_(True)
        b = linear.bias.detach().clone().requires_grad_(True)
        g = torch.randn(29, 37)
        y = layer(x)
        yd = torch.nn.functional.linear(xd, w * mask, b)
        (y * g).sum().backward()
        (yd * g).sum().backward()
        self.assertLess(relative(y, yd), 1e-5)
        self.assertLess(relative(x.grad, xd.grad), 1e-5)
        self.assertLess(relative(layer.layer.dense(layer.values.grad), w.grad * mask), 1e-5)
        self.assertLess(relative(layer.bias.grad, b.grad), 1e-5)

    def test_random_layer_trains_with_a_torch_optimizer(self):
        torch.manual_seed(3)
        layer = sluice_torch.SparseLinear(20, 3, sparsity=0.9)
        self.assertEqual(layer.values.numel(), 6)
        x, target = torch.randn(64, 20), torch.randn(64, 3)
        opt = torch.optim.SGD(layer.parameters(), lr=0.05)
        losses = []
        for _ in range(30):
            opt.zero_grad()
            loss = ((layer(x) - target) ** 2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        self.assertLess(losses[-1], losses[0])

    def test_sluice_optimizer_steps_in_model_memory(self):
        torch.manual_seed(4)
        w, m, b = torch.randn(8, 9), (torch.rand(8, 9) < 0.5).float(), torch.randn(8)
        owned = sluice_torch.SparseLinear.from_mask(w, m, b, sluice_optimizer="sgd", lr=0.1)
        twin = sluice_torch.SparseLinear.from_mask(w, m, b)
        self.assertEqual(list(owned.parameters()), [])
        x = torch.randn(5, 9)
        owned(x).square().sum().backward()
        twin(x).square().sum().backward()
        self.assertTrue(owned.step())
        want = twin.values.detach() - 0.1 * twin.values.grad
        self.assertLess(relative(owned.layer.values(), want), 1e-5)
        with self.assertRaises(RuntimeError):
            twin.step()

    def test_without_bias(self):
        torch.manual_seed(6)
        layer = sluice_torch.SparseLinear(10, 4, bias=False, sparsity=0.5)
        self.assertIsNone(layer.bias)
        x = torch.randn(3, 10)
        y = layer(x)
        self.assertLess(relative(y, x @ layer.dense_weight().t()), 1e-5)
        y.sum().backward()
        self.assertEqual(layer.values.grad.shape, layer.values.shape)

    def test_bfloat16(self):
        torch.manual_seed(5)
        layer = sluice_torch.SparseLinear(64, 32, sparsity=0.75)
        x = torch.randn(16, 64)
        y = layer(x.bfloat16())
        self.assertEqual(y.dtype, torch.bfloat16)
        self.assertLess(relative(y.float(), layer(x).detach()), 2e-2)

    def test_bad_input(self):
        layer = sluice_torch.SparseLinear(4, 2)
        with self.assertRaisesRegex(RuntimeError, r"expected \[\.\.\., 4\]"):
            layer(torch.randn(3, 5))
        with self.assertRaises(ValueError):
            sluice_torch.SparseLinear(4, 2, sparsity=1.0)


if __name__ == "__main__":
    unittest.main()
