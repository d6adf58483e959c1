"""`passes/stack_views`: a stack of pieces that were copied only to be stacked, and whose result is
copied again through views, becomes one stack of views of the pieces' sources, in a training step
(nn.MultiheadAttention's packed projection gradient in every transformer layer)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nimble
from nimble import passes, train
from nimble.passes.stack_views import CLONE, STACK, VIEWS
from tests.models import TinyViT
from tests.runtime.test_train_step import batch, follows_eager


class Packed(nn.Module):
    """Three projections of the pixels split into heads, made contiguous (a copy), flattened as
    attention's are (a second copy), stacked, and the stack made contiguous through a transpose
    (a third): the forward twin of what the packed projection's gradient goes through.
    `shared`: the first projection's head-split copy is also read by the loss."""

    def __init__(self, shared: bool = False):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(3, 8), nn.Linear(3, 8), nn.Linear(3, 8)
        self.head, self.shared = nn.Linear(24, 10), shared

    def forward(self, x):
        n = x.shape[0]
        tokens = x.flatten(2).transpose(1, 2)  # (n, 64, 3)
        pieces, first = [], None
        for proj in (self.q, self.k, self.v):
            heads = proj(tokens).view(n, 64, 2, 4).permute(0, 2, 1, 3).contiguous()  # (n, 2, 64, 4)
            first = heads if first is None else first
            pieces.append(heads.view(n * 2, 64, 4).transpose(0, 1).contiguous().view(64, n, 8))
        packed = torch.stack(pieces, 0).unsqueeze(3).transpose(0, -2).squeeze(0).contiguous()  # (64, n, 3, 8)
        out = self.head(packed.view(64 * n, 24)).view(64, n, 10).mean(0)
        return out + first.mean((1, 2, 3))[:, None] if self.shared else out


def _copies_before_stacks(graph) -> list[int]:
    """Per stack: the clones among the ops its pieces come through (views and clones back)."""
    producer = {v: op for op in graph.ops for v in op.outputs}
    found = []
    for op in graph.ops:
        if op.target != STACK:
            continue
        count = 0
        for ref in op.args[0]:
            p = producer.get(ref.id)
            while p is not None and p.target in VIEWS | {CLONE}:
                count += p.target == CLONE
                p = producer.get(p.args[0].id)
        found.append(count)
    return found


@pytest.mark.parametrize("shared", [False, True], ids=["copies-only-stacked", "one-copy-read-twice"])
def test_a_stack_of_copies_becomes_a_stack_of_views_and_gives_eager_s_gradients(shared):
    torch.manual_seed(0)
    net = Packed(shared)
    ref = copy.deepcopy(net)
    # without drop_view_clones, which would take the shared copy below as views of its source too
    joint = tuple(p for p in train.JOINT_PASSES if p is not passes.drop_view_clones)
    step = nimble.TrainStep(net, F.cross_entropy, *batch(4, 8), graph_passes=joint)
    forward = next(op for op in step.graph.ops if op.target == STACK)
    # the first projection's head-split copy stays where the loss reads it too; nothing else
    assert _copies_before_stacks(step.graph)[0] == (1 if shared else 0)
    assert forward.args[1] == 2  # stacked where the copy through the transpose put the pieces
    follows_eager(step, net, ref, [batch(4, 8, seed=k + 1) for k in range(3)], grad_tol=1e-6)


def test_a_transformer_s_packed_projection_gradient_is_stacked_from_views_of_attention_s_gradients():
    torch.manual_seed(0)
    net = TinyViT()
    ref = copy.deepcopy(net)
    step = nimble.TrainStep(net, F.cross_entropy, *batch(4, 16))
    assert _copies_before_stacks(step.graph) == [0]
    follows_eager(step, net, ref, [batch(4, 16, seed=k + 1) for k in range(3)], loss_tol=1e-5)


def test_without_the_pass_the_same_steps_copy():
    """The measure above can fail: without the pass, the transformer's pieces are copied."""
    from nimble import train

    torch.manual_seed(0)
    step = nimble.TrainStep(TinyViT(), F.cross_entropy, *batch(4, 16),
                            graph_passes=[p for p in train.JOINT_PASSES if p is not passes.stack_views])
    assert _copies_before_stacks(step.graph)[0] > 0


def test_graph_passes_that_are_not_functions_are_one_usage_line():
    from nimble.errors import UsageError

    with pytest.raises(UsageError, match="^graph_passes must be graph passes"):
        nimble.TrainStep(TinyViT(), F.cross_entropy, *batch(4, 16), graph_passes=["stack_views"])
