"""nn.MultiheadAttention's inference fast path as ops: what a trace of it records. The TorchScript
frontend lowers `_native_multi_head_attention` through it, and the attention pass
(`passes/match_multi_head_attention.py`) rewrites an exported general path into it, so both
frontends give the same op graph."""

from __future__ import annotations

from typing import Callable

SPLIT, LINEAR, ATTENTION = "aten::split.Tensor", "aten::linear.default", "aten::scaled_dot_product_attention.default"


def attend(op: Callable, q, k, v, batch: int, length: int, embed: int, heads: int, length_of: Callable, proj_w, proj_b):
    """From the projected queries, keys and values ([batch, n, embed] each) to the output
    projection: the heads split off and moved first, scaled dot-product attention over them, the
    heads merged back, the output projection. `op(target, arguments)` emits one op and returns its
    first result; `length_of(x)` is x's sequence length."""
    def heads_first(x):
        return op("aten::transpose.int", [op("aten::reshape.default", [x, [batch, length_of(x), heads, -1]]), 1, 2])

    attended = op(ATTENTION, [heads_first(q), heads_first(k), heads_first(v)])
    merged = op("aten::reshape.default", [op("aten::transpose.int", [attended, 1, 2]), [batch, length, embed]])
    return op(LINEAR, [merged, proj_w, proj_b])
