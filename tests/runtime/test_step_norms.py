"""`runtime/kernels/step_norms`: a training step's layer norm and its backward as generated
kernels. On the CPU their sources run through `triton_shim` against torch's own ops; on a GPU the
out= functions run them into buffers and fall back to PyTorch's where they do not apply."""

from __future__ import annotations

import pytest
import torch

from nimble.ops import add_norm
from nimble.runtime.kernels import generated, reductions, step_norms

from .. import triton_shim

gpu = pytest.mark.gpu


def _layer_norm(shape, n, weight=True, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, n, generator=g) * 3 + 1
    w = torch.randn(n, generator=g) if weight else None
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


def _transposed(t):
    """`t`'s values laid out with its first two dimensions swapped."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def shim_forward(x, w, b, n, eps=1e-6, r=None, like_x=False):
    """FORWARD's results; with `r`, also the sum x + r it normalises (first). The maps it writes
    are dense, or laid out as x (`like_x`): a step's buffers keep the trace's strides."""
    rows = x.numel() // n
    mean, rstd = torch.full((rows,), 7.0), torch.full((rows,), 7.0)
    y, s = ((torch.full_like(x, 7.0) if like_x else torch.full(x.shape, 7.0)) for _ in range(2))
    block = generated.triton_block(n)
    triton_shim.run_grid(step_norms.FORWARD, rows, x, x if r is None else r, s, x if w is None else w,
                         x if b is None else b, y, mean, rstd, eps, *step_norms.rows_of(x, n),
                         *((1, 0, 0) if r is None else step_norms.rows_of(r, n)), *step_norms.rows_of(s, n),
                         *step_norms.rows_of(y, n), N=n, HAS_W=w is not None, HAS_B=b is not None, ADD=r is not None,
                         WIDE=False, BLOCK=block)
    return (y, mean, rstd) if r is None else (s, y, mean, rstd)


@pytest.mark.parametrize("shape, n", [((3, 5), 8), ((2, 7), 33), ((4,), 768), ((1,), 1)])
@pytest.mark.parametrize("affine", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("transposed", [False, True])  # the input through a transpose, as most of a ViT's
def test_the_forward_source_gives_native_layer_norm_s_three_results(shape, n, affine, transposed):
    x, w, b = _layer_norm(shape, n, *affine)
    if transposed and len(shape) == 2:
        x = _transposed(x)
    y, mean, rstd = shim_forward(x, w, b, n)
    want = torch.ops.aten.native_layer_norm(x, [n], w, b, 1e-6)
    torch.testing.assert_close(y, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean, want[1].reshape(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, want[2].reshape(-1), rtol=1e-5, atol=1e-5)


def shim_backward(gy, x, w, n, mean, rstd, programs, r=None, like_x=False):
    """BACKWARD's input gradient (plus `r`, where given; into a map laid out as x or dense) and its
    partials summed by the spatial mean's source, as `backward_into` runs them."""
    dx = torch.full_like(x, 7.0) if like_x else torch.full(x.shape, 7.0)
    rows = x.numel() // n
    block = generated.triton_block(n)
    row_block = max(1, min(step_norms.ROW_TILE // block, 16))
    per = -(-max(row_block, -(-rows // programs)) // row_block) * row_block
    count = -(-rows // per)
    dw, db = torch.full((count, n), 7.0), torch.full((count, n), 7.0)
    triton_shim.run_grid(step_norms.BACKWARD, count, gy, x, x if w is None else w, mean, rstd, x if r is None else r,
                         dx, dw, db, rows, per, *step_norms.rows_of(gy, n), *step_norms.rows_of(x, n),
                         *((1, 0, 0) if r is None else step_norms.rows_of(r, n)), *step_norms.rows_of(dx, n),
                         N=n, HAS_W=w is not None, ADD=r is not None, WIDE=False, ROW_BLOCK=row_block, BLOCK=block)
    sums = []
    for part in (dw, db):
        out = torch.full((n,), 7.0)
        for grid, args, constants in reductions.sum_launches(part, [0], out, 1):
            triton_shim.run_grid(reductions.SPATIAL_MEAN, grid, *args, **constants)
        sums.append(out)
    return dx, sums[0], sums[1], count


@pytest.mark.parametrize("shape, n", [((3, 5), 8), ((37,), 33), ((4,), 768)])
@pytest.mark.parametrize("programs", [1, 4, 100])  # one program for all rows; several; more than rows
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("transposed", ["", "gradient", "both"])  # through a transpose, as most of a ViT's
def test_the_backward_source_gives_native_layer_norm_backward_s_gradients(shape, n, programs, weight, transposed):
    x, w, b = _layer_norm(shape, n, weight, weight)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    if transposed and len(shape) == 2:
        gy = _transposed(gy)
        x = _transposed(x) if transposed == "both" else x
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [n], w, b, 1e-5)
    dx, dw, db, count = shim_backward(gy, x, w, n, mean.reshape(-1), rstd.reshape(-1), programs)
    want = torch.ops.aten.native_layer_norm_backward(gy, x, [n], mean, rstd, w, b, [True, weight, weight])
    torch.testing.assert_close(dx, want[0], rtol=1e-4, atol=1e-4)
    if weight:
        torch.testing.assert_close(dw, want[1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(db, want[2], rtol=1e-4, atol=1e-4)
    assert count <= max(programs, 1) or count * 16 >= x.numel() // n  # no more programs than asked, whole steps


def test_rows_lie_through_at_most_two_strides_of_their_own():
    t = torch.empty(4, 5, 6, 8)
    assert step_norms.rows_of(t, 8) == (120, 0, 8)  # dense: one stride
    assert step_norms.rows_of(t, 48) == (20, 0, 48)
    assert step_norms.rows_of(t.transpose(0, 1), 48) == (4, 48, 240)  # (5, 4) rows: 48 apart, then 240
    assert step_norms.rows_of(t.transpose(0, 1), 8) is None  # (5, 4, 6) rows: three strides
    assert step_norms.rows_of(torch.empty(1, 3, 1, 8), 8) == (3, 0, 8)
    assert step_norms.rows_of(torch.empty(8), 8) == (1, 0, 0)
    assert step_norms.rows_of(t.permute(2, 0, 1, 3), 8) == (20, 8, 48)  # (6, 4, 5): 4 and 5 merge
    assert step_norms.rows_of(t.permute(1, 0, 2, 3)[:, :, ::2], 8) is None  # three strides
    assert step_norms.rows_of(t.transpose(2, 3), 6) is None  # rows not dense
    assert step_norms.rows_of(t[..., :4], 4) == (120, 0, 8)  # a row's own elements dense, rows apart


def test_the_launches_decline_the_cpu_and_what_they_do_not_cover():
    x, w, b = _layer_norm((4,), 8)
    y, mean, rstd = torch.empty_like(x), torch.empty(4), torch.empty(4)
    assert step_norms.forward_launch(x, [8], w, b, 1e-5, y, mean, rstd) is None  # the CPU
    assert step_norms._rows(x, [8]) is None  # (the CPU again)
    assert step_norms.backward_launch(x, x, [8], mean, rstd, w, y, 4) is None
    assert not step_norms._takes_gradients([True, False, True], w, b, w, b)
    assert not step_norms._takes_gradients([True, True, True], w.double(), b, w, b)
    assert step_norms._takes_gradients([True, True, True], w, b, w, b)


def test_on_the_cpu_the_out_functions_are_pytorch_s():
    """...and a CPU call is no decline: `DECLINED` counts CUDA calls that missed the kernels."""
    before = dict(step_norms.DECLINED)
    x, w, b = _layer_norm((3,), 16)
    y, mean, rstd = torch.empty_like(x), torch.empty(3, 1), torch.empty(3, 1)
    step_norms.forward_into(x, [16], w, b, 1e-5, out0=y, out1=mean, out2=rstd)
    want = torch.ops.aten.native_layer_norm(x, [16], w, b, 1e-5)
    assert all(torch.equal(a, e) for a, e in zip((y, mean, rstd), want))
    gy = torch.randn_like(x)
    got = [torch.empty_like(x), torch.empty(16), torch.empty(16)]
    step_norms.backward_into(gy, x, [16], mean, rstd, w, b, [True, True, True], out0=got[0], out1=got[1], out2=got[2])
    want = torch.ops.aten.native_layer_norm_backward(gy, x, [16], mean, rstd, w, b, [True, True, True])
    assert all(torch.equal(a, e) for a, e in zip(got, want))
    assert dict(step_norms.DECLINED) == before


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, n", [((32, 197), 768), ((8, 50), 3072), ((3,), 40), ((1,), 16)])
def test_the_kernels_give_pytorch_s_results_on_the_gpu(dtype, shape, n):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    step_norms.DECLINED.clear()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(*shape, n, device="cuda", generator=g) * 3 + 1).to(dtype)
    # aten's takes a weight of the input's type; the backward's kernel runs for a float32 one (an autocast step's)
    w, b = (torch.randn(n, device="cuda", generator=g).to(dtype) for _ in range(2))
    gy = torch.randn(x.shape, device="cuda", generator=g).to(dtype)
    if len(shape) == 2:  # through a transpose, as most of a ViT's
        gy, x = _transposed(gy), _transposed(x)
    want = torch.ops.aten.native_layer_norm(x, [n], w, b, 1e-6)
    got = [torch.full(t.shape, float("nan"), dtype=t.dtype, device="cuda") for t in want]  # dense, as planned
    assert step_norms.forward_launch(x, [n], w, b, 1e-6, *got) is not None
    step_norms.forward_into(x, [n], w, b, 1e-6, out0=got[0], out1=got[1], out2=got[2])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, e in zip(got, want):
        torch.testing.assert_close(a.float(), e.float(), rtol=tol, atol=tol)
    want = torch.ops.aten.native_layer_norm_backward(gy, x, [n], want[1], want[2], w, b, [True, True, True])
    grads = [torch.full(t.shape, float("nan"), dtype=t.dtype, device="cuda") for t in want]
    assert step_norms.backward_launch(gy, x, [n], got[1], got[2], w, grads[0], 528) is not None
    assert step_norms._takes_gradients([True, True, True], w, b, grads[1], grads[2]) == (dtype == torch.float32)
    step_norms.backward_into(gy, x, [n], got[1], got[2], w, b, [True, True, True], out0=grads[0], out1=grads[1],
                             out2=grads[2])
    for a, e in zip(grads, want):
        scale = max(e.float().abs().max().item(), 1.0)
        torch.testing.assert_close(a.float(), e.float(), rtol=tol, atol=tol * scale)
    assert step_norms._forward.kernel is not None
    assert step_norms._backward.kernel is not None or dtype != torch.float32
    # a bf16 weight's gradients are PyTorch's (the partials' sums write float32): that call declined
    assert dict(step_norms.DECLINED) == ({} if dtype == torch.float32 else {"backward": 1})


@pytest.mark.parametrize("transposed", [False, True])  # the branch through a transpose, as a ViT's
def test_the_sources_take_the_add_beside_the_norm_each_way(transposed):
    x, w, b = _layer_norm((3, 5), 16)
    r = torch.randn(x.shape, generator=torch.Generator().manual_seed(4)).bfloat16()  # a bf16 branch, as a step's
    r = _transposed(r) if transposed else r
    got = shim_forward(x, w, b, 16, 1e-5, r, like_x=True)
    assert got[0].stride() == got[1].stride() == x.stride()
    want = add_norm.add_layer_norm(x, r, [16], w, b, 1e-5)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e.reshape(a.shape), rtol=1e-5, atol=1e-5)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    residual = _transposed(torch.randn(x.shape, generator=torch.Generator().manual_seed(6)))
    s, _, mean, rstd = want
    s = _transposed(s) if not transposed else s  # its gradient's sum written sequence-major each way
    total, dw, db, _ = shim_backward(gy, s, w, 16, mean.reshape(-1), rstd.reshape(-1), 4, residual, like_x=True)
    assert total.stride() == s.stride()
    want = add_norm.layer_norm_backward_add(gy, s, [16], mean, rstd, w, b, residual)
    for a, e in zip((total, dw, db), want):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_the_kernels_with_the_add_give_the_ops_results_on_the_gpu(transposed):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    step_norms.DECLINED.clear()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32, 197, 768, device="cuda", generator=g) * 3 + 1
    r = torch.randn(x.shape, device="cuda", generator=g).bfloat16()  # an autocast step's branch
    w, b = (torch.randn(768, device="cuda", generator=g) for _ in range(2))
    if transposed:  # sequence-major, as vit_b_16's residual stream
        x, r = _transposed(x), _transposed(r)
    want = add_norm.add_layer_norm(x, r, [768], w, b, 1e-6)
    got = [torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))]  # laid out as x, as a step's
    got += [torch.full(t.shape, float("nan"), dtype=t.dtype, device="cuda") for t in want[2:]]
    assert step_norms.forward_launch(x, [768], w, b, 1e-6, *got[1:], (r, got[0])) is not None
    step_norms.add_forward_into(x, r, [768], w, b, 1e-6, out0=got[0], out1=got[1], out2=got[2], out3=got[3])
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    gy = torch.randn(x.shape, device="cuda", generator=g)
    residual = torch.randn(x.shape, device="cuda", generator=g)
    gy, residual = (_transposed(t) if transposed else t for t in (gy, residual))
    want = add_norm.layer_norm_backward_add(gy, got[0], [768], got[2], got[3], w, b, residual)
    grads = [torch.full_like(x, float("nan"))] + [torch.full_like(t, float("nan")) for t in want[1:]]
    assert step_norms.backward_launch(gy, got[0], [768], got[2], got[3], w, grads[0], 528, residual) is not None
    step_norms.backward_add_into(gy, got[0], [768], got[2], got[3], w, b, residual, out0=grads[0], out1=grads[1],
                                 out2=grads[2])
    for a, e in zip(grads, want):
        scale = max(e.abs().max().item(), 1.0)
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5 * scale)
    assert not step_norms.DECLINED  # both ran as kernels
