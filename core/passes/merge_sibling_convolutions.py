"""Inference graphs: convolutions that read one input and whose results lie side by side in a cat
along channels become one convolution, whose result is that stretch of the cat, as in
squeezenet's fire modules (a 1x1 and a 3x3 expansion of one squeeze, each then ReLU). The
smaller kernels are padded with zeros to the largest window, so the merged convolution computes
exactly what each did, in one kernel, and writes the cat's channels with no copy.

Each branch is a convolution then the same chain of one-operand elementwise ops (ReLU, ...),
none of whose results anything else reads. Branches merge where the merged convolution computes
at most MAX_GROWTH times their multiply-adds: a 1x1 beside a 3x3 of as many channels costs 1.8
times as much work, a 1x3 beside a 3x1 (inception_v3) 3 times, so the first merges and the
second does not. The merged weight and bias are named `<first conv>.weight_merged`,
`.bias_merged`. A pass that rewrites weights: it takes and returns them beside the graph."""

from __future__ import annotations

import dataclasses

import torch

from ..ir import WEIGHT, Graph, Ref, TensorSpec, Value, contiguous_strides
from ..ops import fusion, types
from .rewrite import Facts
from .substitute import free_name, read_weights, rebuild

_CAT = "aten::cat.default"
_CONVOLUTION = "aten::convolution.default"
MAX_GROWTH = 2.0  # the merged convolution's multiply-adds over the branches' own, at most


@dataclasses.dataclass(frozen=True)
class _Branch:
    """A cat part computed as convolution then a chain of elementwise ops."""
    conv: object  # the convolution op
    size: tuple[int, int]  # its input's height and width
    chain: tuple  # the elementwise ops after it, in order; the last writes the cat's part
    weight: torch.Tensor
    bias: torch.Tensor | None


def merge_sibling_convolutions(graph: Graph, weights: dict[str, torch.Tensor]) -> tuple[Graph, dict]:
    """Merge every run of adjacent cat parts (along channels, of a 4-D result) that are branches
    over one input, with one stride, dilation and chain, where the merge passes MAX_GROWTH."""
    facts = Facts(graph)
    weights = dict(weights)
    ops = {op.id: op for op in graph.ops}
    values = list(graph.values)
    same, added, dropped = {}, {}, set()
    next_id = len(graph.values)
    for cat in graph.ops:
        if not _joins_channels(graph, cat):
            continue
        parts, runs = list(cat.args[0]), _runs(graph, facts, weights, cat)
        for start, run in reversed(runs):  # from the end, so earlier starts keep their places
            weight, bias, padding = _merged(run)
            base = graph.values[run[0].conv.args[1].id].name.removesuffix(".weight")
            new = []
            for tensor, suffix in ((weight, "weight_merged"), (bias, "bias_merged")):
                if tensor is None:
                    new.append(None)
                    continue
                name = free_name(f"{base}.{suffix}", weights)
                weights[name] = tensor
                new.append(Value(next_id, WEIGHT, TensorSpec(tuple(tensor.shape), types.dtype_name(tensor.dtype),
                                                             tuple(tensor.stride())), name))
                next_id += 1
            first = run[0]
            added[first.conv.outputs[0]] = [v for v in new if v is not None]
            args = list(first.conv.args)
            args[1], args[2], args[4] = Ref(new[0].id), Ref(new[1].id) if new[1] is not None else None, padding
            ops[first.conv.id] = dataclasses.replace(first.conv, args=tuple(args))
            channels = int(weight.shape[0])
            for op in (first.conv, *first.chain):
                v = values[op.outputs[0]]
                shape = (v.spec.shape[0], channels, *v.spec.shape[2:])
                strides = contiguous_strides(shape) if v.spec.strides else ()
                values[v.id] = dataclasses.replace(v, spec=TensorSpec(shape, v.spec.dtype, strides))
            for branch in run[1:]:
                dropped.update(op.id for op in (branch.conv, *branch.chain))
            parts[start:start + len(run)] = [Ref((first.chain[-1] if first.chain else first.conv).outputs[0])]
        if not runs:
            continue
        if len(parts) == 1:
            same[cat.outputs[0]] = parts[0].id
            dropped.add(cat.id)
        else:
            ops[cat.id] = dataclasses.replace(cat, args=(tuple(parts), *cat.args[1:]))
    if not dropped:
        return graph, weights
    merged = rebuild(graph, [ops[op.id] for op in graph.ops if op.id not in dropped], same, values=values,
                     added=added)
    return read_weights(merged, weights)


def _joins_channels(graph: Graph, op) -> bool:
    """Whether `op` is a cat of 4-D parts along dimension 1 that writes a fresh result."""
    if op.target != _CAT or op.kwargs or op.mutates or len(op.outputs) != 1 or not isinstance(op.args[0], tuple):
        return False
    shape = graph.values[op.outputs[0]].spec.shape
    dim = op.args[1] if len(op.args) > 1 else 0
    return len(shape) == 4 and isinstance(dim, int) and dim % 4 == 1 and graph.values[op.outputs[0]].alias_of is None


