"""What a call may put in the input buffers: the model's inputs by count, shape and dtype, and
index values inside the tables they index (on CUDA, one outside would trip a device-side assert
and end the process). Everything is checked before anything is copied."""

from __future__ import annotations

import torch

from ...errors import ShapeError
from ...ir import Graph
from ...ops import types
from ..placed import indices


COMPILED_FOR = "the artifact was compiled for that shape alone: compile the model again for another"


def check_inputs(graph: Graph, buffers: list[torch.Tensor], plan: indices.IndexPlan, inputs,
                 advice: str = COMPILED_FOR) -> None:
    """Raise ShapeError, in one line, unless `inputs` fit `buffers`: their count, shapes and
    dtypes, and index values (`check_values`). `advice` follows a wrong shape."""
    if len(inputs) != len(graph.inputs):
        raise ShapeError(f"the model takes {len(graph.inputs)} input(s) "
                         f"({', '.join(graph.values[i].name for i in graph.inputs)}), got {len(inputs)}")
    for vid, buf, x in zip(graph.inputs, buffers, inputs):
        spec = graph.values[vid].spec
        if not isinstance(x, torch.Tensor):
            raise ShapeError(f"input '{graph.values[vid].name}' must be a tensor, got {type(x).__name__}")
        if tuple(x.shape) != spec.shape:
            raise ShapeError(f"input '{graph.values[vid].name}' must be {spec.dtype}{list(spec.shape)}, got "
                             f"{types.dtype_name(x.dtype)}{list(x.shape)}; {advice}")
        if x.dtype != buf.dtype:
            raise ShapeError(f"input '{graph.values[vid].name}' must be {spec.dtype}, got "
                             f"{types.dtype_name(x.dtype)}; convert it first (x.to(torch.{spec.dtype}))")
    check_values(graph, plan, inputs)


def check_values(graph: Graph, plan: indices.IndexPlan, inputs) -> None:
    """Raise ShapeError unless every index input's values lie inside the table it indexes."""
    for k, (vid, x) in enumerate(zip(graph.inputs, inputs)):
        indices.check_input(x, plan.inputs.get(k, ()), graph.values[vid].name)


def copy_in(graph: Graph, buffers: list[torch.Tensor], plan: indices.IndexPlan, inputs,
            advice: str = COMPILED_FOR) -> None:
    """`inputs`, checked, copied into `buffers`."""
    check_inputs(graph, buffers, plan, inputs, advice)
    for buf, x in zip(buffers, inputs):
        buf.copy_(x, non_blocking=True)


def copy_rows(buffers: list[torch.Tensor], blocks: list[list[torch.Tensor]]) -> None:
    """Blocks of checked inputs (one tensor per buffer each) copied into `buffers` one after
    another along the first dimension, the rows after the last block zeroed; a lone block of the
    buffers' own shapes (a 0-d input too) copied whole."""
    for k, buf in enumerate(buffers):
        if len(blocks) == 1 and tuple(blocks[0][k].shape) == tuple(buf.shape):
            buf.copy_(blocks[0][k], non_blocking=True)
            continue
        at = 0
        for block in blocks:
            x = block[k]
            buf[at:at + x.shape[0]].copy_(x, non_blocking=True)
            at += x.shape[0]
        if at < buf.shape[0]:
            buf[at:].zero_()
