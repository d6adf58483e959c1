"""`tools/train_step_kernels.py` on the CPU: its kernel classes, and one line where there is no GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import train_step_kernels  # noqa: E402


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_wgrad_indexed_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x128x32", "convolution"),
    ("void cudnn::engines_precompiled::nchwToNhwcKernel<float, float, float, false, true>", "convolution"),
    ("void at::native::batch_norm_backward_reduce_channels_last_kernel<4, float, float, float>", "batch norm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s1688gemm_128x128_32x5_nt_align4>", "gemm"),
    ("triton_poi_fused_add_relu_19", "triton"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<4>>", "optimizer"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", "attention"),
    ("kernel", "other"),
])
def test_kernels_fall_in_their_class(name, kind):
    assert train_step_kernels.kernel_class(name) == kind


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines with no GPU")
def test_without_a_gpu_it_says_so_in_one_line():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "train_step_kernels.py"), "--no-compile"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.strip() == "train_step_kernels.py times CUDA kernels; run it on a GPU machine"
