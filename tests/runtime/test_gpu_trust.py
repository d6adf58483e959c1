"""Trust on CUDA: generated kernels over more than 2**31 elements, warm-up and calls that never
trip a device-side assert (garbage in the allocator's cache, out-of-range ids, computed indices
pushed out of range by a crafted weight), and the cuDNN, split and CPU paths of fused bodies
agreeing, NaN included. Run with `pytest -m gpu`.

The tests that could poison the CUDA context if they failed run in a subprocess."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from nimble.ir import Local, Op, Ref
from nimble.ops import fusion, interpret
from nimble.runtime.kernels import codegen
from nimble.runtime.kernels import fused as kernels, generated

from ..conftest import ROOT, SAMPLES, save_script

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))


def test_a_generated_kernel_over_more_than_2_31_elements():
    n = 2**31 + 4096
    free, _ = torch.cuda.mem_get_info()
    if free < 3 * n * 2:
        pytest.skip(f"needs {3 * n * 2 / 2**30:.0f} GiB of free GPU memory")
    x = torch.empty(n, dtype=torch.float16, device="cuda")
    x[:8192].normal_()
    x[-8192:].normal_()
    out = torch.empty_like(x)
    body = [("aten::relu.default", (x,), ()), ("aten::add.Scalar", (Local(0), 1.0, 1), ())]
    source = codegen.elementwise_source(body, out, [x], False, False)
    assert "tl.program_id(0).to(tl.int64)" in source
    generated.elementwise_launcher(source)(out, [x])
    torch.cuda.synchronize()
    for part in (slice(0, 8192), slice(n - 8192, n)):
        torch.testing.assert_close(out[part], torch.relu(x[part]) + 1)


def _in_subprocess(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "ALL OK" in result.stdout, result.stdout + result.stderr
    return result.stdout


def test_bert_loads_on_garbage_filled_memory_and_a_bad_id_is_refused_not_asserted(tmp_path):
    _in_subprocess(f"""
        import torch, nimble
        from nimble.formats import write_artifact
        from nimble.pipeline import compile_model
        from nimble.specs import input_specs
        c = compile_model({str(SAMPLES / 'bert.pt')!r}, input_specs(["1x16", "1x16"], ["int64"]), device="cpu")
        write_artifact({str(tmp_path / 'bert.nimble')!r}, c.artifact())
        junk = torch.full((2**28,), -(2**62), dtype=torch.int64, device="cuda")  # 2 GiB of huge ids, then freed
        del junk  # the caching allocator hands these bytes out again
        exe = nimble.load({str(tmp_path / 'bert.nimble')!r}, device="cuda", verify=True)
        ids, mask = (t.cuda() for t in c.sample_inputs)
        try:
            exe(ids + 10**6, mask)
            raise SystemExit("an out-of-range id was accepted")
        except nimble.ShapeError as e:
            print("refused:", e)
        out = exe.run(ids, mask)
        torch.cuda.synchronize()
        assert torch.isfinite(out[0]).all()
        print("ALL OK")
    """)


class _ShiftedGather(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("shift", torch.zeros(1, 1, dtype=torch.long))

    def forward(self, x):
        return x.gather(1, x.argmax(1, keepdim=True) + self.shift) * 2


def test_computed_indices_a_crafted_weight_pushes_out_of_range_are_clamped(tmp_path):
    path = save_script(tmp_path, _ShiftedGather(), "shifted")
    _in_subprocess(f"""
        import torch
        from nimble.pipeline import compile_model
        from nimble.runtime.executable import Executable
        from nimble.specs import input_specs
        art = compile_model({str(path)!r}, input_specs(["2x5"]), device="cpu").artifact()
        art.weights = {{k: (torch.full_like(t, 10) if t.dtype == torch.int64 else t) for k, t in art.weights.items()}}
        exe = Executable(art, "cuda")
        x = torch.randn(2, 5, device="cuda")
        out = exe(x)
        torch.cuda.synchronize()
        assert torch.equal(out, x[:, 4:5] * 2), (out, x)  # clamped to the last column
        print("ALL OK")
    """)


# --------------------------------------------------------------- cuDNN, split and CPU agree
def _conv_led_bodies():
    """Conv-led bodies: the two cuDNN patterns, then longer epilogues the generated kernel takes."""
    z = Ref(3)
    yield [("aten::relu.default", (Local(0),), ())]
    yield [("aten::add.Tensor", (Local(0), z), ()), ("aten::relu.default", (Local(1),), ())]
    yield [("aten::add.Tensor", (z, Local(0)), ()), ("aten::relu.default", (Local(1),), ())]
    yield [("aten::add.Tensor", (Local(0), z), (("alpha", 0.5),)), ("aten::relu.default", (Local(1),), ())]
    yield [("aten::add.Tensor", (Local(0), z), ()), ("aten::hardtanh.default", (Local(1), -0.5, 0.5), ()),
           ("aten::mul.Scalar", (Local(2), 3.0), ())]
    yield [("aten::silu.default", (Local(0),), ()), ("aten::maximum.default", (Local(1), z), ())]


@pytest.mark.parametrize("epilogue", list(_conv_led_bodies()), ids=lambda e: "-".join(n[0][6:].split(".")[0] for n in e))
def test_cudnn_split_and_cpu_paths_agree_nan_included(epilogue):
    torch.backends.cudnn.allow_tf32 = False
    try:
        g = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(1, 8, 6, 6, generator=g), torch.randn(8, 8, 3, 3, generator=g), torch.randn(8, generator=g)
        z = torch.randn(1, 8, 6, 6, generator=g)
        z[0, 0, 0, :3] = float("nan")
        conv = ("aten::conv2d.default", (Ref(0), Ref(1), Ref(2), (1, 1), (1, 1), (1, 1), 1), ())
        body = (conv, *epilogue)
        op = Op(0, fusion.FUSED, (body,), (), (4,), (), (), "")
        fusion.check(op)
        values = {0: x, 1: w, 2: b, 3: z}

        def bind(device):
            return [(t, tuple(values[a.id].to(device) if isinstance(a, Ref) else a for a in args), kw)
                    for t, args, kw in body]

        want = interpret.run_fused(bind("cpu"))
        results = {}
        for cudnn in (True, False):
            kernel = kernels.FusedKernel(op)
            kernel.cudnn_fusion = cudnn
            out = torch.empty(1, 8, 6, 6, device="cuda")
            got = kernel([bind("cuda")], out)
            results["cudnn" if cudnn else "split"] = (got if got is not None else interpret.run_fused(bind("cuda"))).cpu()
        for path, got in results.items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True, msg=path)
    finally:
        torch.backends.cudnn.allow_tf32 = True
