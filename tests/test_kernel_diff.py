"""tools/kernel_diff.py's classes for nimble's kernels: in a fused op led by a convolution
the library kernel is the convolution and a generated kernel after it the epilogue, unless the op
launched no library kernel (a generated kernel computed the convolution itself: depthwise, pooled,
1x1 and the pairs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nimble.ir import Local, Op
from nimble.ops import fusion

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import kernel_diff  # noqa: E402  (tools/kernel_diff.py: a developer instrument, not a package)

CONV = ("aten::convolution.default", (Local(0),), ())


def fused(*body) -> Op:
    return Op(1, fusion.FUSED, (tuple(body),), (), (1,), (), (), "test")


@pytest.mark.parametrize("kernel, alone, want", [
    ("sm90_xmma_fprop_implicit_gemm_tf32f32", False, "convolution"),  # cuDNN's
    ("kernel", False, "epilogue"),  # a generated epilogue after cuDNN's convolution
    ("kernel", True, "convolution"),  # the generated kernel computed the convolution
    ("triton_poi_fused_relu_0", True, "convolution"),
])
def test_a_fused_convolution_s_kernels(kernel, alone, want):
    op = fused(CONV, ("aten::relu.default", (Local(0),), ()))
    assert kernel_diff.nimble_class(op, kernel, computes_convolution=alone) == want


def test_a_generated_elementwise_op_stays_an_epilogue_and_a_library_kernel_keeps_its_name():
    assert kernel_diff.nimble_class(fused(("aten::relu.default", (Local(0),), ())), "kernel", True) == "epilogue"
    assert kernel_diff.generated("kernel") and kernel_diff.generated("triton_per_fused_0")
    assert kernel_diff.generated("Kernel")  # as the profiler names one the static launcher ran
    assert not kernel_diff.generated("nvjet_tst_128x64") and not kernel_diff.generated("cudnn_conv")


def test_the_ops_launching_several_kernels_are_listed_most_kernels_first_per_inference():
    """`ops_with_several_kernels`: resnet50's split sums at batch 1 showed up this way (a GEMM and a
    reduction for one op); an op of one kernel, and kernels of no known op, are left out."""
    reps = 2
    ours = [{"name": n} for n in ("gemm", "reduce", "conv", "gemm", "reduce", "conv", "init", "xmma", "init",
                                  "xmma", "stray")]
    owner = [7, 7, 3, 7, 7, 3, 5, 5, 5, 5, None]
    ours += [{"name": "epilogue"}] * 4
    owner += [7] * 4
    got = kernel_diff.ops_with_several_kernels(ours, owner, reps)
    assert got == [{"op": 7, "kernels": 4, "names": {"epilogue": 2, "gemm": 1, "reduce": 1}},
                   {"op": 5, "kernels": 2, "names": {"init": 1, "xmma": 1}}]
    row = {"model": "m", "batch": 1, "precision": "fp32", "choice": "c", "classes": {}, "top_ops": [],
           "torch_compile_top_kernels": [], "several_kernels": [g | {"label": "fused(x)", "value": f"v{g['op']}"}
                                                                for g in got]}
    text = "\n".join(kernel_diff.table([row], {"gpu": "g", "torch": "t", "date": "d", "command": "c"}))
    assert "more than one kernel (2): v7 fused(x) 4 kernels (`epilogue` x2, `gemm` x1, `reduce` x1); v5" in text


def test_a_product_that_nimble_generates_is_a_gemm_and_a_generated_bias_after_cublas_an_epilogue():
    """ConvNeXt's linears at batch 1 run as `kernels/gemm.py`'s kernel alone: counted as epilogues,
    they made the table show nimble 0.36 ms ahead on GEMMs and 0.26 behind on epilogues (H200,
    2026-12-01)."""
    linear = Op(1, "aten::linear.default", (), (), (1,), (), (), "test")
    assert kernel_diff.nimble_class(linear, "Kernel", computes_convolution=True) == "GEMM"
    assert kernel_diff.nimble_class(linear, "Kernel", computes_convolution=False) == "epilogue"
    assert kernel_diff.nimble_class(linear, "sm80_xmma_gemm_f32f32", computes_convolution=False) == "GEMM"
