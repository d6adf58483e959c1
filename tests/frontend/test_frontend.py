import warnings

import pytest
import torch

from nimble import frontend
from nimble.frontend import builder
from nimble.runtime.placed import reference
from nimble.runtime.base.compare import compare
from nimble.errors import ModelError, ShapeError, UnsupportedError, UsageError
from nimble.ir import TensorSpec
from nimble.ops.targets import is_allowed
from nimble.pipeline import rewrite, sample_inputs

from .. import models
from ..conftest import SAMPLES, save_script

HOST_KINDS = ("aten::size", "aten::Int", "prim::NumToTensor", "prim::ListConstruct", "prim::TupleConstruct")


def lower_file(path, shapes):
    """The graph fusion starts from: the frontend's, after the rewrite passes."""
    return rewrite(frontend.lower(frontend.load_module(path), [TensorSpec(tuple(s), "float32") for s in shapes],
                                  path.stem))


def test_every_sample_matches_torchscript(sample):
    name, path, shapes = sample
    lowered = lower_file(path, shapes)
    xs = sample_inputs(lowered.graph.values[i].spec for i in lowered.graph.inputs)
    expected = lowered.module(*xs)
    expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    result = compare(reference.run(lowered.graph, lowered.weights, xs), expected, rtol=1e-4, atol=0)
    assert result.max_rel <= 1e-4, result.describe()


def test_op_list_holds_only_allowlisted_device_tasks(sample):
    name, path, shapes = sample
    graph = lower_file(path, shapes).graph
    graph.lint()
    assert graph.ops, name
    for op in graph.ops:
        assert is_allowed(op.target), op.target
        assert not op.target.startswith(HOST_KINDS)
        assert op.source and op.source != "<unknown source>"
    for v in graph.values:
        assert all(isinstance(d, int) and d >= 0 for d in v.spec.shape)


def test_freezing_folds_batch_norm_into_convs():
    graph = lower_file(SAMPLES / "resnet.pt", [(1, 3, 224, 224)]).graph
    assert not any("batch_norm" in op.target for op in graph.ops)


def test_scripted_model_with_shape_branch_and_loop_is_unrolled(tmp_path):
    path = save_script(tmp_path, models.ShapeIfAndLoop(), "branchy")
    lowered = lower_file(path, [(1, 2, 2)])  # (1, 4) would make the view a no-op, which is no op at all
    assert [op.target for op in lowered.graph.ops] == [
        "aten::add.Scalar", "aten::mul.Scalar", "aten::mul.Scalar", "aten::mul.Scalar", "aten::view.default"]
    x = torch.randn(1, 2, 2)
    torch.testing.assert_close(reference.run(lowered.graph, lowered.weights, [x])[0], lowered.module(x))
    view = lowered.graph.values[lowered.graph.outputs[0]]
    assert view.alias_of == lowered.graph.ops[3].outputs[0]


def test_in_place_write_through_a_view_gets_ordering_edges(tmp_path):
    path = save_script(tmp_path, models.InPlaceThroughView(), "inplace")
    lowered = lower_file(path, [(2, 3)])
    g = lowered.graph
    by_target = {op.target: op for op in g.ops}
    write = by_target["aten::add_.Scalar"]
    mul = by_target["aten::mul.Scalar"]
    final = by_target["aten::add.Tensor"]
    assert write.mutates and mul.id in write.after  # the write waits for the earlier reader of y
    assert write.id in g.deps(final)  # the later reader of y waits for the write
    x = torch.randn(2, 3)
    torch.testing.assert_close(reference.run(g, lowered.weights, [x])[0], lowered.module(x))


def test_data_dependent_branch_names_the_source_line(tmp_path):
    path = save_script(tmp_path, models.DataDependentIf(), "datadep")
    with pytest.raises(UnsupportedError, match=r"depends on tensor values") as e:
        lower_file(path, [(2, 2)])
    assert "models.py:" in str(e.value)


