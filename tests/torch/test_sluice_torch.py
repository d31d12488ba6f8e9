"""The Python module sluice_torch under Debian's python3-torch: gradcheck of the op,
drop-in equality with a masked torch.nn.Linear, the constructors, sluice's optimizer, and
state_dict, deepcopy, pickle and TorchScript round trips that carry the mask."""
import copy
import math
import io
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

    def test_a_second_derivative_through_the_layer_is_refused(self):
        # A gradient penalty through the layer: its terms would be missing from the second
        # derivative (the engine's backward is not differentiable), so it raises instead.
        torch.manual_seed(3)
        net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(),
                                  sluice_torch.SparseLinear(6, 4, sparsity=0.5), torch.nn.Tanh())
        x = torch.randn(5, 6, requires_grad=True)
        g, = torch.autograd.grad(net(x).sum(), x, create_graph=True)
        x0 = x.detach().clone().requires_grad_(True)
        g0, = torch.autograd.grad(net(x0).sum(), x0)
        self.assertTrue(torch.equal(g.detach(), g0))  # the first derivative is the same
        with self.assertRaisesRegex(RuntimeError, "sluice SparseLinear: its backward is not "
                                                  "differentiable"):
            g.square().sum().backward()


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

    def test_autocast_takes_float32_inputs_in_bfloat16(self):
        # As torch.nn.Linear under torch.autocast("cpu"): a bf16 product, X's gradient in fp32.
        torch.manual_seed(6)
        layer = sluice_torch.SparseLinear(37, 19, sparsity=0.7)
        x = torch.randn(5, 37)
        xb = x.bfloat16().requires_grad_()
        want = layer(xb)
        want.sum().backward()
        xa = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(xa)
            y64 = layer(x.double())
        self.assertEqual(y.dtype, torch.bfloat16)
        self.assertTrue(torch.equal(y, want))
        y.sum().backward()
        self.assertEqual(xa.grad.dtype, torch.float32)
        self.assertTrue(torch.equal(xa.grad, xb.grad.float()))
        self.assertEqual(y64.dtype, torch.float64)
        self.assertEqual(layer(x).dtype, torch.float32)

    def test_bad_input(self):
        layer = sluice_torch.SparseLinear(4, 2)
        with self.assertRaisesRegex(RuntimeError, r"expected \[\.\.\., 4\]"):
            layer(torch.randn(3, 5))
        with self.assertRaisesRegex(RuntimeError, "values on meta, not the CPU"):
            copy.deepcopy(layer).to("meta")(torch.randn(3, 4))
        with self.assertRaises(ValueError):
            sluice_torch.SparseLinear(4, 2, sparsity=1.0)
        for sizes in ((0, 2), (4, 0)):
            with self.assertRaisesRegex(ValueError, "at least 1"):
                sluice_torch.SparseLinear(*sizes)
        with self.assertRaisesRegex(TypeError, "integer"):
            sluice_torch.SparseLinear(4.0, 2)
        with self.assertRaisesRegex(ValueError, r"bias of shape \(3,\) for 2 outputs"):
            sluice_torch.SparseLinear.from_mask(torch.ones(2, 4), torch.ones(2, 4), torch.ones(3))
        with self.assertRaisesRegex(ValueError, r"weight of shape \(4,\): it must be \[out, in\]"):
            sluice_torch.SparseLinear.from_mask(torch.ones(4), torch.ones(4))

    def test_a_gradient_for_the_input_alone_leaves_the_weights(self):
        # autograd.grad with respect to the input (an adversarial example's, a saliency
        # map's) and a frozen layer compute dX alone: a sluice-owned layer's step then has
        # nothing to apply, a torch-held layer's parameters get no .grad.
        torch.manual_seed(14)
        owned = sluice_torch.SparseLinear(13, 7, sparsity=0.6, sluice_optimizer="sgd", lr=0.1)
        values = owned.layer.values().clone()
        x = torch.randn(5, 13, requires_grad=True)
        dx, = torch.autograd.grad(owned(x).square().sum(), x)
        w, b = owned.dense_weight(), owned.layer.bias()
        want = (2 * (x.detach() @ w.t() + b)) @ w
        self.assertLess(relative(dx, want), 1e-5)
        self.assertFalse(owned.step())
        self.assertTrue(torch.equal(owned.layer.values(), values))
        frozen = sluice_torch.SparseLinear.from_mask(w, owned.mask(), b).requires_grad_(False)
        x.grad = None
        frozen(x).square().sum().backward()
        self.assertLess(relative(x.grad, want), 1e-5)
        self.assertIsNone(frozen.values.grad)
        self.assertIsNone(frozen.bias.grad)

    def test_a_random_mask_is_drawn_without_a_dense_matrix(self):
        # 10^10 positions at 99.999%: the layer holds its 10^5 non-zeros and nothing of
        # the dense size (whose float32 tensor alone would take 40 GB); the positions are
        # distinct, spread as uniform draws spread them, and torch.manual_seed repeats them.
        torch.manual_seed(17)
        layer = sluice_torch.SparseLinear(100000, 100000, sparsity=0.99999)
        positions = layer.layer.mask_indices()
        self.assertEqual(positions.numel(), 100000)
        self.assertTrue(bool((positions[1:] > positions[:-1]).all()))
        rows_hit = (positions // 100000).unique().numel() / 100000
        self.assertLess(abs(rows_hit - (1 - math.exp(-1))), 0.01)  # 0.632 for uniform draws
        torch.manual_seed(17)
        again = sluice_torch.SparseLinear(100000, 100000, sparsity=0.99999)
        self.assertTrue(torch.equal(again.layer.mask_indices(), positions))
        self.assertTrue(torch.equal(again.values, layer.values))
        # A dense enough layer draws a permutation: every position once at sparsity 0.
        self.assertTrue(torch.equal(sluice_torch.SparseLinear(7, 5, sparsity=0.0).mask(),
                                    torch.ones(5, 7, dtype=torch.bool)))

    def test_an_empty_layer_trains_its_bias(self):
        w = torch.randn(3, 4)
        layer = sluice_torch.SparseLinear.from_mask(w, torch.zeros(3, 4), torch.zeros(3))
        x = torch.randn(2, 4)
        self.assertTrue(torch.equal(layer(x), torch.zeros(2, 3)))
        layer(x).sum().backward()
        self.assertEqual(layer.values.grad.shape, (0,))  # as an empty parameter's
        self.assertTrue(torch.equal(layer.bias.grad, torch.full((3,), 2.0)))

    def test_sluice_optimizer_accumulates_backward_passes(self):
        # Weights that are sluice's: the backward passes before a step add up, as a
        # torch-held twin's .grad does; the step applies the sum, the next starts afresh.
        torch.manual_seed(12)
        owned = sluice_torch.SparseLinear(9, 6, sparsity=0.5, sluice_optimizer="sgd", lr=0.1)
        twin = sluice_torch.SparseLinear.from_mask(owned.dense_weight(), owned.mask(),
                                                   owned.layer.bias())
        sgd = torch.optim.SGD(twin.parameters(), lr=0.1)
        for micro_batches in (3, 1):
            sgd.zero_grad()
            for k in range(micro_batches):
                x = torch.randn(2 + k, 9)
                owned(x).square().sum().backward()
                twin(x).square().sum().backward()
            self.assertTrue(owned.step())
            sgd.step()
            self.assertTrue(torch.allclose(owned.layer.values(), twin.values.detach(),
                                           rtol=1e-5, atol=1e-6))
            self.assertTrue(torch.allclose(owned.layer.bias(), twin.bias.detach(),
                                           rtol=1e-5, atol=1e-6))
        # The layer's zero_grad drops what its backward passes handed in.
        owned(torch.randn(2, 9)).sum().backward()
        owned.zero_grad()
        self.assertFalse(owned.step())


class StateDict(unittest.TestCase):
    def round_trip(self, state):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        return torch.load(buffer)

    def test_loads_into_a_layer_of_another_mask_and_trains_on(self):
        torch.manual_seed(7)
        saved = sluice_torch.SparseLinear(40, 30, sparsity=0.8)
        x = torch.randn(9, 40)
        for sparsity in (0.8, 0.5):
            other = sluice_torch.SparseLinear(40, 30, sparsity=sparsity)  # another mask
            sgd = torch.optim.SGD(other.parameters(), lr=0.1)  # made before the load
            self.assertFalse(torch.equal(other.mask(), saved.mask()))
            other(x).sum().backward()  # a gradient of its own mask, dropped by the load
            other.load_state_dict(self.round_trip(saved.state_dict()))
            self.assertTrue(torch.equal(other.mask(), saved.mask()))
            self.assertIsNone(other.values.grad)
            self.assertTrue(torch.equal(other(x), saved(x)))
            other(x).sum().backward()
            sgd.step()
            self.assertFalse(torch.equal(other(x), saved(x)))

    def test_sluice_owned_layers_save_their_values(self):
        torch.manual_seed(8)
        x = torch.randn(6, 20)
        owned = sluice_torch.SparseLinear(20, 10, sparsity=0.7, sluice_optimizer="adam")
        state = owned.state_dict()
        self.assertEqual(sorted(state), ["bias", "mask_indices", "optimizer_state", "values"])
        again = sluice_torch.SparseLinear(20, 10, sparsity=0.7, sluice_optimizer="adam")
        again.load_state_dict(self.round_trip(state))
        self.assertTrue(torch.equal(again(x), owned(x)))
        torch_owned = sluice_torch.SparseLinear(20, 10, sparsity=0.9)
        torch_owned.load_state_dict(state)
        self.assertTrue(torch.equal(torch_owned(x), owned(x)))
        again(x).square().sum().backward()  # its ModelMemory goes on training
        self.assertTrue(again.step())
        self.assertFalse(torch.equal(again(x), owned(x)))
        # A whole model, as trainers save it.
        net = torch.nn.Sequential(sluice_torch.SparseLinear(20, 16), torch.nn.ReLU(),
                                  sluice_torch.SparseLinear(16, 3, sluice_optimizer="sgd"))
        twin = torch.nn.Sequential(sluice_torch.SparseLinear(20, 16), torch.nn.ReLU(),
                                   sluice_torch.SparseLinear(16, 3, sluice_optimizer="sgd"))
        twin.load_state_dict(self.round_trip(net.state_dict()))
        self.assertTrue(torch.equal(twin(x), net(x)))

    def test_a_sluice_optimizer_resumes_from_its_state_dict(self):
        # Adam's moments, its step and its settings are in the state_dict: a layer loaded
        # from it (another mask, another optimizer before) goes on bit for bit as the saved
        # one, a learning rate set on both included; without them it starts Adam afresh.
        torch.manual_seed(15)
        batches = [(torch.randn(6, 13), torch.randn(6, 7)) for _ in range(5)]

        def train(layer, some):
            for x, target in some:
                (layer(x) - target).square().sum().backward()
                self.assertTrue(layer.step())

        saved = sluice_torch.SparseLinear(13, 7, sparsity=0.6, sluice_optimizer="adam", lr=0.01)
        train(saved, batches[:3])
        state = self.round_trip(saved.state_dict())
        resumed = sluice_torch.SparseLinear(13, 7, sparsity=0.3, sluice_optimizer="sgd", lr=0.5)
        resumed.load_state_dict(state)
        self.assertEqual(resumed.lr, 0.01)
        afresh = sluice_torch.SparseLinear(13, 7, sparsity=0.3, sluice_optimizer="adam", lr=0.01)
        afresh.load_state_dict({k: v for k, v in state.items() if k != "optimizer_state"})
        for layer in (saved, resumed, afresh):
            layer.lr = 0.02
            train(layer, batches[3:])
        self.assertTrue(torch.equal(resumed.layer.values(), saved.layer.values()))
        self.assertTrue(torch.equal(resumed.layer.bias(), saved.layer.bias()))
        self.assertFalse(torch.equal(afresh.layer.values(), saved.layer.values()))
        # A torch-held layer takes the values and leaves the optimizer to torch.
        held = sluice_torch.SparseLinear(13, 7)
        held.load_state_dict(state)
        self.assertTrue(torch.equal(held.values.detach(), state["values"]))
        with self.assertRaisesRegex(RuntimeError, "not a positive number"):
            saved.lr = -1.0
        with self.assertRaisesRegex(RuntimeError, "learning rate of the torch optimizer"):
            held.lr = 0.1
        # Between a backward pass and its step the rate is refused, saying so; it stays.
        saved(batches[0][0]).sum().backward()
        with self.assertRaisesRegex(RuntimeError, "lr is set between steps"):
            saved.lr = 0.5
        self.assertEqual(saved.lr, 0.02)
        saved.zero_grad()
        saved.lr = 0.5
        self.assertEqual(saved.lr, 0.5)

    def test_a_saved_optimizer_state_that_does_not_fit_is_refused(self):
        torch.manual_seed(16)
        saved = sluice_torch.SparseLinear(13, 7, sparsity=0.6, sluice_optimizer="adam")
        good = saved.state_dict()
        corrupt = good["optimizer_state"].clone()
        corrupt[100] ^= 1
        layer = sluice_torch.SparseLinear(13, 7, sparsity=0.6, sluice_optimizer="sgd", lr=0.5)
        x = torch.randn(4, 13)
        before = layer(x)
        not_saved = "not a layer's saved state"
        for state, words in ((dict(good, optimizer_state=corrupt), not_saved),
                             (dict(good, optimizer_state=corrupt[:50]), not_saved),
                             (dict(good, values=good["values"] + 1), "values differs"),
                             (dict(good, optimizer_state=good["values"]), "uint8")):
            with self.assertRaisesRegex(RuntimeError, words):
                layer.load_state_dict(state)
            self.assertTrue(torch.equal(layer(x), before))
            self.assertEqual(layer.lr, 0.5)
        for other in (sluice_torch.SparseLinear(13, 8, sluice_optimizer="adam"),
                      sluice_torch.SparseLinear(13, 7, bias=False, sluice_optimizer="adam")):
            with self.assertRaisesRegex(RuntimeError, "optimizer_state (of a layer of 13|has a)"):
                other.load_state_dict(good)

    def test_deepcopy_pickle_and_torchscript_keep_the_layer(self):
        torch.manual_seed(10)
        x = torch.randn(4, 33)
        for kwargs in ({}, {"bias": False}, {"sluice_optimizer": "sgd", "lr": 0.05}):
            layer = sluice_torch.SparseLinear(33, 17, sparsity=0.7, **kwargs)
            twin = copy.deepcopy(layer)
            self.assertTrue(torch.equal(twin(x), layer(x)), kwargs)
            self.assertTrue(torch.equal(twin.mask(), layer.mask()), kwargs)
            self.assertEqual(twin.layer.sluice_owned(), layer.layer.sluice_owned())
            twin(x).sum().backward()  # the copy trains apart from the original
            if twin.layer.sluice_owned():
                self.assertTrue(twin.step())
            else:
                with torch.no_grad():
                    twin.values -= 0.1 * twin.values.grad
            self.assertFalse(torch.equal(twin(x), layer(x)), kwargs)
            self.assertTrue(torch.equal(self.round_trip(layer)(x), layer(x)), kwargs)
        scripted = torch.jit.script(layer)
        buffer = io.BytesIO()
        torch.jit.save(scripted, buffer)
        buffer.seek(0)
        self.assertTrue(torch.equal(torch.jit.load(buffer)(x), layer(x)))

    def test_a_copy_keeps_the_sluice_optimizers_state(self):
        # A sluice_optimizer layer copied or pickled mid-run (a best model kept aside) goes on
        # as the original does, bit for bit: Adam's moments and step come with it.
        torch.manual_seed(12)
        x = torch.randn(6, 20)
        layer = sluice_torch.SparseLinear(20, 9, sparsity=0.6, sluice_optimizer="adam", lr=0.01)
        for _ in range(3):
            layer(x).pow(2).sum().backward()
            layer.step()
        copies = [copy.deepcopy(layer), self.round_trip_pickle(layer)]
        for twin in [layer] + copies:
            twin(x).pow(2).sum().backward()
            self.assertTrue(twin.step())
        for twin in copies:
            self.assertTrue(torch.equal(twin.layer.values(), layer.layer.values()))
            self.assertTrue(torch.equal(twin.state_dict()["optimizer_state"],
                                        layer.state_dict()["optimizer_state"]))
            self.assertEqual(twin.lr, layer.lr)

    @staticmethod
    def round_trip_pickle(module):
        buffer = io.BytesIO()
        torch.save(module, buffer)
        buffer.seek(0)
        return torch.load(buffer)

    def test_a_pickled_module_holds_its_values_once(self):
        torch.manual_seed(11)
        for kwargs in ({}, {"sluice_optimizer": "sgd"}):
            layer = sluice_torch.SparseLinear(256, 256, sparsity=0.5, **kwargs)
            pickled, state = io.BytesIO(), io.BytesIO()
            torch.save(layer, pickled)
            torch.save(layer.state_dict(), state)
            # A state_dict holds 12 bytes a non-zero (its position, its value): the values
            # pickled twice (the parameters and the layer's copy) would add a third.
            self.assertLess(len(pickled.getvalue()), 1.1 * len(state.getvalue()), kwargs)
            pickled.seek(0)
            x = torch.randn(3, 256)
            self.assertTrue(torch.equal(torch.load(pickled)(x), layer(x)), kwargs)

    def test_a_state_that_does_not_fit_is_refused_and_changes_nothing(self):
        torch.manual_seed(9)
        saved = sluice_torch.SparseLinear(12, 7, sparsity=0.5)
        layer = sluice_torch.SparseLinear(12, 7, sparsity=0.5)
        x = torch.randn(5, 12)
        before = layer(x).detach()
        good = saved.state_dict()
        for indices, words in ((good["mask_indices"].flip(0), "not increasing"),
                               (good["mask_indices"] + 84, "not increasing positions below 84"),
                               (good["mask_indices"][1:], "values for"),
                               (good["mask_indices"].int(), "int64")):
            with self.assertRaisesRegex(RuntimeError, words):
                layer.load_state_dict(dict(good, mask_indices=indices))
            self.assertTrue(torch.equal(layer(x), before))
        with self.assertRaisesRegex(RuntimeError, "Unexpected key.*bias"):
            sluice_torch.SparseLinear(12, 7, bias=False).load_state_dict(good)
        # A state saved without its mask loads into this layer's mask, when not strict.
        old = {"values": good["values"], "bias": good["bias"]}
        with self.assertRaisesRegex(RuntimeError, "Missing key.*mask_indices"):
            layer.load_state_dict(old)
        layer.load_state_dict(old, strict=False)
        self.assertTrue(torch.equal(layer.values.detach(), good["values"]))


if __name__ == "__main__":
    unittest.main()
