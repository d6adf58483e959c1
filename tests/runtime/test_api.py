"""`nimble.Nimble(module).prepare(...)` on the CPU: inference parity, training parity with eager
PyTorch over SGD steps, `save`, and one-line errors. (The CUDA-graph path: test_gpu_training.py.)"""

from __future__ import annotations

import copy

import nimble
import pytest
import torch
import torch.nn.functional as F
from nimble.errors import ModelError, ShapeError, UnsupportedError, UsageError
from torch import nn

from sample_models.build import MODELS, build_module
from tests.models import StochasticNet, UnsupportedOp

CLASSIFIERS = ["resnet", "inception", "mobilenet", "nasnet"]


def _example(name: str, batch: int = 2) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn((batch, *s[1:]), generator=gen) for s in MODELS[name][1]]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_inference_matches_the_module(name):
    module = build_module(name).eval()
    xs = _example(name)
    model = nimble.Nimble(module).prepare(tuple(xs))
    with torch.no_grad():
        want = module(*xs)
    got = model(*xs)
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        want, got = (want,), (got,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert model(*xs)[0] is not model(*xs)[0]  # fresh tensors, not views of nimble's buffers


def _train(step_fn, module, steps, seed=0):
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        x = torch.randn(4, 3, 32, 32, generator=gen)
        y = torch.randint(0, 10, (4,), generator=gen)
        torch.manual_seed(step)  # one dropout draw per step, the same for both runs
        loss = F.cross_entropy(step_fn(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("factory", [*CLASSIFIERS, "stochastic"])
def test_training_matches_eager_pytorch(factory):
    module = StochasticNet() if factory == "stochastic" else build_module(factory)
    eager = copy.deepcopy(module).train()
    model = nimble.Nimble(module).prepare(torch.randn(4, 3, 32, 32), training=True)
    assert module.training
    got = _train(model, module, 5)
    want = _train(eager, eager, 5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(module.state_dict().items(), eager.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)  # incl. running stats
    for (name, p), q in zip(module.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)  # sum order may differ


def test_prepare_leaves_batch_norm_statistics_alone():
    module = build_module("resnet")
    before = copy.deepcopy(module.state_dict())
    nimble.Nimble(module).prepare(torch.randn(4, 3, 32, 32), training=True)
    for name, t in module.state_dict().items():
        assert torch.equal(t, before[name]), name


def test_dropout_draws_fresh_numbers_each_call():
    module = StochasticNet()
    model = nimble.Nimble(module).prepare(torch.randn(4, 3, 16, 16), training=True)
    x = torch.randn(4, 3, 16, 16)
    assert not torch.equal(model(x), model(x))


def test_save_writes_the_artifact_compile_would(tmp_path):
    module = build_module("resnet").eval()
    x = torch.randn(1, 3, 32, 32)
    model = nimble.Nimble(module).prepare(x, streams=2)
    model.save(tmp_path / "m.nimble")
    exe = nimble.load(tmp_path / "m.nimble", device="cpu")  # beside the module, also on a GPU machine
    torch.testing.assert_close(exe(x), model(x), rtol=1e-5, atol=1e-6)
    assert exe.artifact.manifest["options"]["streams"] == "2"


def test_save_after_training_holds_the_trained_weights(tmp_path):
    module = build_module("resnet")
    model = nimble.Nimble(module).prepare(torch.randn(4, 3, 32, 32), training=True)
    _train(model, module, 2)
    model.save(tmp_path / "trained.nimble")
    assert module.training  # save compiles in eval mode and puts the mode back
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        want = module.eval()(x)
    torch.testing.assert_close(nimble.load(tmp_path / "trained.nimble", device="cpu")(x), want, rtol=1e-4,
                               atol=1e-5)


def test_inference_exports_first_and_says_so():
    model = nimble.Nimble(build_module("inception").eval()).prepare(torch.randn(1, 3, 32, 32))
    assert model.frontend == "torch.export" and model.fallback is None
    assert model._compiled.options["frontend"] == "torch.export"


class _ItemBranch(nn.Module):  # control flow on a tensor's value: export refuses, a trace follows one branch
    def forward(self, x):
        return x * 2 if x.sum().item() > 0 else x * 3


def test_a_trace_that_depends_on_values_is_refused_naming_the_line():
    with pytest.warns(nimble.NimbleWarning, match="torch.export failed"):
        with pytest.raises(nimble.UnsupportedError, match=r"converting a tensor to a python number at .*test_api.py:\d+"):
            nimble.Nimble(_ItemBranch()).prepare(torch.ones(2, 3))


def test_a_failed_export_prints_nothing_of_torch(capfd, monkeypatch):
    """torch.export's refusal wrote its partial graph (dozens of lines) and a log line to stderr
    before nimble's one line; only the warning and the error say anything now, unless NIMBLE_DEBUG."""
    monkeypatch.delenv("NIMBLE_DEBUG", raising=False)
    with pytest.warns(nimble.NimbleWarning), pytest.raises(nimble.UnsupportedError):
        nimble.Nimble(_ItemBranch()).prepare(torch.ones(2, 3))
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out + err)[:2000]
    monkeypatch.setenv("NIMBLE_DEBUG", "1")
    with pytest.warns(nimble.NimbleWarning), pytest.raises(nimble.UnsupportedError):
        nimble.Nimble(_ItemBranch()).prepare(torch.ones(2, 3))
    assert "def forward" in capfd.readouterr().err


def test_strict_false_still_checks_the_trace_on_other_inputs():
    """The issue's case: prepare() used to succeed and return 0.75-off results for inputs that take
    the other branch."""
    with pytest.warns(nimble.NimbleWarning), pytest.raises(nimble.MismatchError, match="differs from the module on a"):
        nimble.Nimble(_ItemBranch()).prepare(torch.ones(2, 3), strict=False)


def test_a_module_that_does_not_export_is_traced_warned_and_checked(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("export is unavailable here")

    monkeypatch.setattr(torch.export, "export", refuse)
    module = build_module("inception").eval()
    x = torch.randn(1, 3, 32, 32)
    with pytest.warns(nimble.NimbleWarning, match=r"export is unavailable here\); nimble traces it instead"):
        model = nimble.Nimble(module).prepare(x)
    assert model.frontend == "torchscript (traced)" and model.fallback.startswith("torch.export failed")
    torch.testing.assert_close(model(x), module(x), rtol=1e-4, atol=1e-5)


def test_training_traces():
    model = nimble.Nimble(build_module("resnet")).prepare(torch.randn(2, 3, 32, 32), training=True)
    assert model.frontend == "torchscript (traced)"


def test_a_scripted_module_is_accepted():
    module = torch.jit.script(build_module("inception").eval())
    x = torch.randn(1, 3, 32, 32)
    model = nimble.Nimble(module).prepare(x)
    torch.testing.assert_close(model(x), module(x), rtol=1e-4, atol=1e-5)
    assert model.frontend == "torchscript"


# ---------------------------------------------------------------------------------- errors
def _one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and text
    return text


@pytest.fixture
def prepared():
    module = build_module("resnet")
    return module, nimble.Nimble(module).prepare(torch.randn(4, 3, 32, 32), training=True)


def test_inputs_that_require_grad_are_refused(prepared):
    _, model = prepared
    with pytest.raises(UsageError) as e:
        model(torch.randn(4, 3, 32, 32, requires_grad=True))
    assert "requires grad" in _one_line(e)
    with pytest.raises(UsageError):
        nimble.Nimble(build_module("resnet")).prepare(torch.randn(4, 3, 32, 32, requires_grad=True))


def test_a_shape_other_than_the_prepared_one_is_refused(prepared):
    _, model = prepared
    with pytest.raises(ShapeError) as e:
        model(torch.randn(8, 3, 32, 32))
    assert "[8, 3, 32, 32]" in _one_line(e) and "[4, 3, 32, 32]" in str(e.value)
    with pytest.raises(ShapeError):
        model(torch.randn(4, 3, 32, 32), torch.randn(1))


def test_an_inference_call_checks_its_inputs_once_and_says_to_prepare_another_shape(monkeypatch):
    """The prepared runner checks count, shapes, dtypes and index values as it copies the inputs
    in; `Nimble.__call__` adds only the device and gradient checks, so each input is checked once."""
    from nimble.runtime.assemble import inputs

    model = nimble.Nimble(build_module("resnet").eval()).prepare(torch.randn(4, 3, 32, 32))
    calls = []
    real = inputs.check_inputs
    monkeypatch.setattr(inputs, "check_inputs", lambda *a, **k: calls.append(1) or real(*a, **k))
    model(torch.randn(4, 3, 32, 32))
    assert calls == [1]
    with pytest.raises(ShapeError) as e:
        model(torch.randn(8, 3, 32, 32))
    assert "call prepare() with an example of this shape" in _one_line(e) and "compile" not in str(e.value)
    with pytest.raises(ShapeError, match="float32"):
        model(torch.randn(4, 3, 32, 32, dtype=torch.float64))
    with pytest.raises(ShapeError, match="takes 1 input"):
        model()


def test_replacing_a_parameter_after_prepare_is_refused(prepared):
    module, model = prepared
    module.fc.weight = nn.Parameter(torch.zeros_like(module.fc.weight))
    with pytest.raises(ModelError) as e:
        model(torch.randn(4, 3, 32, 32))
    assert "fc.weight" in _one_line(e) and "prepare() again" in str(e.value)


def test_in_place_weight_changes_are_refused_for_inference_only(prepared):
    module = build_module("resnet").eval()
    model = nimble.Nimble(module).prepare(torch.randn(1, 3, 32, 32))
    with torch.no_grad():
        module.fc.bias.add_(1)  # load_state_dict does this too
    with pytest.raises(ModelError) as e:
        model(torch.randn(1, 3, 32, 32))
    assert "written in place" in _one_line(e)
    _, trained = prepared  # an optimizer step writes in place: fine for training
    _train(trained, trained.module, 1)


def test_new_storage_and_replaced_buffers_are_refused_and_an_untouched_module_is_not(prepared):
    def new_storage(m):
        m.fc.weight.data = m.fc.weight.data.clone()

    def replaced_buffer(m):
        m.layers[0].bn2.running_mean = m.layers[0].bn2.running_mean.clone()

    for change, word in ((new_storage, "new storage"), (replaced_buffer, "replaced")):
        module = build_module("resnet").eval()
        model = nimble.Nimble(module).prepare(torch.randn(1, 3, 32, 32))
        model(torch.randn(1, 3, 32, 32))  # unchanged: accepted, call after call
        model(torch.randn(1, 3, 32, 32))
        change(module)
        with pytest.raises(ModelError) as e:
            model(torch.randn(1, 3, 32, 32))
        assert word in _one_line(e)


class _ConvBn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def _changes():
    """Every way a user changes a weight after prepare(): (what it does, the tensor it names)."""
    def kept_data_alias(m):
        alias = m.conv.weight.data
        yield  # a call between taking the alias and writing through it
        alias.mul_(2)

    def once(change):
        def gen(m):
            yield
            change(m)
        return gen

    def no_grad(change):
        def run(m):
            with torch.no_grad():
                change(m)
        return run

    return [
        ("data_mul", once(lambda m: m.conv.weight.data.mul_(2)), "conv.weight"),  # the case
        ("kept_data_alias", kept_data_alias, "conv.weight"),
        ("detach_zero", once(lambda m: m.conv.weight.detach().zero_()), "conv.weight"),
        ("view_write", once(lambda m: m.conv.weight.data.view(-1)[:3].fill_(0)), "conv.weight"),
        ("copy_no_grad", once(no_grad(lambda m: m.conv.bias.copy_(torch.ones(4)))), "conv.bias"),
        ("set_", once(no_grad(lambda m: m.conv.bias.set_(torch.ones(4)))), "conv.bias"),
        ("setitem_buffer", once(lambda m: m.bn.running_mean.__setitem__(0, 5.0)), "bn.running_mean"),
        ("in_place_operator", once(no_grad(lambda m: m.bn.weight.__imul__(3))), "bn.weight"),
        ("init", once(lambda m: nn.init.zeros_(m.bn.bias)), "bn.bias"),
        ("foreach", once(no_grad(lambda m: torch._foreach_add_([m.bn.bias], [torch.ones(4)]))), "bn.bias"),
        ("out", once(lambda m: torch.add(torch.ones(4), 1, out=m.bn.running_var)), "bn.running_var"),
        ("load_state_dict", once(lambda m: m.load_state_dict(_ConvBn().state_dict())), "conv.weight"),
        ("assign", once(lambda m: m.load_state_dict(_ConvBn().state_dict(), assign=True)), "conv.weight"),
        ("to_double", once(lambda m: m.to(torch.float64)), "conv.weight"),
        ("del_and_set", once(lambda m: m.bn._buffers.pop("running_var")), "bn.running_var"),
        ("new_submodule", once(lambda m: setattr(m, "conv", nn.Conv2d(3, 4, 3))), "conv"),
    ]


@pytest.mark.parametrize("label,change,tensor", _changes(), ids=[c[0] for c in _changes()])
def test_no_change_to_the_module_gives_a_stale_answer(label, change, tensor):
    """Issue 62: `conv.weight.data.mul_(2)` on a conv + batch norm model changed nothing (off by 2.06,
    no error). Each change is refused at the next call, naming the tensor and what to do."""
    torch.manual_seed(0)
    module = _ConvBn().eval()
    x = torch.randn(1, 3, 8, 8)
    model = nimble.Nimble(module).prepare(x)
    steps = change(module)
    next(steps)
    model(x)  # nothing changed yet
    next(steps, None)
    with pytest.raises(ModelError) as e:
        model(x)
    line = _one_line(e)
    assert f"'{tensor}" in line and "prepare() again" in line, line


def test_two_shapes_of_one_module_prepared_side_by_side_stay_valid():
    """A second Nimble (another shape) exports the same module, and torch.export swaps its
    parameters out and back while it traces: that is no change to the first."""
    module = _ConvBn().eval()
    small, large = torch.randn(1, 3, 8, 8), torch.randn(2, 3, 8, 8)
    first = nimble.Nimble(module).prepare(small)
    second = nimble.Nimble(module).prepare(large)
    first.prepare(small)  # and again, on a watched module
    with torch.no_grad():
        assert torch.allclose(first(small), module(small), atol=1e-5)
        assert torch.allclose(second(large), module(large), atol=1e-5)
    module.conv.weight.data.mul_(2)
    for model, x in ((first, small), (second, large)):
        with pytest.raises(ModelError, match="'conv.weight' was written in place"):
            model(x)


def test_reading_the_module_is_no_change_and_its_classes_come_back():
    import copy
    import gc
    import io

    module = _ConvBn().eval()
    x = torch.randn(1, 3, 8, 8)
    model = nimble.Nimble(module).prepare(x)
    module.conv.weight.data.sum(), module.state_dict(), copy.deepcopy(module), repr(module.conv.weight)
    buf = io.BytesIO()
    torch.save(module, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded.conv.weight) is nn.Parameter and type(loaded.bn.running_mean) is torch.Tensor
    with torch.no_grad():
        want = module(x)  # eager, beside the prepared model
    assert torch.allclose(model(x), want, atol=1e-5)
    del model
    gc.collect()
    assert type(module.conv.weight) is nn.Parameter and type(module.bn.running_mean) is torch.Tensor
    assert type(module.conv._parameters) is dict


def test_a_torchscript_module_changed_after_prepare_is_refused():
    """A TorchScript module's parameters sit behind wrappers, not dicts: read through getattr."""
    module = torch.jit.script(build_module("resnet").eval())
    model = nimble.Nimble(module).prepare(torch.randn(1, 3, 32, 32))
    model(torch.randn(1, 3, 32, 32))
    with torch.no_grad():
        module.fc.bias.add_(1)
    with pytest.raises(ModelError) as e:
        model(torch.randn(1, 3, 32, 32))
    assert "fc.bias" in _one_line(e) and "written in place" in _one_line(e)
    module = torch.jit.script(build_module("resnet").eval())
    model = nimble.Nimble(module).prepare(torch.randn(1, 3, 32, 32))
    module.fc.weight = nn.Parameter(module.fc.weight.detach().clone())
    with pytest.raises(ModelError) as e:
        model(torch.randn(1, 3, 32, 32))
    assert "'fc.weight' was replaced" in _one_line(e)


def test_switching_mode_after_prepare_is_refused(prepared):
    module, model = prepared
    module.eval()
    with pytest.raises(UsageError) as e:
        model(torch.randn(4, 3, 32, 32))
    assert "training=False" in _one_line(e)


def test_unsupported_ops_and_misuse_are_one_line():
    with pytest.raises(UnsupportedError) as e:
        nimble.Nimble(UnsupportedOp()).prepare(torch.randn(3, 3))
    assert "linalg_inv" in _one_line(e)
    with pytest.raises(UsageError) as e:
        nimble.Nimble(build_module("resnet"))(torch.randn(1, 3, 32, 32))
    assert "prepare" in _one_line(e)
    with pytest.raises(UsageError):
        nimble.Nimble(lambda x: x)
    with pytest.raises(UsageError):
        nimble.Nimble(build_module("resnet")).prepare("not a tensor")
    with pytest.raises(UsageError):
        nimble.Nimble(build_module("resnet")).prepare(torch.randn(1, 3, 32, 32), streams="many")
    with pytest.raises(ModelError):
        nimble.Nimble(build_module("resnet").requires_grad_(False)).prepare(torch.randn(2, 3, 32, 32),
                                                                           training=True)


def test_both_runtimes_say_what_they_hold_and_their_aliasing_rule(tmp_path):
    from ..cli.test_cli import invoke
    from ..conftest import SAMPLES

    out = tmp_path / "r.nimble"
    assert invoke("compile", SAMPLES / "resnet.pt", "-s", "1x3x32x32", "--device", "cpu", "-o", out).exit_code == 0
    text = repr(nimble.load(out, device="cpu"))
    assert "x: float32[1, 3, 32, 32]" in text and "on cpu" in text and "fresh tensors" in text
    assert "-> (" in text and "serially" in text
    module = nimble.Nimble(torch.nn.Linear(4, 2))
    assert "not prepared" in repr(module)
    module.prepare(torch.randn(3, 4))
    text = repr(module)
    assert "float32[3, 4]" in text and "float32[3, 2]" in text and "on cpu" in text and "fresh tensors" in text


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        y = self.fc(x)
        return y.relu(), y * 2


@pytest.mark.parametrize("heads", [1, 2])
def test_both_runtimes_return_what_the_module_would_under_one_aliasing_rule(tmp_path, heads):
    net = _TwoHeads().eval() if heads == 2 else nn.Linear(4, 3).eval()
    x, other = torch.randn(2, 4), torch.randn(2, 4)
    prepared = nimble.Nimble(net).prepare(x)
    prepared.save(tmp_path / "m.nimble")
    loaded = nimble.load(tmp_path / "m.nimble", device="cpu")
    with torch.no_grad():
        want = net(x)
    for runtime in (prepared, loaded):
        first = runtime(x)
        assert type(first) is type(want)  # a tensor for one output, a tuple for several
        if heads == 2:
            assert len(first) == 2
        kept = [t.clone() for t in (first if heads == 2 else [first])]
        runtime(other)  # fresh tensors: the next call leaves them alone
        for t, k in zip(first if heads == 2 else [first], kept):
            assert torch.equal(t, k)
        torch.testing.assert_close(first, want)
        views = runtime(x, copy=False)  # no copy: the next call writes the same storage
        again = runtime(other, copy=False)
        for a, b in zip(views if heads == 2 else [views], again if heads == 2 else [again]):
            assert a.data_ptr() == b.data_ptr()
    listed = loaded.run(x)
    assert isinstance(listed, list) and len(listed) == heads
