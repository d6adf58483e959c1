"""The gradient of a tensor taken apart into strided slices (Swin's patch merging) in a training
step: one buffer the pieces are copied into (`passes/scatter_slice_gradients`, `ops/scatters`),
not a map of zeros per slice summed."""

from __future__ import annotations

import copy

import nimble
import pytest
import torch
import torch.nn.functional as F
from nimble.passes.scatter_slice_gradients import _covers
from nimble.ops import scatters
from torch import nn

from tests.runtime.test_train_step import batch, follows_eager

END = 2**63 - 1  # the end a traced `x[:, 0::2]` slices to


class Merging(nn.Module):
    """A map (B, H, W, C) taken apart into every other row and column, as Swin's patch merging
    takes it: in four ways that cover it ("four"), two that leave half of it out ("two"), or two
    that share elements ("shared": every other row, and every other column); and the map read
    whole too, as a residual path reads it, unless `alone`."""

    def __init__(self, ways: str, alone: bool = False):
        super().__init__()
        self.ways, self.alone = ways, alone
        self.embed, self.norm = nn.Conv2d(3, 4, 1), nn.LayerNorm(16 if ways == "four" else 8)
        self.head = nn.Linear(16 if ways == "four" else 8, 10)

    def forward(self, x):
        x = self.embed(x).permute(0, 2, 3, 1)
        if self.ways == "four":
            parts = [x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]]
        elif self.ways == "two":
            parts = [x[:, 0::2, 0::2], x[:, 1::2, 1::2]]
        else:
            parts = [x[:, 0::2, :4], x[:, :4, 1::2]]
        y = self.head(self.norm(torch.cat(parts, -1)).mean((1, 2)))
        return y if self.alone else y + x.mean((1, 2)).sum(-1, keepdim=True)  # its gradient adds to the pieces' sum


@pytest.mark.parametrize("ways,alone", [("four", False), ("four", True), ("two", False), ("shared", False)],
                         ids=["four", "four-alone", "two", "shared"])
def test_the_gradients_of_strided_slices_are_copied_into_one_buffer_where_the_slices_lie_apart(ways, alone):
    torch.manual_seed(0)
    net = Merging(ways, alone)
    ref = copy.deepcopy(net)
    step = nimble.TrainStep(net, F.cross_entropy, *batch())
    ops = [op for op in step.graph.ops if op.target == scatters.SLICE_SUM]
    targets = [op.target for op in step.graph.ops]
    if ways == "shared":  # the sum stays: copies would lose the shared elements' other term
        assert not ops and targets.count("aten::slice_backward.default") >= 2
    else:
        assert len(ops) == 1 and "aten::slice_backward.default" not in targets
        assert len(ops[0].args[0]) == (4 if ways == "four" else 2) and ops[0].args[3] == (ways == "four")
    follows_eager(step, net, ref, [batch(seed=k + 1) for k in range(3)], grad_tol=1e-6)


def test_the_coverage_of_slices_is_counted_element_by_element():
    rows = lambda start: ((1, start, END, 2),)  # noqa: E731
    assert _covers((2, 6, 3), [rows(0), rows(1)]) is True
    assert _covers((2, 6, 3), [rows(0)]) is False
    assert _covers((2, 6, 3), [rows(0), rows(-2)]) is None  # index 4 twice
    assert _covers((2, 6, 3), [((1, 0, 3, 1),), ((1, 3, END, 1),)]) is True
    # a slice of a slice: rows 0, 2, 4, then every other of those (0 and 4); rows 2 and the odd ones
    assert _covers((6,), [((0, 0, END, 2), (0, 0, END, 2)), ((0, 2, 3, 1),), ((0, 1, END, 2),)]) is True
    assert _covers((1 << 9, 1 << 9), [((0, 0, END, 2), (1, 0, END, 2))]) is None  # too many to count


def test_slice_sum_computes_what_the_slice_backwards_summed():
    g = [torch.randn(2, 3, 2), torch.randn(2, 3, 2)]
    where = (((2, 0, END, 2),), ((2, 1, 4, 2),))
    expected = sum(torch.ops.aten.slice_backward(p, (2, 3, 4), 2, w[0][1], w[0][2], 2) for p, w in zip(g, where))
    assert torch.equal(scatters.slice_sum(g, where, (2, 3, 4), True), expected)
