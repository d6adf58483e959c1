"""Walk a load's op lists without a GPU, noting every generated kernel launch (prototype)."""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from ..ir import WEIGHT
from ..ops import types
from ..ops.execute import run_ops
from ..plan import capped
from .assemble import lower
from .assemble.choice import channels_last_values, conv_weights
from .assemble.order import issue_order
from .base import claimed as claims
from .base.claimed import DEVICE, Claimed, claimed
from .base.settings import current
from .kernels import cudnn_graph
from .pairs.run import PairedRun
from .placed.placement import arena_views, prepare
from .tune import choices as tuning

FAILED = []


class _Walk(PairedRun):
    """One issue of the op list over claimed tensors: an op that cannot run on shapes alone
    (a cuDNN plan, a value read back) is passed over, its planned buffers standing for its results."""

    def call(self, p, args, kwargs):
        try:
            return super().call(p, args, kwargs)
        except Exception as e:
            FAILED.append(f"{p.op.target}: {str(e)[:80]}")
            return [self.views.get(o) if self.views.get(o) is not None else _spec_tensor(self.graph, o)
                    for o in p.op.outputs]


def _spec_tensor(graph, vid):
    spec = graph.values[vid].spec
    return claimed(spec.shape, types.DTYPES[spec.dtype])


class _Props:
    def __init__(self, major, minor, sms):
        self.major, self.minor, self.multi_processor_count, self.name = major, minor, sms, f"sm_{major}{minor}"


class _Stream:
    cuda_stream = 0
    device_index = 0


def _patched(major, minor, sms):
    stack = contextlib.ExitStack()
    for name, value in [("is_current_stream_capturing", lambda: False),
                        ("get_device_properties", lambda d=None: _Props(major, minor, sms)),
                        ("get_device_capability", lambda d=None: (major, minor)),
                        ("current_stream", lambda d=None: _Stream())]:
        stack.enter_context(mock.patch.object(torch.cuda, name, value))
    return stack


def walk(artifact):
    graph, schedule, memory = artifact.graph, artifact.schedule, artifact.memory
    prepared = prepare(graph)
    weights = {v.id: claimed(v.spec.shape, types.DTYPES[v.spec.dtype]) for v in graph.values if v.kind == WEIGHT}
    convs = conv_weights(graph)
    cl_weights = {k: claimed(weights[k].shape, weights[k].dtype, torch.channels_last) for k in convs}
    inputs = [claimed(graph.values[i].spec.shape, types.DTYPES[graph.values[i].spec.dtype]) for i in graph.inputs]
    arena = claimed((max(memory.arena_bytes, 1),), torch.uint8)
    folded = capped.streams_under(schedule, None)
    options = tuning.candidates(graph, max(folded, default=0) + 1, True)
    distinct = {(c.layout, c.convolutions, c.gemm_bias, c.prologues): c for c in options}
    seen = []
    with claims.walk(seen), _patched(9, 0, 132):
        for choice in distinct.values():
            channels_last = choice.layout == "channels_last"
            views = arena_views(graph, memory, arena, channels_last_values(graph) if channels_last else ())
            w = dict(weights)
            if channels_last:
                w.update(cl_weights)
            placed = lower.lower(prepared, choice, cudnn_graph.Workspaces())
            order = issue_order(graph, schedule, memory, placed, choice, single_stream=False, paired=True,
                                settings=current())
            lower.pair(placed, order.pairs, choice)
            env = dict(w)
            env.update(zip(graph.inputs, inputs))
            run = _Walk(env, views, DEVICE, name_failures=True, release=None, kept=frozenset(), pairs=order.pairs)
            run.graph = graph
            run_ops(placed, run, order.order)
    return seen
