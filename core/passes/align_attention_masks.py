"""Inference graphs: an attention mask that is a weight is stored with rows the fused attention
kernel can read as they are.

On CUDA, `scaled_dot_product_attention` with an additive mask runs PyTorch's memory-efficient
kernel, which wants every stride of the mask but the last to be a multiple of 8 elements. A mask
whose rows are not (Swin's windows have 49 keys) is padded into a new tensor on every call, a
copy before each attention kernel. Here a mask that is a weight, or a weight repeated over the
batch (`match_attention`'s windows), is stored with its last dimension padded with zeros to a
multiple of `ALIGN`, and attention reads it through a slice (`aten::slice.Tensor`, a view): the
same values at strides the kernel takes. A repeat then repeats the padded weight.

It runs after `reduce_precision`, so that the weight is padded in the dtype it is stored in (a
cast would make a new, unaligned tensor). Masks of one key, masks that are not weights and
masks that are aligned already are left as they are. A pass that adds weights.
"""

from __future__ import annotations

import dataclasses

import torch

from ..ir import ACTIVATION, WEIGHT, Graph, Op, Ref, TensorSpec, Value, contiguous_strides
from ..ops.attention import ATTENTION
from .edit import Edit
from .match_attention import REPEAT
from .rewrite import Facts
from .substitute import free_name, read_weights

SLICE = "aten::slice.Tensor"
ALIGN = 16  # elements: PyTorch asks for 8; 16 also meets the older rule
_MASK = 3  # attn_mask's position in scaled_dot_product_attention's schema
_FLOATS = ("float32", "float16", "bfloat16")


def align_attention_masks(graph: Graph, weights: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Each unaligned weight mask of an attention op is stored padded and read through a slice."""
    facts = Facts(graph)
    ops = list(graph.ops)
    edit = Edit(graph)
    weights = dict(weights)
    sliced: dict[int, int] = {}  # a mask weight's id -> the slice attention reads in its place
    for op in graph.ops:
        found = _unaligned_mask(graph, facts, op)
        if found is None:
            continue
        weight, repeat = found
        mask = op.args[_MASK].id
        if repeat is None and weight.id in sliced:
            read = sliced[weight.id]
        else:
            tensor = weights[weight.name]
            keys = tensor.shape[-1]
            padded = torch.nn.functional.pad(tensor, (0, -keys % ALIGN)).contiguous()
            name = free_name(f"{weight.name}_aligned", weights)
            weights[name] = padded
            stored = edit.value(WEIGHT, TensorSpec(tuple(padded.shape), weight.spec.dtype), name,
                                before=op.outputs[0])
            base = stored
            if repeat is not None:  # the repeat now repeats the padded weight
                reps = repeat.args[1]
                shape = tuple(n * r for n, r in zip(padded.shape, reps))
                base = dataclasses.replace(edit.values[mask], spec=TensorSpec(shape, weight.spec.dtype))
                edit.change(base)
                ops[repeat.id] = dataclasses.replace(repeat, args=(Ref(stored.id), *repeat.args[1:]))
            view_shape = (*base.spec.shape[:-1], keys)
            view = edit.value(ACTIVATION, TensorSpec(view_shape, weight.spec.dtype, contiguous_strides(base.spec.shape)),
                              f"{name}_keys", before=op.outputs[0], alias_of=base.id)
            edit.insert_before(op.id, edit.op(SLICE, (Ref(base.id), len(view_shape) - 1, 0, keys, 1), (), (view,),
                                              op.source))
            read = view.id
            if repeat is None:
                sliced[weight.id] = read
        args = list(op.args)
        args[_MASK] = Ref(read)
        ops[op.id] = dataclasses.replace(op, args=tuple(args))
    if not edit.changed:
        return graph, weights
    return read_weights(edit.finish(ops), weights)


def _unaligned_mask(graph: Graph, facts: Facts, op: Op) -> tuple[Value, Op | None] | None:
    """(the weight, the repeat over the batch or None) behind `op`'s mask, where `op` is attention
    and the mask needs padding (module docstring); else None."""
    if op.target != ATTENTION or len(op.args) <= _MASK or not isinstance(op.args[_MASK], Ref) or op.mutates:
        return None
    mask = graph.values[op.args[_MASK].id]
    repeat = None
    if mask.kind == ACTIVATION and mask.alias_of is None and mask.producer is not None:
        repeat = graph.ops[mask.producer]
        if repeat.target != REPEAT or not isinstance(repeat.args[0], Ref) or facts.readers.get(mask.id) != {op.id} \
                or mask.id in facts.outputs or not isinstance(repeat.args[1], tuple) \
                or len(repeat.args[1]) != len(mask.spec.shape) or repeat.args[1][-1] != 1:
            return None
        weight = graph.values[repeat.args[0].id]
    else:
        weight = mask
    spec = weight.spec
    if weight.kind != WEIGHT or spec.dtype not in _FLOATS or not spec.shape or spec.shape[-1] < 2 \
            or len(spec.shape) != len(mask.spec.shape) or not spec.is_contiguous:
        return None
    strides = contiguous_strides(mask.spec.shape) if repeat is not None else (spec.strides or
                                                                                contiguous_strides(spec.shape))
    if all(s % ALIGN == 0 for s in strides[:-1]):
        return None
    return weight, repeat
