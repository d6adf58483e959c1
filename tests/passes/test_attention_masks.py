"""Shifted-window attention (`match_attention`'s windows) and masks stored aligned for the fused
attention kernel (`align_attention_masks`): what the graph holds after the passes, and that it
still computes what the module does, through both frontends and in float16."""

import pytest
import torch
from torch import nn

from nimble.ir import TensorSpec, contiguous_strides
from nimble.passes.align_attention_masks import ALIGN
from nimble.pipeline import LAYOUT, PASSES, CompileOptions, compile_script, rewrite

from .test_rewrites import assert_reproduces, exported, scripted, targets

ATTENTION = "aten::scaled_dot_product_attention.default"


class WindowAttention(nn.Module):
    """Swin's shifted-window attention in small: the scores of B images' W windows get a bias per
    head, then each window's mask on their 5-D view. `per_image` gives each image a mask of its
    own (which must not become one mask)."""

    def __init__(self, windows: int = 4, tokens: int = 7, heads: int = 2, dim: int = 16, per_image: int = 0):
        super().__init__()
        self.windows, self.heads = windows, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.bias = nn.Parameter(torch.randn(1, heads, tokens, tokens))
        mask = torch.zeros(max(per_image, 1), windows, 1, tokens, tokens)
        mask[..., 1:, :, :, 3:] = -100.0
        if per_image:
            mask[0, 0, 0, 0, 1] = -100.0
        self.register_buffer("mask", mask)

    def forward(self, x):
        bw, n, c = x.shape
        qkv = self.qkv(x).reshape(bw, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q * (c // self.heads) ** -0.5).matmul(k.transpose(-2, -1)) + self.bias
        scores = scores.view(bw // self.windows, self.windows, self.heads, n, n) + self.mask
        probs = torch.softmax(scores.view(-1, self.heads, n, n), dim=-1)
        return probs.matmul(v).transpose(1, 2).reshape(bw, n, c)


def _attention_masks(lowered) -> list[TensorSpec]:
    g = lowered.graph
    return [g.values[op.args[3].id].spec for op in g.ops if op.target == ATTENTION]


@pytest.mark.parametrize("images", [1, 3])
def test_shifted_window_attention_becomes_one_attention_op_reading_an_aligned_mask(tmp_path, images):
    model = WindowAttention().eval()
    x = torch.randn(images * 4, 7, 16)
    for raw in (exported(model, x), scripted(tmp_path, model, x)):
        lowered = rewrite(raw, PASSES)
        kinds = targets(lowered)
        assert kinds.count(ATTENTION) == 1 and "aten::softmax.int" not in kinds, kinds
        assert kinds.count("aten::repeat.default") == (images > 1), kinds  # the one image's mask over the batch
        [mask] = _attention_masks(lowered)
        assert mask.shape == (images * 4, 2, 7, 7)
        assert all(s % ALIGN == 0 for s in mask.strides[:-1]) and mask.strides[-1] == 1
        stored = [t for name, t in lowered.weights.items() if name.endswith("_windows_aligned")]
        assert [tuple(t.shape) for t in stored] == [(4, 2, 7, ALIGN)]
        assert not stored[0][..., 7:].any()  # the padding is never read, and zero
        assert_reproduces(lowered, model)


def test_a_mask_of_each_image_stays_as_written(tmp_path):
    model = WindowAttention(per_image=2).eval()
    lowered = rewrite(exported(model, torch.randn(8, 7, 16)), PASSES)
    assert ATTENTION not in targets(lowered) and "aten::softmax.int" in targets(lowered)
    assert_reproduces(lowered, model)


class WeightMask(nn.Module):
    """Attention over `keys` keys with an additive mask that is a weight."""

    def __init__(self, keys: int):
        super().__init__()
        self.register_buffer("mask", torch.randn(1, 2, keys, keys))

    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)


@pytest.mark.parametrize("keys, padded", [(5, True), (2 * ALIGN, False)])
def test_a_weight_mask_is_stored_padded_only_where_its_rows_are_unaligned(keys, padded):
    model = WeightMask(keys).eval()
    xs = [torch.randn(3, 2, keys, 8) for _ in range(3)]
    lowered = rewrite(exported(model, *xs), PASSES)
    [mask] = _attention_masks(lowered)
    assert mask.shape == (1, 2, keys, keys)
    assert mask.strides in ((), contiguous_strides(mask.shape)) or all(s % ALIGN == 0 for s in mask.strides[:-1])
    aligned = [name for name in lowered.weights if name.endswith("_aligned")]
    assert bool(aligned) == padded
    if padded:
        assert tuple(lowered.weights[aligned[0]].shape) == (1, 2, keys, ALIGN)
        assert "aten::slice.Tensor" in targets(lowered)
    assert_reproduces(lowered, model)


def test_the_layout_passes_run_after_the_precision_is_chosen():
    """In float16 the padded weight is float16 and attention reads it through the slice alone: a
    cast after the slice would copy it into an unaligned tensor again."""
    assert [p.__name__ for p in LAYOUT] == ["drop_precision_casts", "align_attention_masks"]
    model = WindowAttention().eval()
    x = torch.randn(8, 7, 16)
    compiled = compile_script(torch.jit.trace(model, x), [TensorSpec((8, 7, 16), "float32")], "w", "w", "",
                              CompileOptions("cpu", precision="fp16", tolerance=1e-2))
    g = compiled.graph
    [attention] = [op for op in g.ops if op.target == ATTENTION]
    mask = g.values[attention.args[3].id]
    assert mask.spec.dtype == "float16" and all(s % ALIGN == 0 for s in mask.spec.strides[:-1])
    assert g.ops[mask.producer].target == "aten::slice.Tensor"
    [stored] = [name for name in compiled.weights if name.endswith("_windows_aligned")]
    assert compiled.weights[stored].dtype == torch.float16
