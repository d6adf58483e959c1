"""The generated reduction kernels (`runtime/kernels/norms.py`'s layer norms; `reductions.py`'s max
and average pooling and the spatial mean): on the CPU their sources run through `triton_shim` against torch; on the GPU
the runtime's substitutes run them into planned buffers, and decline what they do not cover."""

from hypothesis import assume, given, settings
from hypothesis import strategies as st
import pytest
import torch

from nimble.runtime.kernels import codegen, norms, reductions
from nimble.runtime.kernels import generated

from .. import triton_shim


def shim_layer_norm(x, weight, bias, eps=1e-5):
    n = weight.numel() if weight is not None else x.shape[-1]
    out = torch.empty_like(x)
    block = generated.triton_block(n)
    triton_shim.run_grid(norms.LAYER_NORM, x.numel() // n, x, x if weight is None else weight,
                         x if bias is None else bias, out, eps, N=n, HAS_W=weight is not None,
                         HAS_B=bias is not None, WIDE=False, BLOCK=block)
    return out


@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 33), (1, 1), (4, 16)])
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_the_layer_norm_source_computes_what_torch_does(shape, affine):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 4 + 2
    n = shape[-1]
    weight = torch.randn(n, generator=g) if affine != "none" else None
    bias = torch.randn(n, generator=g) if affine == "both" else None
    got = shim_layer_norm(x, weight, bias, 1e-6)
    torch.testing.assert_close(got, torch.nn.functional.layer_norm(x, (n,), weight, bias, 1e-6),
                               rtol=1e-5, atol=1e-5)


def test_a_row_of_nan_stays_nan_and_other_rows_are_untouched():
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")
    got = shim_layer_norm(x, None, None)
    assert torch.isnan(got[1]).all() and not torch.isnan(got[0]).any() and not torch.isnan(got[2]).any()


def test_the_substitute_declines_the_cpu_and_what_it_does_not_cover():
    x = torch.randn(4, 8)
    assert norms.layer_norm([x, [8], None, None, 1e-5, True], torch.empty(4, 8)) is None
    meta = torch.empty(4, 8, device="meta")
    assert norms.layer_norm([meta, [8]], torch.empty_like(meta)) is None  # too few arguments


def shim_channels_norm(x, weight, bias, eps=1e-6):
    """`x` (N, C, ...) normalised over C as LAYER_NORM_CHANNELS does it, seen channels last."""
    seen = x.movedim(1, -1)
    out = torch.full(seen.shape, 7.0)
    grid, args, constants = norms.channels_launch(seen, out, weight, bias, eps)
    constants.pop("num_warps")
    triton_shim.run_grid(norms.LAYER_NORM_CHANNELS, grid[0], *args, **constants)
    return out


