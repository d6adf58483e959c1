"""A training step's GEMM matrices whose rows are not a multiple of 16 bytes get padded rows
(`passes/pad_gemm_rows`): Swin's 49-token windows. Only strides change; the step follows eager."""

from __future__ import annotations

import copy

import nimble
import pytest
import torch
import torch.nn.functional as F
from nimble.passes.pad_gemm_rows import _padded, pad_gemm_rows
from torch import nn

from tests.runtime.test_train_step import batch, follows_eager


class WindowAttention(nn.Module):
    """Attention within windows of `tokens` tokens (7: rows of 28 bytes in float32), as Swin's,
    with a learned bias per head added to the scores; `merged`: the scores also viewed with their
    last two dims merged, which padded rows cannot take."""

    def __init__(self, tokens: int = 7, width: int = 8, heads: int = 2, merged: bool = False):
        super().__init__()
        self.tokens, self.heads, self.merged = tokens, heads, merged
        self.embed = nn.Linear(3, width)
        self.qkv, self.head = nn.Linear(width, 3 * width), nn.Linear(width, 10)
        self.bias = nn.Parameter(torch.randn(heads, tokens, tokens) * 0.1)

    def forward(self, x):
        b = x.shape[0]
        t = self.embed(x.flatten(2)[..., :self.tokens].transpose(1, 2))  # (B, tokens, width)
        q, k, v = self.qkv(t).view(b, self.tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        raw = q @ k.transpose(-2, -1)
        scores = raw * 0.3 + self.bias
        if self.merged:
            scores = scores + raw.flatten(-2).mean(-1)[..., None, None]
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, self.tokens, -1)
        return self.head(out.mean(1))


@pytest.mark.parametrize("merged", [False, True], ids=["padded", "merged-view"])
def test_a_step_pads_the_rows_of_unaligned_gemm_matrices_and_follows_eager(merged):
    torch.manual_seed(0)
    net = WindowAttention(merged=merged)
    ref = copy.deepcopy(net)
    step = nimble.TrainStep(net, F.cross_entropy, *batch())
    graph = step.graph
    bmms = [op for op in graph.ops if op.target == "aten::bmm.default"]
    assert len(bmms) == 6  # two forward, four backward

    def padded(value: int) -> bool:
        spec = graph.values[graph.root(value)].spec
        return spec.shape[-1] == 7 and tuple(spec.strides[-2:]) == (8, 1)

    scores = bmms[0].outputs[0]  # q @ k^T
    assert padded(scores) is not merged  # viewed with its rows merged, it keeps them as traced
    # the gradient of the probabilities (dO @ V^T); the softmax's results keep their rows in
    # float32 (its kernel writes them contiguous), in bf16 their casts for the products take them
    square = [op.outputs[0] for op in bmms[2:] if graph.values[op.outputs[0]].spec.shape[-2:] == (7, 7)]
    assert len(square) == 1 and padded(square[0])
    follows_eager(step, net, ref, [batch(seed=k + 1) for k in range(3)], grad_tol=1e-5)


def test_rows_are_padded_to_16_bytes_and_nothing_else_changes():
    assert _padded((2, 3, 7), 8) == (24, 8, 1) and _padded((7, 7), 8) == (8, 1)
    torch.manual_seed(0)
    step = nimble.TrainStep(WindowAttention(tokens=8), F.cross_entropy, *batch())  # rows of 32 bytes
    assert pad_gemm_rows(step.graph) is step.graph
