"""Attention as one kernel (`runtime/kernels/small_attention.py`): its source run on the CPU through
`triton_shim` against PyTorch's attention (masks broadcast and padded, causal, rows of every key
masked, strided queries and results, shapes no tile fills, keys in one tile and keys walked a
block at a time), which calls qualify, and on the GPU against PyTorch in a capture, written
through a head merge."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nimble.runtime.kernels import small_attention

from .. import triton_shim


def run(q, k, v, mask, out, causal=False, scale=None):
    scale = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    text = small_attention.source(q, k, v, mask, out, causal, scale)
    grid, constants = small_attention.grid(q, k)
    triton_shim.run_grid(text, grid, q, k, v, out, out if mask is None else mask, **constants)
    return scale


def qkv(b, h, lq, lk, d, g):
    return (torch.randn(b, h, lq, d, generator=g), torch.randn(b, h, lk, d, generator=g),
            torch.randn(b, h, lk, d, generator=g))


@pytest.mark.parametrize("b, h, lq, lk, d", [(2, 3, 49, 49, 32), (1, 2, 16, 16, 16), (2, 1, 70, 45, 24),
                                             (1, 2, 128, 128, 64), (3, 2, 5, 7, 3),
                                             (1, 2, 197, 197, 64), (2, 1, 9, 129, 8), (1, 1, 65, 256, 16)])
@pytest.mark.parametrize("masked", ["none", "per head", "per window"])
def test_the_kernel_computes_what_pytorch_s_attention_does(b, h, lq, lk, d, masked):
    g = torch.Generator().manual_seed(0)
    q, k, v = qkv(b, h, lq, lk, d, g)
    mask = None
    if masked == "per head":  # Swin's relative position bias: one per head, rows padded to 16 keys
        mask = torch.randn(1, h, lq, -(-lk // 16) * 16, generator=g)[..., :lk]
    elif masked == "per window":
        mask = torch.randn(b, 1, lq, lk, generator=g)
    want = F.scaled_dot_product_attention(q, k, v, mask)
    out = torch.full_like(want, 7.0)
    run(q, k, v, mask, out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_causal_attention_a_scale_and_strided_tensors():
    g = torch.Generator().manual_seed(1)
    qkv_rows = torch.randn(2, 20, 3, 4, 16, generator=g)  # (batch, tokens, q|k|v, heads, row): one linear's result
    q, k, v = (qkv_rows[:, :, i].transpose(1, 2) for i in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    merged = torch.full((2, 20, 4, 16), 7.0)  # the heads merged: the result written through a transpose
    out = merged.transpose(1, 2)
    run(q, k, v, None, out, causal=True, scale=0.3)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_a_row_with_every_key_masked_gives_zeros():
    g = torch.Generator().manual_seed(2)
    q, k, v = qkv(1, 1, 4, 4, 16, g)
    mask = torch.zeros(1, 1, 4, 4)
    mask[0, 0, 2] = float("-inf")
    out = torch.full((1, 1, 4, 16), 7.0)
    run(q, k, v, mask, out)
    want = F.scaled_dot_product_attention(q, k, v, mask.masked_fill(mask[0, 0, 2:3].isinf(), 0.0))
    assert out[0, 0, 2].eq(0).all()
    torch.testing.assert_close(out[0, 0, [0, 1, 3]], want[0, 0, [0, 1, 3]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lk", [7, 200])
def test_causal_attention_over_keys_in_one_tile_or_walked_in_blocks(lk):
    g = torch.Generator().manual_seed(3)
    q, k, v = qkv(2, 2, lk, lk, 16, g)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = torch.full_like(want, 7.0)
    run(q, k, v, None, out, causal=True)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_walked_keys_a_masked_first_block_and_a_row_masked_throughout():
    """Past MAX_KEYS: a row whose first block of keys is all masked (its running maximum starts
    at -inf) gets PyTorch's result, and a row with every key masked gives zeros."""
    g = torch.Generator().manual_seed(4)
    lk = small_attention.MAX_KEYS + 72
    q, k, v = qkv(1, 1, 6, lk, 16, g)
    mask = torch.randn(1, 1, 6, lk, generator=g)
    mask[..., 1, :small_attention.KEY_BLOCK + 5] = float("-inf")
    mask[..., 4, :] = float("-inf")
    out = torch.full((1, 1, 6, 16), 7.0)
    run(q, k, v, mask, out)
    finite = mask.clone()
    finite[..., 4, :] = 0.0  # PyTorch gives such a row NaN
    want = F.scaled_dot_product_attention(q, k, v, finite)
    assert out[0, 0, 4].eq(0).all()
    rows = [0, 1, 2, 3, 5]
    torch.testing.assert_close(out[0, 0, rows], want[0, 0, rows], rtol=1e-5, atol=1e-5)


