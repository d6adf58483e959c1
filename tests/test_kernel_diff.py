"""benchmarks/kernel_diff.py's classes for nimble's kernels: in a fused op led by a convolution
the library kernel is the convolution and a generated kernel after it the epilogue, unless the op
launched no library kernel (a generated kernel computed the convolution itself: depthwise, pooled,
1x1 and the pairs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nimble.ir import Local, Op
from nimble.ops import fusion

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
kernel_diff = pytest.importorskip("kernel_diff")

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