def test_unsupported_op_is_named_with_its_source_line(tmp_path):
    path = save_script(tmp_path, models.UnsupportedOp(), "inv")
    with pytest.raises(UnsupportedError, match=r"aten::linalg_inv.* at .*models.py:\d+ is not supported"):
        lower_file(path, [(3, 3)])


def test_shape_the_model_rejects_names_the_op():
    with pytest.raises(ShapeError, match=r"input .x. of shape 1x4x64x64 \(float32\) does not fit aten::conv2d"):
        lower_file(SAMPLES / "resnet.pt", [(1, 4, 64, 64)])


def test_wrong_number_of_inputs():
    with pytest.raises(UsageError, match=r"takes 2 input\(s\) \(image, features\) but 1 shape"):
        lower_file(SAMPLES / "two_io.pt", [(1, 3, 64, 64)])


def test_a_different_batch_size_lowers_and_matches():
    lowered = lower_file(SAMPLES / "inception.pt", [(3, 3, 96, 96)])
    x = torch.randn(3, 3, 96, 96)
    out = reference.run(lowered.graph, lowered.weights, [x])[0]
    torch.testing.assert_close(out, lowered.module(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("content,match", [
    (None, "no such file"),
    (b"\x00\x01garbage" * 10, "nor a TorchScript archive"),
    ("state_dict", "torch.save checkpoint"),
])
def test_files_that_are_not_torchscript(tmp_path, content, match):
    path = tmp_path / "model.pt"
    if content == "state_dict":
        torch.save(torch.nn.Linear(2, 2).state_dict(), path)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelError, match=match):
        frontend.load_module(path)


def test_parallel_linears_stay_separate_ops(tmp_path):
    """Freezing may merge linears that share an input, which would remove branch parallelism."""
    path = save_script(tmp_path, models.ParallelLinears(), "parallel")
    graph = lower_file(path, [(2, 8)]).graph
    assert sum(op.target.startswith("aten::linear") for op in graph.ops) == 2


def test_frontend_silences_torchscript_deprecation_warnings():
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lower_file(SAMPLES / "two_io.pt", [(1, 3, 64, 64), (1, 8)])
    assert not [w for w in caught if "jit" in str(w.message) or "TorchScript" in str(w.message)
                or issubclass(w.category, (DeprecationWarning, FutureWarning))]
    with warnings.catch_warnings(record=True) as caught:  # and only inside the frontend
        warnings.simplefilter("always")
        torch.jit.load(str(SAMPLES / "two_io.pt"))
    # torch 2.13 warns with a DeprecationWarning, 2.14 with a FutureWarning
    assert any(issubclass(w.category, (DeprecationWarning, FutureWarning)) for w in caught)


@pytest.mark.parametrize("name", ["inception", "transformer", "two_io"])
def test_ops_without_meta_kernels_fall_back_to_the_cpu(monkeypatch, name):
    """Some torch versions lack meta kernels (torch 2.11 has none for aten::_convolution); the
    frontend then types outputs by running the op on the CPU and must build the same graph."""
    from ..conftest import MODELS

    shapes = MODELS[name][1]
    expected = lower_file(SAMPLES / f"{name}.pt", shapes).graph
    real_call = builder.GraphBuilder._call

    def no_meta(self, fn, args, kwargs, refs, device, target=None):
        if device == builder._META:
            raise NotImplementedError("no meta kernel (nor shape rule)")
        return real_call(self, fn, args, kwargs, refs, device)

    monkeypatch.setattr(builder.GraphBuilder, "_call", no_meta)
    assert lower_file(SAMPLES / f"{name}.pt", shapes).graph == expected


def test_source_lines_point_at_the_model_code_not_torch():
    graph = lower_file(SAMPLES / "inception.pt", [(1, 3, 224, 224)]).graph
    assert all("build.py:" in op.source for op in graph.ops), {op.source for op in graph.ops}


def test_views_alias_their_base_even_through_ops_that_return_views():
    """linear on 3-d input returns a view of a temporary; views of its result still alias it."""
    graph = lower_file(SAMPLES / "transformer.pt", [(1, 64, 128)]).graph
    view_ops = [op for op in graph.ops if op.target.split("::")[1].split(".")[0] in ("view", "transpose")]
    assert len(view_ops) == 7  # 8 as written; k's transpose went into scaled_dot_product_attention
    for op in view_ops:
        out = graph.values[op.outputs[0]]
        base = graph.values[out.alias_of]
        assert out.alias_of is not None and base.alias_of is None and base.kind == "activation", op


@pytest.mark.parametrize("size", [16, 17])
def test_traced_size_arithmetic_with_kwarg_only_arguments_folds(tmp_path, size):
    """Host arithmetic on traced sizes calls aten::sub.Tensor(a, b, *, alpha): kwarg-only
    arguments must reach torch by name (this failed on a NASNet-style zoo model)."""
    module = models.SamePadding().eval()
    x = torch.randn(1, 3, size, size)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = tmp_path / "same.pt"
        torch.jit.save(torch.jit.trace(module, x), str(path))
    lowered = lower_file(path, [(1, 3, size, size)])
    assert [op.target for op in lowered.graph.ops][-1].startswith("aten::")
    got = reference.run(lowered.graph, lowered.weights, [x])[0]
    with torch.no_grad():
        torch.testing.assert_close(got, module(x), rtol=1e-5, atol=1e-6)


def test_new_zeros_ones_and_full_lower_and_match(tmp_path):
    """torchvision's Swin models build masks with new_zeros (the zoo sweep found it unsupported)."""
    module = models.NewZeros().eval()
    x = torch.randn(2, 5)
    path = save_script(tmp_path, module, "new_zeros")
    raw = frontend.lower(frontend.load_module(path), [TensorSpec((2, 5), "float32")], path.stem)
    assert "aten::new_zeros.default" in {op.target for op in raw.graph.ops}
    torch.testing.assert_close(reference.run(raw.graph, raw.weights, [x])[0], module(x))
    lowered = lower_file(path, [(2, 5)])  # the mask reads no input: fold_constants makes it a weight
    assert "aten::new_zeros.default" not in {op.target for op in lowered.graph.ops}
    torch.testing.assert_close(reference.run(lowered.graph, lowered.weights, [x])[0], module(x))


def test_dict_outputs_and_3d_pooling_lower_and_match(tmp_path):
    """Segmentation models return a dict (its values become the outputs, in order); video models
    pool in 3-D."""
    module = models.DictAndPool3d().eval()
    x = torch.randn(1, 2, 4, 6, 6)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = tmp_path / "dict.pt"
        torch.jit.save(torch.jit.trace(module, x, strict=False), str(path))
    lowered = lower_file(path, [(1, 2, 4, 6, 6)])
    got = reference.run(lowered.graph, lowered.weights, [x])
    with torch.no_grad():
        want = module(x)
    assert len(got) == 2
    torch.testing.assert_close(got[0], want["out"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want["aux"], rtol=1e-5, atol=1e-6)


def test_views_that_change_nothing_or_repeat_are_not_ops(tmp_path):
    """x[:, :] is x; the same view of the same value taken twice is one op (swin's window slices);
    a copy with its input's geometry (.to(copy=True)) stays a copy."""
    from ..conftest import save_script

    class Views(torch.nn.Module):
        def forward(self, x):
            a = x[:, :] + 1
            b = x[:, 1:] * x[:, 1:]
            c = x.to(torch.float32, copy=True)
            x.add_(1)
            return a, b, c

    graph = lower_file(save_script(tmp_path, Views(), "views"), [(2, 4)]).graph
    targets = [op.target for op in graph.ops]
    assert targets.count("aten::slice.Tensor") == 1 and "aten::to.dtype" in targets


def _trace(tmp_path, module, x, name):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = tmp_path / f"{name}.pt"
        torch.jit.save(torch.jit.trace(module.eval(), x, check_trace=False, strict=False), str(path))
    return path


class _Anchors(torch.nn.Module):
    """Detection-model preprocessing: traced shapes as tensors, torch.empty(()).fill_(v), a top-k of
    scores, boxes kept where two conditions hold, and unbind of a batch of one."""

    def forward(self, images):
        (image,) = images.unbind(0)
        size = torch._shape_as_tensor(image)[-2:]
        stride = torch.empty((), dtype=torch.int64).fill_(int(image.shape[-1]) // 4)
        scores = image.mean(0).flatten()
        top, index = scores.topk(5)
        both = (scores > 0) & (scores < 1)
        return top * (size[0] // stride), index, both


def test_detection_preprocessing_lowers_and_matches(tmp_path):
    module, x = _Anchors(), torch.randn(1, 3, 8, 8)
    lowered = lower_file(_trace(tmp_path, module, x, "anchors"), [(1, 3, 8, 8)])
    targets = {op.target.split(".")[0] for op in lowered.graph.ops}
    assert {"aten::topk", "aten::__and__"} <= targets and "aten::empty" not in targets
    got = reference.run(lowered.graph, lowered.weights, [x])
    for g, w in zip(got, module(x)):
        torch.testing.assert_close(g, w)


class _ReadsEmpty(torch.nn.Module):
    def forward(self, x):
        return x + torch.empty(x.shape[-1])


@pytest.mark.parametrize("step, op", [(lambda x: x[x > 0], "aten::index"), (lambda x: torch.where(x > 0)[0], "aten::where"),
                                      (lambda x: x.nonzero(), "aten::nonzero"),
                                      (lambda x: x.masked_select(x > 0), "aten::masked_select")])
def test_an_op_whose_shape_depends_on_values_is_named_as_such(tmp_path, step, op):
    """Detection post-processing (boxes kept by score, then NMS): the result's shape comes from the
    data, which a static graph cannot hold; the op is named, with the model line."""

    class Keep(torch.nn.Module):
        def forward(self, x):
            return step(x * 2)

    path = _trace(tmp_path, Keep(), torch.randn(4, 4), "keep")
    with pytest.raises(UnsupportedError, match=rf"{op}\S* at .*test_frontend.py:\d+ returns a tensor whose shape "
                                               "depends on the values of its input"):
        lower_file(path, [(4, 4)])


def test_uninitialized_memory_that_is_read_is_refused(tmp_path):
    path = _trace(tmp_path, _ReadsEmpty(), torch.randn(2, 3), "empty")
    with pytest.raises(UnsupportedError, match=r"reads uninitialized memory \(from torch.empty\)"):
        lower_file(path, [(2, 3)])


@pytest.mark.parametrize("namespace, match", [
    ("nosuchlib", r"calls nosuchlib::nms, an operator that no library nimble knows defines"),
    ("torchvision", r"calls torchvision::nms, which torchvision defines, but torchvision could not be imported "
                    r"\(broken\); install the torchvision that pairs with torch"),
])
def test_a_model_calling_a_library_operator_loads_it_or_says_why_in_one_line(monkeypatch, namespace, match):
    """A traced detection model calls torchvision::nms, which only loads once torchvision is
    imported: nimble imports it, and where it cannot, says so in one line."""
    from nimble.frontend import torchscript

    def load(*args, **kwargs):
        raise RuntimeError(f"Unknown builtin op: {namespace}::nms.\nCould not find any similar ops")

    def import_module(name):
        raise ImportError("broken")

    monkeypatch.setattr(torch.jit, "load", load)
    monkeypatch.setattr(torchscript.importlib, "import_module", import_module)
    with pytest.raises(ModelError, match=match):
        frontend.load_module(SAMPLES / "resnet.pt")


def test_a_library_that_imports_fine_is_imported_and_the_load_retried(monkeypatch):
    from nimble.frontend import torchscript

    calls, imported, real = [], [], torch.jit.load

    def load(*args, **kwargs):
        calls.append(1)
        if not imported:
            raise RuntimeError("Unknown builtin op: torchvision::roi_align.")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.jit, "load", load)
    monkeypatch.setattr(torchscript.importlib, "import_module", imported.append)
    assert frontend.load_module(SAMPLES / "resnet.pt") is not None
    assert imported == ["torchvision"] and len(calls) == 2


class _TwiceThenWritten(torch.nn.Module):
    """relu(x) twice: one op serves both, unless one of them is then written in place."""

    def __init__(self, write: bool):
        super().__init__()
        self.write = write

    def forward(self, x):
        a, b = torch.relu(x), torch.relu(x)
        if self.write:
            a[:, 0] = 5.0
        return a + 1, b * 2


@pytest.mark.parametrize("write", [False, True])
def test_the_same_op_on_the_same_values_runs_once_unless_one_result_is_written(tmp_path, write):
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs

    module, x = _TwiceThenWritten(write), torch.randn(3, 4)
    for path in (_trace(tmp_path, module, x, "twice"), tmp_path / "twice.pt2"):
        if path.suffix == ".pt2":
            torch.export.save(torch.export.export(module, (x,)), str(path))
        c = compile_model(path, input_specs(["3x4"]) if path.suffix == ".pt" else None, device="cpu", fuse=False)
        relus = sum(op.target.startswith("aten::relu") for op in c.graph.ops)
        assert relus == (2 if write else 1), (path.suffix, [op.target for op in c.graph.ops])
        got = reference.run(c.graph, c.weights, [x])
        for g, w in zip(got, module(x)):
            torch.testing.assert_close(g, w)


def test_a_dense_restride_is_a_view_and_any_other_is_refused():
    """`as_strided` over all of a dense value from its first element, row-major (a dimension of one
    may have any stride), is a view; `as_strided_scatter` of such a region is its source
    reshaped; a transposed, partial or offset restride is refused in one line, before it runs."""
    b = builder.GraphBuilder("m", training=True)
    x = b.add_input("x", TensorSpec((2, 8), "float32"))
    def restride(name, ins):
        result = b.emit(getattr(torch.ops.aten, name).default._schema, f"aten::{name}.default", ins, "m.py:1")
        return result if not isinstance(result, list) else result[0]

    dense = restride("as_strided", [x, [2, 8, 1], [8, 1, 99], None])
    assert b.ops[-1].target == "aten::view.default" and b.values[dense.id].alias_of == x.id
    src = b.op("aten::relu.default", [b.op("aten::view.default", [x, [4, 4]], "m.py:2")], "m.py:3")
    whole = restride("as_strided_scatter", [x, src, [4, 4], [4, 1], 0])
    assert b.ops[-1].target != "aten::as_strided_scatter.default" and b.values[whole.id].spec.shape == (2, 8)
    for size, stride, offset in (([8, 2], [1, 8], None), ([2, 4], [8, 1], None), ([2, 7], [7, 1], 1),
                                 (["a", "b"], [1, 1], None), ([2.0, 8], [8, 1], None)):  # crafted: not sizes
        with pytest.raises(UnsupportedError, match="aten::as_strided.default .* is not supported"):
            restride("as_strided", [x, size, stride, offset])


def test_a_view_that_only_the_exported_layout_allows_becomes_a_copy_that_nothing_may_write():
    """torch.export records x.view(...) where eager's strides allowed it; nimble may lay x out
    otherwise (attention's result, in torch 2.11). The export frontend's builder then copies, as
    reshape does, and refuses a later in-place write that the copy would hide; TorchScript's does not."""
    def build(views_may_copy):
        b = builder.GraphBuilder("m", views_may_copy=views_may_copy)
        x = b.add_input("x", TensorSpec((2, 3), "float32"))
        return b, b.op("aten::view.default", [b.op("aten::transpose.int", [x, 0, 1], "m.py:1"), [6]], "m.py:2")

    b, flat = build(True)
    assert [op.target for op in b.ops] == ["aten::transpose.int", "aten::reshape.default"]
    assert b.values[flat.id].alias_of is None and b.values[flat.id].spec.shape == (6,)
    with pytest.raises(UnsupportedError, match="writes in place a tensor that a view shares storage with"):
        b.op("aten::relu_.default", [flat], "m.py:3")
    with pytest.raises(ShapeError, match="view size is not compatible"):
        build(False)


def test_arithmetic_on_traced_sizes_is_sized_without_the_meta_kernel():
    """`x.size(-1) // heads` folds on tensors of one element: counted as one element, never run on
    the meta device (whose first run imports sympy); anything larger is still sized first and
    refused past the limit, without running."""
    b = builder.GraphBuilder("m", fold_limit=100)
    schema = torch.ops.aten.floor_divide.default._schema
    calls = []
    real = builder.call_schema

    def spy(schema, target, ins):
        calls.append([i.device.type for i in ins if isinstance(i, torch.Tensor)])
        return real(schema, target, ins)

    import unittest.mock
    with unittest.mock.patch.object(builder, "call_schema", spy):
        result = b.fold(schema, "aten::floor_divide.default", [torch.tensor(128), torch.tensor(4)], "x")
        assert int(result) == 32 and calls == [["cpu", "cpu"]] and b.folded_bytes == 8
        mul = torch.ops.aten.mul.Tensor._schema
        with pytest.raises(UnsupportedError, match="would make 400 bytes"):
            b.fold(mul, "aten::mul.Tensor", [torch.ones(100), torch.tensor(2.0), 1], "x")
        repeat = torch.ops.aten.repeat.default._schema  # no shape rule: sized by its meta kernel
        with pytest.raises(UnsupportedError, match="would make 4000 bytes"):
            b.fold(repeat, "aten::repeat.default", [torch.ones(10), [100]], "x")
    # the larger folds were sized (by mul's shape rule, on the meta device) and never run
    assert calls == [["cpu", "cpu"], ["meta"]]


@pytest.mark.parametrize("sample, shapes, dtypes", [("transformer", ["1x64x128"], ["float32"]),
                                                   ("bert", ["1x16", "1x16"], ["int64", "int64"])])
def test_a_transformer_compiles_without_importing_sympy_or_dynamo(sample, shapes, dtypes):
    """Shape rules answer attention (masked too), folds with a rule (BERT's embedding of constant
    position ids) and size arithmetic on the host: a fresh process that compiles the sample
    transformer (heads split by `size // heads`, attention matched into
    scaled_dot_product_attention) or the BERT sample never imports sympy or torch._dynamo, which
    took a second."""
    import subprocess
    import sys

    from ..conftest import ROOT

    code = ("import sys; from nimble.pipeline import compile_model; from nimble.specs import input_specs; "
            f"compile_model({str(ROOT / 'sample_models' / (sample + '.pt'))!r}, input_specs({shapes!r}, {dtypes!r}), "
            "device='cpu', check=True); print(sorted(m for m in ('sympy', 'torch._dynamo') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout + done.stderr


def test_a_compile_pauses_the_cycle_collector_and_leaves_it_as_it_was(monkeypatch, tmp_path):
    """`compile_model` runs without Python's cyclic collector (its objects live until it ends, and
    full collections walked them all), and hands it back as it found it: after a compile, after a
    compile that fails, and where the caller had paused it already."""
    import gc

    from nimble import pipeline
    from nimble.specs import input_specs

    seen = []
    real = pipeline.compile_script

    def watched(*args, **kwargs):
        seen.append(gc.isenabled())
        return real(*args, **kwargs)
    monkeypatch.setattr(pipeline, "compile_script", watched)
    assert gc.isenabled()
    pipeline.compile_model(SAMPLES / "resnet.pt", input_specs(["1x3x32x32"]), device="cpu")
    assert seen == [False] and gc.isenabled()
    with pytest.raises(ShapeError):
        pipeline.compile_model(SAMPLES / "resnet.pt", input_specs(["1x5x32x32"]), device="cpu")
    assert gc.isenabled()
    gc.disable()
    try:
        pipeline.compile_model(SAMPLES / "resnet.pt", input_specs(["1x3x32x32"]), device="cpu")
        assert not gc.isenabled()
    finally:
        gc.enable()