def test_a_tensor_spanning_more_than_2_to_the_31_elements_gets_64_bit_indices():
    """Meta tensors: only shapes and strides are read."""
    q = torch.empty(2, 3, 49, 32, device="meta")
    far = torch.empty_strided((2, 3, 49, 32), (2**31, 32, 96, 1), device="meta")
    assert "tl.int64" not in small_attention.source(q, q, q, None, q, False, 0.2)
    far_mask = torch.empty_strided((1, 3, 49, 49), (0, 2**31, 64, 1), device="meta")
    for args in ((far, q, q, None, q), (q, q, far, None, q), (q, q, q, far_mask, q), (q, q, q, None, far)):
        text = small_attention.source(*args, False, 0.2)
        assert "tl.program_id(0).to(tl.int64)" in text and "tl.arange(0, BLOCK_N).to(tl.int64)" in text


def test_at_most_max_long_keys_without_dropout_qualify(monkeypatch, use_settings):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # `fits` reads only shapes here
    q, k, v = (torch.randn(2, 3, 49, 32) for _ in range(3))
    out, mask = torch.empty(2, 3, 49, 32), torch.randn(1, 3, 49, 49)

    def fits(q=q, k=k, v=v, mask=mask, out=out, dropout=0.0, causal=False, scale=None, gqa=False):
        return small_attention.fits(q, k, v, mask, out, dropout, causal, scale, gqa)
    assert fits() and fits(mask=None, causal=True, scale=0.25)
    walked = torch.randn(2, 3, small_attention.MAX_KEYS + 1, 32)
    assert fits(k=walked, v=walked, mask=None)  # past one tile: walked a block at a time
    many = torch.randn(2, 3, small_attention.MAX_LONG_KEYS + 1, 32)
    assert not fits(k=many, v=many, mask=None)
    assert not fits(dropout=0.1)
    assert not fits(causal=True)  # and a mask: PyTorch refuses the two together
    assert not fits(gqa=True)
    assert not fits(mask=mask.bool())  # a boolean mask (nimble stores them as float ones)
    assert not fits(mask=torch.randn(2, 3, 49, 48))  # does not broadcast
    assert not fits(v=torch.randn(2, 3, 49, 16))  # values of another row length
    assert not fits(q=q.double(), k=k.double(), v=v.double(), mask=mask.double(), out=out.double())
    assert not fits(out=torch.empty(2, 3, 49, 16))
    assert not fits(q=q[0], k=k[0], v=v[0], out=out[0])  # 3-D
    use_settings(attention_kernel=False)
    assert not fits()


@pytest.mark.parametrize("lq, lk, d, want", [(49, 49, 32, (64, 64, 32)), (128, 128, 64, (64, 128, 64)),
                                             (3, 5, 7, (16, 16, 16)), (197, 197, 64, (64, 64, 64))])
def test_tiles_are_powers_of_two_a_dot_product_takes(lq, lk, d, want):
    assert small_attention.blocks(lq, lk, d) == want


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [49, 197])  # Swin's windows (one tile of keys), vit_b_16 (keys walked)
def test_on_the_gpu_it_agrees_with_pytorch_and_replays_in_a_capture(dtype, tokens, monkeypatch, use_settings):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn(8, tokens, 3, 3, 32, device="cuda", dtype=dtype, generator=g)
    q, k, v = (rows[:, :, i].transpose(1, 2) for i in range(3))
    mask = torch.randn(1, 3, tokens, tokens + 15, device="cuda", dtype=dtype, generator=g)[..., :tokens]
    merged = torch.empty(8, tokens, 3, 32, device="cuda", dtype=dtype)
    out = merged.transpose(1, 2)
    use_settings(attention_slower=float("inf"))  # the kernel, however fast
    monkeypatch.setattr(small_attention, "_chosen", {})
    attention = small_attention.Attention(0, {"scale": 0.2})
    assert attention([q, k, v, mask, 0.0, False], out)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask.float(), scale=0.2)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert attention([q, k, v, mask, 0.0, False], out)
    merged.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [49, 197])
