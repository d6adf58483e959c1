"""`passes/fold_norm_casts`: in a bf16 step a layer norm writes its result in bfloat16 where the
product after it cast it so, and its backward reads the product's bfloat16 gradient where a cast
widened it; the step's losses and gradients stay bit for bit those of the step without the pass."""

from __future__ import annotations

import copy

import nimble
import torch
import torch.nn.functional as F
from nimble import passes, train
from nimble.ops import add_norm
from torch import nn

from tests.models import TinyViT
from tests.runtime.test_train_step import batch

CAST = "aten::_to_copy.default"
WITHOUT = tuple(p for p in train.JOINT_PASSES if p is not passes.fold_norm_casts)


class NormRead(nn.Module):
    """A layer norm whose float32 result a linear reads (cast to bf16 under autocast) and a float32
    add reads too: its cast must stay."""

    def __init__(self):
        super().__init__()
        self.norm, self.proj, self.head = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 10)

    def forward(self, x):
        y = self.norm(x.flatten(2)[..., :8])
        return self.head((self.proj(y) + y).mean(1))


def steps(make, passes_, data):
    torch.manual_seed(0)
    net = make()
    step = nimble.TrainStep(net, F.cross_entropy, *data, precision="bf16", graph_passes=passes_)
    losses = [float(step(*batch(4, 16, seed=k + 1))) for k in range(3)]
    return step, losses, [p.grad.clone() for p in net.parameters()]


def test_a_bf16_encoder_s_norms_write_and_read_bf16_and_its_results_do_not_change():
    data = batch(4, 16)
    step, losses, grads = steps(TinyViT, train.JOINT_PASSES, data)
    before, losses_before, grads_before = steps(TinyViT, WITHOUT, data)
    found, was = [op.target for op in step.graph.ops], [op.target for op in before.graph.ops]
    # both forward norms (one with its join) write bf16; both backwards (with their adds) read it
    assert found.count(add_norm.LAYER_NORM) == 1 and found.count(add_norm.ADD_LAYER_NORM) == 1
    assert all(dict(op.kwargs).get("dtype") is not None for op in step.graph.ops
               if op.target in (add_norm.LAYER_NORM, add_norm.ADD_LAYER_NORM))
    assert found.count(CAST) == was.count(CAST) - 4
    backwards = [op for op in step.graph.ops if op.target == add_norm.LAYER_NORM_BACKWARD_ADD]
    assert len(backwards) == 2 and all(step.graph.values[op.args[0].id].spec.dtype == "bfloat16" for op in backwards)
    assert losses == losses_before and all(torch.equal(a, b) for a, b in zip(grads, grads_before))


def test_a_norm_whose_float32_result_is_read_otherwise_keeps_its_cast():
    data = batch(4, 16)
    step, losses, grads = steps(NormRead, train.JOINT_PASSES, data)
    before, losses_before, grads_before = steps(NormRead, WITHOUT, data)
    found = [op.target for op in step.graph.ops]
    assert add_norm.LAYER_NORM not in found and "aten::native_layer_norm.default" in found
    assert losses == losses_before and all(torch.equal(a, b) for a, b in zip(grads, grads_before))


def test_an_fp32_step_is_left_as_it_is():
    torch.manual_seed(0)
    step = nimble.TrainStep(TinyViT(), F.cross_entropy, *batch(4, 16))
    assert passes.fold_norm_casts(step.graph) is step.graph
