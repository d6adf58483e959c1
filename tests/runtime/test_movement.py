"""The generated roll kernel (`runtime/kernels/movement.py`): on the CPU its source runs through
`triton_shim` against torch.roll; on the GPU the runtime's substitute writes a planned buffer in
one kernel and allocates nothing."""

import pytest
import torch

from nimble.runtime.kernels import movement

from .. import triton_shim


def shim_roll(x, shifts, dims, out=None):
    out = torch.empty(x.shape, dtype=x.dtype) if out is None else out
    launch = movement.roll_launch(x, out, shifts, dims)
    assert launch is not None
    args, constants = launch
    triton_shim.run_grid(movement.ROLL, -(-out.numel() // constants["BLOCK"]), *args, **constants)
    return out


@pytest.mark.parametrize("shape, shifts, dims", [
    ((1, 8, 8, 3), (-3, -3), (1, 2)),  # Swin's shift before its windows
    ((1, 8, 8, 3), (3, 3), (1, 2)),  # and back
    ((2, 5, 7), (9, -12), (0, -1)),  # shifts past the size, a negative dim
    ((6,), (2,), (0,)),
    ((2, 3, 4, 5), (1, 1, 1, 1), (0, 1, 2, 3)),
    ((4, 4), (1, 2), (0, 0)),  # one dim named twice: the shifts add up
])
def test_the_roll_source_computes_what_torch_does(shape, shifts, dims):
    x = torch.randn(*shape)
    torch.testing.assert_close(shim_roll(x, shifts, dims), torch.roll(x, shifts, dims), rtol=0, atol=0)


def test_the_roll_source_reads_any_strides_and_writes_the_buffer_s_own():
    x = torch.randn(2, 6, 5, 4).permute(0, 2, 1, 3)  # (2, 5, 6, 4), not contiguous
    out = torch.empty(2, 4, 6, 5).permute(0, 3, 2, 1)  # (2, 5, 6, 4) over other strides
    shim_roll(x, (2, -1), (1, 2), out)
    torch.testing.assert_close(out, torch.roll(x, (2, -1), (1, 2)), rtol=0, atol=0)


def test_the_roll_substitute_declines_the_cpu_and_what_it_does_not_cover():
    x = torch.randn(2, 3)
    assert movement.roll([x, (1,), (0,)], torch.empty(2, 3)) is None  # the CPU
    assert movement.roll_launch(x, x, (1,), ()) is None  # a roll of the flattened tensor
    assert movement.roll_launch(torch.randn(1, 2, 3, 4, 5), torch.empty(1, 2, 3, 4, 5), (1,), (0,)) is None
    assert movement.roll_launch(x, x, (1, 2), (0,)) is None  # a shift per dim
    assert movement.roll_launch(x, x, (1,), (2,)) is None  # no such dim


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_roll_kernel_matches_eager_and_allocates_nothing_on_the_gpu(dtype):
    x = torch.randn(2, 56, 56, 96, device="cuda").to(dtype)
    out = torch.empty_like(x)
    movement.roll([x, (-3, -3), (1, 2)], out)  # the first call builds the kernel
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    assert movement.roll([x, (3, 3), (1, 2)], out) is out
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == held  # no temporary per dim, no result to copy
    torch.testing.assert_close(out, torch.roll(x, (3, 3), (1, 2)), rtol=0, atol=0)
    odd = torch.randn(3, 7, 5, device="cuda").to(dtype).transpose(0, 2)
    out = torch.empty(odd.shape, dtype=dtype, device="cuda")
    assert movement.roll([odd, (4, -2), (0, 2)], out) is out
    torch.testing.assert_close(out, torch.roll(odd, (4, -2), (0, 2)), rtol=0, atol=0)