@pytest.mark.parametrize("shape", [(2, 96, 7, 7), (1, 5, 3), (3, 40, 2, 9), (1, 768, 1, 1), (2, 3, 200)])
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_the_channels_norm_source_computes_a_permuted_layer_norm(shape, affine):
    """ConvNeXt's permute(0, 2, 3, 1) then layer norm, on the map where it lies: positions that do
    not fill the last tile, one position, channels that are not a power of two."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 3 + 1
    c = shape[1]
    weight = torch.randn(c, generator=g) if affine != "none" else None
    bias = torch.randn(c, generator=g) if affine == "both" else None
    got = shim_channels_norm(x, weight, bias)
    want = torch.nn.functional.layer_norm(x.movedim(1, -1), (c,), weight, bias, 1e-6)
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_channels_norm_tiles_keep_to_their_budget():
    for c, positions in ((96, 3136), (768, 49), (4096, 1), (3, 5)):
        seen = torch.empty(2, c, positions).movedim(1, -1)
        grid, args, constants = norms.channels_launch(seen, torch.empty(seen.shape), None, None, 1e-6)
        assert constants["BLOCK_C"] >= c and constants["BLOCK_C"] * constants["BLOCK_P"] <= norms.CHANNELS_TILE
        assert grid == (2 * -(-positions // constants["BLOCK_P"]),) and args[-1] * constants["BLOCK_P"] >= positions


def test_only_a_channels_first_map_seen_channels_last_takes_the_channels_kernel():
    x = torch.randn(2, 8, 3, 3)
    assert norms.channels_first(x.permute(0, 2, 3, 1), 8)
    assert not norms.channels_first(x.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1), 8)  # dense rows
    assert not norms.channels_first(x.permute(0, 2, 3, 1), 4)  # not over the channels
    assert not norms.channels_first(x.permute(0, 3, 2, 1), 8)  # positions out of order
    assert not norms.channels_first(torch.randn(8, 6).t(), 8)  # a transposed matrix
    assert not norms.channels_first(x[:, :, :2].permute(0, 2, 3, 1), 8)  # a slice: not dense


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape, normalized", [((3, 7), (7,)), ((2, 128, 768), (768,)), ((5, 3, 11), (3, 11)),
                                               ((1, 4099), (4099,))])
def test_the_layer_norm_kernel_matches_eager_on_the_gpu(dtype, shape, normalized):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(*shape, device="cuda", generator=g) * 3 + 1).to(dtype)
    weight = torch.randn(*normalized, device="cuda", generator=g).to(dtype)
    bias = torch.randn(*normalized, device="cuda", generator=g).to(dtype)
    for w, b in ((weight, bias), (None, None), (weight, None)):
        out = torch.full_like(x, float("nan"))
        got = norms.layer_norm([x, list(normalized), w, b, 1e-5, True], out)
        assert got is out
        want = torch.nn.functional.layer_norm(x.float(), normalized, None if w is None else w.float(),
                                              None if b is None else b.float(), 1e-5)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 96, 56, 56), (1, 768, 7, 7), (2, 3, 5, 4)])
def test_the_channels_norm_kernel_matches_eager_on_the_gpu(dtype, shape):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.runtime.base import settings

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(*shape, device="cuda", generator=g) * 3 + 1).to(dtype).permute(0, 2, 3, 1)
    c = shape[1]
    weight = torch.randn(c, device="cuda", generator=g).to(dtype)
    bias = torch.randn(c, device="cuda", generator=g).to(dtype)
    for w, b in ((weight, bias), (None, None)):
        out = torch.full(x.shape, float("nan"), device="cuda", dtype=dtype)
        assert norms.layer_norm([x, [c], w, b, 1e-6, True], out) is out
        want = torch.nn.functional.layer_norm(x.float(), (c,), None if w is None else w.float(),
                                              None if b is None else b.float(), 1e-6)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    with settings.using(settings.Settings(channels_norm_kernel=False)):
        assert norms.layer_norm([x, [c], weight, bias, 1e-6, True], torch.empty(x.shape, device="cuda", dtype=dtype)) is None


@gpu
def test_the_substitute_declines_strided_input_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = torch.randn(8, 6, device="cuda").t()  # (6, 8), not row-major
    assert norms.layer_norm([x, [8], None, None, 1e-5, True], torch.empty(6, 8, device="cuda")) is None


def shim_max_pool(x, kernel, stride=(), padding=(0,), dilation=(1,), ceil_mode=False, channels_last=False):
    want = torch.nn.functional.max_pool2d(x, kernel, stride or None, padding, dilation, ceil_mode)
    out = torch.full_like(want, 7.0, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    params = reductions.pool_params([x, list(kernel), list(stride), list(padding), list(dilation), ceil_mode])
    args, constants = reductions.pool_launch(x, out, params)
    triton_shim.run_grid(reductions.POOL, -(-out.numel() // constants["BLOCK"]), *args, **constants)
    return out, want


@pytest.mark.parametrize("kernel, stride, padding, dilation, ceil_mode", [
    ((3, 3), (2, 2), (0,), (1,), False),  # ResNet's stem, without padding
    ((3, 3), (2, 2), (1, 1), (1, 1), False),  # ResNet's stem
    ((3, 3), (2, 2), (0, 0), (1, 1), True),  # GoogLeNet: windows past the edge
    ((3, 3), (1, 1), (1, 1), (1, 1), True),
    ((2,), (), (0,), (1,), False),  # an empty stride is the kernel's
    ((3, 2), (1, 2), (1, 0), (2, 1), False),  # dilated, unequal sides
])
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_max_pool_source_computes_what_torch_does(kernel, stride, padding, dilation, ceil_mode, channels_last):
    x = torch.randn(2, 3, 9, 10, generator=torch.Generator().manual_seed(1))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    got, want = shim_max_pool(x, kernel, stride, padding, dilation, ceil_mode, channels_last)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_nan_in_a_window_is_its_maximum_as_in_torch():
    x = torch.randn(1, 2, 6, 6)
    x[0, 1, 2, 3] = float("nan")
    x[0, 0] = float("-inf")
    got, want = shim_max_pool(x, (2, 2))
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got[0, 1, 1, 1]) and torch.isnan(got).sum() == 1


def shim_avg_pool(x, kernel, stride=(), padding=(0,), ceil_mode=False, count_pad=True, divisor=None,
                  channels_last=False):
    want = torch.nn.functional.avg_pool2d(x, kernel, stride or None, padding, ceil_mode, count_pad, divisor)
    out = torch.full_like(want, 7.0, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    args = [x, list(kernel), list(stride), list(padding), ceil_mode, count_pad, divisor]
    params = reductions.pool_params(args, dilated=False)
    launch, constants = reductions.pool_launch(x, out, params, (count_pad, divisor or 0))
    triton_shim.run_grid(reductions.POOL, -(-out.numel() // constants["BLOCK"]), *launch, **constants)
    return out, want


@pytest.mark.parametrize("kernel, stride, padding, ceil_mode", [
    ((3, 3), (1, 1), (1, 1), False),  # inception_v3's branch pools
    ((2, 2), (2, 2), (0, 0), False),  # densenet's transitions
    ((3, 3), (2, 2), (1, 1), True),  # windows past the padded edge: the size clipped to it
    ((3, 2), (2, 1), (1, 0), True),  # unequal sides
    ((2,), (), (0,), False),  # an empty stride is the kernel's
])
@pytest.mark.parametrize("count_pad, divisor", [(True, None), (False, None), (True, 5), (False, 2)])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("size", [(9, 10), (10, 9)])  # each side's last window past the padded edge somewhere
def test_the_average_pool_source_computes_what_torch_does(kernel, stride, padding, ceil_mode, count_pad, divisor,
                                                          channels_last, size):
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(2))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    got, want = shim_avg_pool(x, kernel, stride, padding, ceil_mode, count_pad, divisor, channels_last)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(size=st.tuples(st.integers(1, 11), st.integers(1, 11)), kernel=st.tuples(st.integers(1, 5), st.integers(1, 5)),
       stride=st.tuples(st.integers(1, 4), st.integers(1, 4)), pad=st.tuples(st.integers(0, 2), st.integers(0, 2)),
       dilation=st.tuples(st.integers(1, 3), st.integers(1, 3)), ceil_mode=st.booleans(), average=st.booleans(),
       count_pad=st.booleans(), divisor=st.one_of(st.none(), st.integers(1, 30)), channels_last=st.booleans())
def test_any_pooling_torch_accepts_the_source_computes_as_torch_does(size, kernel, stride, pad, dilation, ceil_mode,
                                                                     average, count_pad, divisor, channels_last):
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(3))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    try:
        want = torch.nn.functional.avg_pool2d(x, kernel, stride, pad, ceil_mode, count_pad, divisor) if average \
            else torch.nn.functional.max_pool2d(x, kernel, stride, pad, dilation, ceil_mode)
    except RuntimeError:
        assume(False)  # torch refuses these parameters
    args = [x, list(kernel), list(stride), list(pad)] + ([ceil_mode, count_pad, divisor] if average
                                                         else [list(dilation), ceil_mode])
    params = reductions.pool_params(args, dilated=not average)
    assert params is not None  # every pooling torch accepts, this kernel takes
    out = torch.full_like(want, 7.0, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    launch, constants = reductions.pool_launch(x, out, params, (count_pad, divisor or 0) if average else None)
    triton_shim.run_grid(reductions.POOL, -(-out.numel() // constants["BLOCK"]), *launch, **constants)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def test_the_pool_parameters_are_what_torch_accepts_and_a_window_the_kernel_unrolls():
    x = torch.randn(1, 2, 6, 6)
    assert reductions.pool_params([x, [3, 3], [1, 1], [1, 1]], dilated=False) == ([3, 3], [1, 1], [1, 1], [1, 1])
    # avg_pool2d's fifth argument is ceil_mode, not a dilation
    assert reductions.pool_params([x, [3, 3], [1, 1], [1, 1], True], dilated=False)[3] == [1, 1]
    for bad in ([x, [3, 3], [1, 1], [2, 2]],  # padding over half the kernel: PyTorch refuses it
                [x, [0, 3]], [x, [3, 3], [0, 1]], [x, [3, 3], [1, 1], [-1, 0]], [x, [3, 3], [1, 1], [0, 0], [0, 1]],
                [x, [17, 16]]):  # more than MAX_WINDOW taps: PyTorch runs it
        assert reductions.pool_params(bad) is None, bad
    assert reductions.pool_params([x, [16, 16]]) is not None


def test_the_average_pool_substitute_declines_the_cpu_and_a_divisor_not_a_positive_int():
    x = torch.randn(1, 2, 6, 6)
    out = torch.empty(1, 2, 3, 3)
    assert reductions.avg_pool2d([x, [2, 2], [2, 2], [0, 0], False, True, None], out) is None
    for divisor in (0, -1, 2.0, True, 2**31):
        assert reductions.avg_pool2d([x, [2, 2], [2, 2], [0, 0], False, True, divisor], out) is None
    assert reductions.avg_pool2d([x, [2, 2], [2, 2], [0, 0], False, 1, None], out) is None  # not a bool


def test_the_max_pool_substitute_declines_the_cpu_and_what_it_does_not_cover():
    x = torch.randn(1, 2, 6, 6)
    assert reductions.max_pool2d([x, [2, 2], [2, 2], [0, 0], [1, 1], False], torch.empty(1, 2, 3, 3)) is None
    assert reductions.pool_params([x, [2, 2], [2, 2], [0, 0], [1, 1, 1], False]) is None  # not two per side
    assert reductions.pool_params([x, [True, 2]]) is None
    assert reductions.pool_params([x, [3], [], [1], [1], False]) == ([3, 3], [3, 3], [1, 1], [1, 1])


def pooled_in_place(substitute, args: list, want: torch.Tensor, fmt) -> torch.Tensor:
    """A buffer like `want` in layout `fmt`, written by `substitute(args, buffer)` (after a first
    call that builds the kernel, and NaN poured in), which allocates nothing: no indices, no
    result to copy."""
    out = torch.empty_like(want, memory_format=fmt)
    assert substitute(args, out) is out
    out.fill_(float("nan"))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    assert substitute(args, out) is out
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == held
    return out


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_max_pool_kernel_matches_eager_and_allocates_nothing_on_the_gpu(dtype, channels_last):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(8, 64, 112, 112, device="cuda").to(dtype).contiguous(memory_format=fmt)
    for args in ([x, [3, 3], [2, 2], [1, 1], [1, 1], False], [x, [3, 3], [2, 2], [0, 0], [1, 1], True],
                 [x, [2, 2], [], [0, 0], [1, 1], False]):
        want = torch.nn.functional.max_pool2d(*args)
        torch.testing.assert_close(pooled_in_place(reductions.max_pool2d, args, want, fmt), want, rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_average_pool_kernel_matches_eager_and_allocates_nothing_on_the_gpu(dtype, channels_last):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(8, 288, 35, 35, device="cuda").to(dtype).contiguous(memory_format=fmt)
    odd = torch.randn(3, 5, 13, 11, device="cuda").to(dtype).contiguous(memory_format=fmt)
    for args in ([x, [3, 3], [1, 1], [1, 1], False, True, None], [x, [2, 2], [2, 2], [0, 0], False, True, None],
                 [odd, [3, 3], [2, 2], [1, 1], True, False, None], [odd, [3, 2], [1, 2], [1, 1], True, True, 4]):
        want = torch.nn.functional.avg_pool2d(*args)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(pooled_in_place(reductions.avg_pool2d, args, want, fmt), want, rtol=tol, atol=tol)


def shim_norm_after(body, x, operands, norm):
    source = codegen.norm_source(body, x, operands, norm)
    block = generated.triton_block(norm.n)
    triton_shim.run_grid(source, x.numel() // norm.n, x, norm.out, x if norm.weight is None else norm.weight,
                         x if norm.bias is None else norm.bias, *operands, norm.eps, N=norm.n, BLOCK=block)


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("shape", [(3, 7), (2, 5, 33), (4, 16)])
def test_a_fused_sum_and_the_layer_norm_after_it_compute_what_torch_does_in_one_kernel(shape, store):
    """GPT-2's residual stream: (matmul + bias) + residual, then the next layer norm, as one row
    kernel (`kernels.with_norm`): the sum stored where others read it, the norm of it."""
    from nimble.ir import Local
    from nimble.runtime.kernels.generated import NormAfter

    g = torch.Generator().manual_seed(1)
    n = shape[-1]
    product, bias, residual = torch.randn(*shape, generator=g), torch.randn(n, generator=g), torch.randn(*shape, generator=g)
    body = [("aten::add.Tensor", (product, bias), (("alpha", 1),)),
            ("aten::add.Tensor", (residual, Local(0)), (("alpha", 1),))]
    weight, shift = torch.randn(n, generator=g), torch.randn(n, generator=g)
    x, y = torch.full(shape, 7.0), torch.empty(shape)
    shim_norm_after(body, x, [product, bias, residual], NormAfter((n,), weight, shift, 1e-5, y, store))
    total = product + bias + residual
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(total, (n,), weight, shift, 1e-5), rtol=1e-5, atol=1e-5)
    if store:
        torch.testing.assert_close(x, total, rtol=0, atol=0)
    else:
        assert (x == 7.0).all()  # nothing else reads the sum: it is never written


def shim_spatial_mean(x, keepdim=True, sms=1, wide=None):
    out = torch.full((*x.shape[:2], 1, 1) if keepdim else tuple(x.shape[:2]), 7.0, dtype=x.dtype)
    launches = reductions.mean_launches(x, out, sms)
    for grid, args, constants in launches:
        triton_shim.run_grid(reductions.SPATIAL_MEAN, grid, *args,
                             **(constants if wide is None else {**constants, "WIDE": wide}))
    return out, launches


@pytest.mark.parametrize("shape", [(2, 5, 7, 9), (3, 37, 13, 13), (2, 3, 1, 17), (2, 3, 17, 1), (1, 70, 2, 2)])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("sms", [1, 64])  # 64: few programs for the GPU, so the positions split into parts
def test_the_spatial_mean_source_computes_what_torch_does(shape, channels_last, sms):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 3 + 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    for keepdim in (True, False):
        got, _ = shim_spatial_mean(x, keepdim, sms)
        torch.testing.assert_close(got, x.mean((2, 3), keepdim=keepdim), rtol=1e-5, atol=1e-6)


def test_the_spatial_mean_indexes_in_64_bits_when_told_to():
    x = torch.randn(1, 4, 40, 40, generator=torch.Generator().manual_seed(4))
    x = x.contiguous(memory_format=torch.channels_last)
    got, launches = shim_spatial_mean(x, sms=64, wide=True)
    assert not launches[0][2]["WIDE"]  # this map's offsets fit 32 bits: the test forces the wide form
    torch.testing.assert_close(got, x.mean((2, 3), keepdim=True), rtol=1e-5, atol=1e-6)


def test_a_large_map_with_few_channels_is_summed_in_parts_in_a_fixed_order():
    x = torch.randn(1, 4, 40, 40, generator=torch.Generator().manual_seed(3))
    got, launches = shim_spatial_mean(x, sms=64)
    assert len(launches) == 2 and launches[0][0][2] > 1  # the parts, then their sum
    assert launches[1][1][0].shape == (launches[0][0][2], 1, 4) and launches[1][1][0].dtype == torch.float32
    torch.testing.assert_close(got, x.mean((2, 3), keepdim=True), rtol=1e-5, atol=1e-6)
    again, _ = shim_spatial_mean(x, sms=64)
    assert torch.equal(got, again)


def test_the_spatial_mean_declines_what_it_does_not_cover():
    x = torch.randn(2, 3, 6, 9)
    out = torch.empty(2, 3, 1, 1)
    assert reductions.spatial_mean(x, out) is None  # the CPU
    assert reductions.mean_launches(x[:, :, :, :5], out, 1) is None  # no one stride walks H and W
    assert reductions.mean_launches(x, torch.empty(2, 3, 1, 1, dtype=torch.float16), 1) is None  # a cast
    assert reductions.mean_launches(x, torch.empty(2, 3, 6, 1), 1) is None  # not over H and W
    assert reductions.mean_launches(x[:, :, :0], out, 1) is None  # the mean of nothing: PyTorch's NaN
    assert reductions.mean_launches(x[:0], torch.empty(0, 3, 1, 1), 1) == []
    every_other = torch.randn(2, 3, 6, 10)[:, :, :, ::2]  # one stride (2) still walks them
    strided, _ = shim_spatial_mean(every_other)
    torch.testing.assert_close(strided, every_other.mean((2, 3), keepdim=True), rtol=1e-5, atol=1e-6)


def test_the_mean_substitute_takes_only_a_mean_over_the_last_two_dimensions():
    from nimble.runtime.placed import substitutes as placement

    mean = placement.SUBSTITUTES["aten::mean.dim"]
    x = torch.randn(2, 3, 4, 5)
    for dims in ([1, 2], [3], [0, 1, 2, 3], [2, 2], [True, 3]):
        assert placement._mean([x, dims, True], torch.empty(1)) is None
    assert placement._mean([x, [-1, -2], True, torch.float64], torch.empty(2, 3, 1, 1)) is None  # a dtype
    assert placement._mean([torch.randn(2, 3, 4), [1, 2]], torch.empty(2)) is None  # not 4-D
    assert mean([x, [2, 3], True], torch.empty(2, 3, 1, 1)) is None  # the CPU: its out= overload runs


def shim_leading_sum(x, dims, keepdim=True, sms=1):
    shape = [1 if d in [k % x.dim() for k in dims] else n for d, n in enumerate(x.shape)] if keepdim else \
        [n for d, n in enumerate(x.shape) if d not in [k % x.dim() for k in dims]]
    out = torch.full(shape, 7.0, dtype=x.dtype)
    launches = reductions.sum_launches(x, dims, out, sms)
    for grid, args, constants in launches:
        triton_shim.run_grid(reductions.SPATIAL_MEAN, grid, *args, **constants)
    return out, launches


@pytest.mark.parametrize("shape, dims", [((68, 32), [0]), ((17, 4, 96), [0, 1]), ((4, 17, 32), [0]),
                                         ((300, 5), [-2]), ((3, 2, 4, 5), [1, 0, 2])])
@pytest.mark.parametrize("sms", [1, 64])  # 64: the rows split into parts, then the parts summed
def test_the_leading_sum_is_a_bias_gradient_as_torch_sums_it(shape, dims, sms):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(5)) * 3 + 1
    for keepdim in (True, False):
        got, _ = shim_leading_sum(x, dims, keepdim, sms)
        torch.testing.assert_close(got, x.sum(dims, keepdim=keepdim), rtol=1e-5, atol=1e-4)


def test_the_leading_sum_declines_other_dimensions_layouts_and_dtypes():
    x = torch.randn(6, 4, 5)
    out = torch.empty(1, 1, 5)
    assert reductions.leading_sum([x, [0, 1], True], out) is None  # the CPU
    for dims in ([1], [0, 2], [0, 1, 2], [], [True], [0.0], None, [5]):
        assert reductions.sum_launches(x, dims, torch.empty(20), 1) is None, dims
    assert reductions.sum_launches(x.transpose(0, 1), [0, 1], out, 1) is None  # not contiguous
    assert reductions.sum_launches(x, [0, 1], out.double(), 1) is None  # a dtype of the op's own
    assert reductions.sum_launches(x, [0], torch.empty(1, 4, 5), 1) is not None


def test_a_training_step_sums_its_bias_gradients_by_the_leading_sum():
    from nimble.runtime import joint

    assert joint.SUBSTITUTES["aten::sum.dim_IntList"] is reductions.leading_sum

@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("shape", [(8, 32, 112, 112), (8, 1152, 7, 7), (3, 37, 13, 11), (1, 1280, 7, 7)])
def test_the_spatial_mean_kernel_matches_eager_on_the_gpu(dtype, channels_last, shape):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.runtime.placed import substitutes as placement

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = (torch.randn(*shape, device="cuda") * 2 + 1).to(dtype).contiguous(memory_format=fmt)
    want = x.float().mean((2, 3), keepdim=True)
    out = torch.full((*shape[:2], 1, 1), float("nan"), device="cuda", dtype=dtype)
    assert placement._global_avg_pool([x, [1, 1]], out) is out and reductions._spatial_mean.kernel is not None
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    flat = torch.full(shape[:2], float("nan"), device="cuda", dtype=dtype)
    assert placement._mean([x, [-1, -2], False], flat) is flat
    torch.testing.assert_close(flat.float(), want.flatten(1), rtol=tol, atol=tol)


@gpu
def test_the_wide_form_of_the_spatial_mean_builds_and_agrees_on_the_gpu():
    """Its 64-bit indexing, forced on a small map (a real one needs 2**31 elements)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = torch.randn(8, 32, 112, 112, device="cuda").contiguous(memory_format=torch.channels_last)
    out = torch.full((8, 32, 1, 1), float("nan"), device="cuda")
    kernel = generated.FixedKernel(reductions.SPATIAL_MEAN, "spatial mean, wide")
    launches = reductions.mean_launches(x, out, torch.cuda.get_device_properties(0).multi_processor_count)
    assert len(launches) == 2  # both launches, in the wide form
    assert all(kernel.launch(grid, *args, **{**constants, "WIDE": True}) for grid, args, constants in launches)
    torch.testing.assert_close(out, x.mean((2, 3), keepdim=True), rtol=1e-5, atol=1e-5)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, dims", [((6304, 768), [0]), ((6304, 3072), [0]), ((32, 197, 768), [0, 1]),
                                         ((1, 17, 32), [0]), ((33, 10), [0])])
def test_the_leading_sum_matches_eager_on_the_gpu(dtype, shape, dims):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = (torch.randn(*shape, device="cuda") * 2 + 1).to(dtype)
    want = x.float().sum(dims, keepdim=True)
    out = torch.full(want.shape, float("nan"), device="cuda", dtype=dtype)
    assert reductions.leading_sum([x, dims, True], out) is out
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol * shape[0] ** 0.5)
