"""`Nimble(module).prepare(..., training=True)` on CUDA: captured forward and backward graphs
against eager PyTorch over 20 SGD-with-momentum steps, `.grad` semantics, dropout, parallelism."""

from __future__ import annotations

import copy

import nimble
import pytest
import torch
import torch.nn.functional as F
from nimble.errors import ModelError, UsageError
from nimble.ir import TensorSpec
from nimble.pipeline import compile_training
from nimble.runtime.training import TrainingGraph

from sample_models.build import build_module
from tests.models import StochasticNet
from tests.runtime.test_gpu_runtime import TwoBranches, _graph_shape

pytestmark = pytest.mark.gpu
SHAPE = (16, 3, 32, 32)


def _steps(step_fn, module, steps, seed=0, zero=True, lr=0.02):
    opt = torch.optim.SGD(module.parameters(), lr=lr, momentum=0.9)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    losses = []
    for step in range(steps):
        x = torch.randn(SHAPE, device="cuda", generator=gen)
        y = torch.randint(0, 10, (SHAPE[0],), device="cuda", generator=gen)
        torch.manual_seed(step)  # the same dropout draws for both runs
        loss = F.cross_entropy(step_fn(x), y)
        if zero:
            opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(autouse=True)
def cudnn_settings():
    before = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True  # no atomics in weight gradients: less noise to amplify
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic = before


def _trained(module, tf32: bool, use_nimble: bool):
    """(per-step losses, state, gradients) after 20 SGD-with-momentum steps from `module`'s weights."""
    torch.backends.cudnn.allow_tf32 = tf32
    net = copy.deepcopy(module).train()
    run = nimble.Nimble(net).prepare(torch.randn(SHAPE, device="cuda"), training=True) if use_nimble else net
    losses = _steps(run, net, 20, lr=0.005)
    return (torch.tensor(losses), {k: v.clone() for k, v in net.state_dict().items()},
            {n: p.grad.clone() for n, p in net.named_parameters()})


@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "tf32"])
@pytest.mark.parametrize("factory", ["resnet", "inception", "mobilenet", "nasnet", "stochastic"])
def test_20_sgd_steps_match_eager_pytorch(factory, tf32):
    """Batch norm (statistics and counter), dropout and stochastic depth, residual and
    multi-branch blocks. In fp32, nimble must track eager within 1e-3 (gradient sums run in
    another order across streams; SGD amplifies any rounding step by step). With TF32
    convolutions the tolerance is TF32's own effect on eager training: nimble may be at most
    twice as far from eager as eager with TF32 is from eager without it."""
    torch.manual_seed(0)
    module = (StochasticNet() if factory == "stochastic" else build_module(factory)).cuda()
    got = _trained(module, tf32, use_nimble=True)
    want = _trained(module, tf32, use_nimble=False)
    other = _trained(module, False, use_nimble=False) if tf32 else None

    def check(name, a, b, ref=None, rel=1e-3, floor=1e-5):
        if a.dtype == torch.int64:
            assert torch.equal(a, b), name  # num_batches_tracked: 20 exactly
            return
        error = (a - b).norm().item()
        allowed = rel * b.norm().item() if ref is None else 2 * (ref - b).norm().item()
        allowed += floor * b.numel() ** 0.5
        assert error <= allowed, f"{name}: |nimble - eager| = {error:.2e}, allowed {allowed:.2e}"

    check("losses", got[0], want[0], other[0] if other else None)
    for name in want[1]:
        check(name, got[1][name], want[1][name], other[1][name] if other else None)
    for name in want[2]:  # gradients react most to weight differences: 5x the tolerance
        check(f"{name}.grad", got[2][name], want[2][name], other[2][name] if other else None, rel=5e-3)


def test_grad_accumulation_zero_grad_and_clipping_work_as_in_eager():
    torch.manual_seed(0)
    module = build_module("resnet").cuda()
    eager = copy.deepcopy(module).train()
    model = nimble.Nimble(module).prepare(torch.randn(SHAPE, device="cuda"), training=True)
    x = torch.randn(SHAPE, device="cuda")
    for m, net in ((model, module), (eager, eager)):
        net.zero_grad(set_to_none=True)
        m(x).square().mean().backward()
        m(x).square().mean().backward()  # accumulates: two backward passes, no zero_grad between
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
    for p, q in zip(module.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3)
    module.zero_grad(set_to_none=False)  # zeroes the bound .grad tensors in place
    eager.zero_grad(set_to_none=False)
    model(x).sum().backward()
    eager(x).sum().backward()
    for p, q in zip(module.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-3)
    _steps(model, module, 3, zero=False)  # optimizer steps on accumulating grads still run


def test_dropout_draws_fresh_numbers_on_every_replay():
    module = StochasticNet().cuda()
    model = nimble.Nimble(module).prepare(torch.randn(SHAPE, device="cuda"), training=True)
    x = torch.randn(SHAPE, device="cuda")
    outs = [model(x) for _ in range(3)]
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


def test_the_backward_graph_inherits_the_forward_streams(tmp_path):
    module = TwoBranches().cuda().train()
    x = torch.randn(64, 1024, device="cuda")
    traced = torch.jit.trace(module, x)
    shapes = {}
    for streams in ("auto", 1):
        planned = compile_training(traced, [TensorSpec((64, 1024), "float32")], "TwoBranches", streams)
        TrainingGraph(module, planned.graph, planned.constants, planned.schedule, torch.device("cuda"),
                      graph_dump=str(tmp_path / f"{streams}_"))
        shapes[streams] = {part: _graph_shape((tmp_path / f"{streams}_{part}.dot").read_text())
                           for part in ("forward", "backward")}
    for part in ("forward", "backward"):
        roots, forks, joins = shapes["auto"][part]
        assert (roots >= 2 or forks >= 2) and joins >= 2, (part, shapes)


def test_errors_on_cuda():
    module = build_module("resnet").cuda()
    model = nimble.Nimble(module).prepare(torch.randn(SHAPE, device="cuda"), training=True)
    with pytest.raises(UsageError):
        model(torch.randn(SHAPE, device="cuda", requires_grad=True))
    with pytest.raises(nimble.ShapeError):
        model(torch.randn(SHAPE))  # on the CPU
    module.fc.weight.data = torch.zeros_like(module.fc.weight)  # new storage under the same tensor
    with pytest.raises(ModelError) as e:
        model(torch.randn(SHAPE, device="cuda"))
    assert "fc.weight" in str(e.value)
    with pytest.raises(UsageError):
        nimble.Nimble(module).prepare(torch.randn(SHAPE), training=True)  # module on CUDA, input not


def test_inference_prepare_on_cuda_matches_the_module():
    module = build_module("inception").cuda().eval()
    x = torch.randn(2, 3, 32, 32, device="cuda")
    model = nimble.Nimble(module).prepare(x)
    with torch.no_grad():
        torch.testing.assert_close(model(x), module(x), rtol=1e-2, atol=1e-3)