def _runs(graph: Graph, facts: Facts, weights: dict, cat) -> list[tuple[int, list[_Branch]]]:
    """(the first part's place, its branches) for each run of two or more adjacent parts of `cat`
    that merge."""
    found, run, start = [], [], 0

    def close():
        while len(run) >= 2 and _growth(run) > MAX_GROWTH:
            run.pop()  # a longer run may pass where its head does not, but squeezenet's never needs it
        if len(run) >= 2:
            found.append((start, list(run)))

    for k, part in enumerate(cat.args[0]):
        branch = _branch(graph, facts, weights, part, cat.id)
        if branch is not None and run and _siblings(run[0], branch):
            run.append(branch)
            continue
        close()
        run, start = ([branch] if branch is not None else []), k
    close()
    return found


def _branch(graph: Graph, facts: Facts, weights: dict, part, reader: int) -> _Branch | None:
    """The branch that computes cat part `part`, if it is a plain convolution (one group, weights
    as constants, not transposed) then a chain of one-operand elementwise ops, each result read
    only by the next op and the last only by the cat."""
    if not isinstance(part, Ref):
        return None
    chain, value = [], part.id
    while True:
        v = graph.values[value]
        if v.producer is None or facts.only_reader(value) != reader or v.spec.dtype not in fusion.FLOATS:
            return None
        op = graph.ops[v.producer]
        if len(op.outputs) != 1 or op.mutates or not isinstance(op.args[0], Ref):
            return None
        if op.target == _CONVOLUTION:
            break
        if len(fusion.POINTWISE.get(op.target, ())) != 1 or any(isinstance(a, Ref) for a in op.args[1:]) \
                or any(isinstance(a, Ref) for _, a in op.kwargs):
            return None
        chain.insert(0, op)
        reader, value = op.id, op.args[0].id
    args = op.args
    if op.kwargs or len(args) != 9 or args[6] or args[8] != 1 or not isinstance(args[1], Ref):
        return None
    w = graph.values[args[1].id]
    b = graph.values[args[2].id] if isinstance(args[2], Ref) else None
    if w.kind != WEIGHT or len(w.spec.shape) != 4 or (args[2] is not None and (b is None or b.kind != WEIGHT)):
        return None
    size = tuple(graph.values[args[0].id].spec.shape[2:])
    return _Branch(op, size, tuple(chain), weights[w.name], weights[b.name] if b is not None else None)


def _siblings(a: _Branch, b: _Branch) -> bool:
    """Whether two branches read one input with one stride and dilation, in one dtype, and end in
    the same chain."""
    x, y = a.conv.args, b.conv.args
    return x[0] == y[0] and tuple(x[3]) == tuple(y[3]) and tuple(x[5]) == tuple(y[5]) \
        and a.weight.dtype == b.weight.dtype and tuple(a.weight.shape[1:2]) == tuple(b.weight.shape[1:2]) \
        and [(op.target, op.args[1:], op.kwargs) for op in a.chain] == \
        [(op.target, op.args[1:], op.kwargs) for op in b.chain]


def _window(run: list[_Branch]) -> tuple[tuple[int, int], tuple[int, int], list[tuple[int, int]]] | None:
    """The merged kernel's size and padding, and where each branch's kernel lies in it; None where
    a branch's padding does not line up with the others' under the dilation."""
    dilation = tuple(run[0].conv.args[5])
    padding = tuple(max(tuple(b.conv.args[4])[d] for b in run) for d in (0, 1))
    offsets = []
    for b in run:
        shift = [padding[d] - tuple(b.conv.args[4])[d] for d in (0, 1)]
        if any(s % dilation[d] for d, s in enumerate(shift)):
            return None
        offsets.append((shift[0] // dilation[0], shift[1] // dilation[1]))
    size = tuple(max(o[d] + b.weight.shape[2 + d] for o, b in zip(offsets, run)) for d in (0, 1))
    return size, padding, offsets


def _growth(run: list[_Branch]) -> float:
    """The merged convolution's multiply-adds over the branches' own (inf where they cannot merge,
    or where the merged result would not have the branches' height and width)."""
    window = _window(run)
    if window is None:
        return float("inf")
    (kh, kw), padding, _ = window
    stride, dilation = tuple(run[0].conv.args[3]), tuple(run[0].conv.args[5])

    def extent(n: int, pad: int, k: int, d: int) -> int:  # a convolution's output length
        return (n + 2 * pad - dilation[d] * (k - 1) - 1) // stride[d] + 1
    for b in run:
        own = tuple(b.conv.args[4])
        if any(extent(b.size[d], own[d], b.weight.shape[2 + d], d) != extent(b.size[d], padding[d], k, d)
               for d, k in ((0, kh), (1, kw))):
            return float("inf")
    merged = sum(int(b.weight.shape[0]) for b in run) * kh * kw
    return merged / sum(int(b.weight.shape[0]) * int(b.weight.shape[2]) * int(b.weight.shape[3]) for b in run)


def _merged(run: list[_Branch]) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int]]:
    """The merged convolution's weight (each branch's zero-padded into the merged window, stacked
    along output channels), bias (zeros for a branch without one; None where none has one) and
    padding."""
    (kh, kw), padding, offsets = _window(run)
    parts, biases = [], []
    for b, (top, left) in zip(run, offsets):
        w = torch.zeros((b.weight.shape[0], b.weight.shape[1], kh, kw), dtype=b.weight.dtype)
        w[:, :, top:top + b.weight.shape[2], left:left + b.weight.shape[3]] = b.weight
        parts.append(w)
        biases.append(b.bias if b.bias is not None else torch.zeros(b.weight.shape[0], dtype=b.weight.dtype))
    bias = torch.cat(biases).contiguous() if any(b.bias is not None for b in run) else None
    return torch.cat(parts).contiguous(), bias, padding