def test_window_attention_agrees_with_eager_and_writes_the_merged_heads(tokens, tmp_path, monkeypatch, use_settings):
    """Swin-like attention (49 keys, or vit_b_16's 197, a per-head bias padded by `align_attention_masks`, heads
    split from one linear and merged through a transpose) loaded with the kernel and without:
    both match eager, and with it the head merge's copy is gone: the kernel replaces PyTorch's
    attention kernel and writes the merged heads itself."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from nimble.formats import read_artifact, write_artifact
    from nimble.pipeline import compile_model
    from nimble.runtime.tune import choices as tuning
    from nimble.specs import input_specs

    from .test_pooled_conv import with_and_without

    class Window(torch.nn.Module):
        def __init__(self, dim=96, heads=3, tokens=49):
            super().__init__()
            self.heads = heads
            self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
            self.bias = torch.nn.Parameter(torch.randn(1, heads, tokens, tokens))

        def forward(self, x):
            b, n, c = x.shape
            q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, self.bias, scale=0.25)
            return self.proj(y.transpose(1, 2).reshape(b, n, c))

    monkeypatch.setenv("NIMBLE_CACHE_DIR", str(tmp_path / "cache"))
    use_settings(attention_slower=float("inf"))
    monkeypatch.setattr(small_attention, "_chosen", {})
    torch.manual_seed(0)
    path = tmp_path / "window.pt"
    torch.jit.save(torch.jit.trace(Window(tokens=tokens).eval(), torch.randn(16, tokens, 96)), str(path))
    write_artifact(tmp_path / "w.nimble", compile_model(path, input_specs([f"16x{tokens}x96"]),
                                                        device="cpu").artifact())
    choice = tuning.Choice(layout="contiguous", streams="serial")
    kernels_with, kernels_without = with_and_without("attention_kernel", read_artifact(tmp_path / "w.nimble"), choice,
                                                     tmp_path)
    assert any(small_attention._chosen.values())
    # PyTorch's attention result reaches the merged heads through a copy (a memcpy node); the kernel writes them
    import re
    nodes = {enabled: len(re.findall(r"\b(?:KERNEL|MEMCPY)\b", (tmp_path / f"{enabled}.dot").read_text()))
             for enabled in (True, False)}
    assert kernels_with == kernels_without and nodes[True] == nodes[False] - 1, nodes


def test_a_head_merge_s_buffer_is_seen_back_in_the_attention_s_shape():
    """Attention paired with its head merge (transpose, then a copy) writes the copy's buffer
    through the inverse of the view (`pairs/copies.unviewed`); any other view is left alone."""
    from nimble.ir import Op, Ref
    from nimble.runtime.pairs.copies import unviewed as _unviewed

    out = torch.empty(2, 3, 5, 4)
    merged = torch.arange(2 * 5 * 12, dtype=torch.float32).reshape(2, 5, 12)  # reshape(b, n, heads * row)
    into = _unviewed(Op(1, "aten::transpose.int", (Ref(0), 1, 2), (), (2,)), merged, out)
    assert into.shape == out.shape and into.data_ptr() == merged.data_ptr()
    torch.testing.assert_close(into.transpose(1, 2).reshape(2, 5, 12), merged)
    permuted = torch.arange(5 * 2 * 3 * 4, dtype=torch.float32).reshape(5, 2, 3, 4)  # permute(2, 0, 1, 3), contiguous
    into = _unviewed(Op(1, "aten::permute.default", (Ref(0), (2, 0, 1, -1)), (), (2,)), permuted, out)
    assert into.shape == out.shape and torch.equal(into.permute(2, 0, 1, 3), permuted)
    assert _unviewed(Op(1, "aten::select.int", (Ref(0), 0, 0), (), (2,)), merged, out) is None
    assert _unviewed(Op(1, "aten::transpose.int", (Ref(0), 1, 2), (), (2,)), merged.double(), out) is None
    assert _unviewed(Op(1, "aten::transpose.int", (Ref(0), 1, 2), (), (2,)), torch.empty(2, 5, 13), out) is None


@pytest.mark.parametrize("lq, lk", [(197, 197), (49, 49), (5, 300)])
def test_every_tile_timed_computes_the_same_attention(lq, lk):
    """The tiles `Attention` times beside the default: none past the queries there are, keys per
    step only where keys are walked, and each launched (as `launcher` would) gives PyTorch's result."""
    g = torch.Generator().manual_seed(5)
    q, k, v = qkv(1, 2, lq, lk, 16, g)
    mask = torch.randn(1, 2, lq, lk, generator=g)
    want = F.scaled_dot_product_attention(q, k, v, mask, scale=0.25)
    text = small_attention.source(q, k, v, mask, torch.empty_like(want), False, 0.25)
    tiles = small_attention.tiles(q, k)
    assert len(tiles) == len(set(tiles)) >= 2
    for tile in tiles:
        assert tile[0] <= max(16, 1 << (lq - 1).bit_length()) and (tile[1] == 0) == (lk <= small_attention.MAX_KEYS)
        grid, constants = small_attention.grid(q, k, tile)
        out = torch.full_like(want, 7.0)
        triton_shim.run_grid(text, grid, q, k, v, out, mask, **constants)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, msg=f"tile {tile}")
