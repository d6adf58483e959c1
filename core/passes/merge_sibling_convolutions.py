"""Inference graphs: convolution towers over one input whose results lie side by side in a cat
along channels become one tower, whose result is that stretch of the cat. In squeezenet's fire
modules the towers are one convolution deep (a 1x1 and a 3x3 expansion of one squeeze, each then
ReLU); in googlenet's inception blocks two of the four branches are two deep (a 1x1 reduction,
then a 3x3, each then ReLU). Level by level, the towers' convolutions become one: at the first
level their weights are stacked (they read the same input), below it each reads its own channels
of the level above, so the merged weight is block-diagonal; every kernel is padded with zeros to
the largest window. The merged tower computes exactly what each tower did, one kernel a level,
and writes the cat's channels with no copy.

A tower level is a convolution (one group, weights as constants) then a chain of one-operand
elementwise ops (ReLU, ...), and nothing else reads a result inside a tower. Towers merge where
they have the same depth, and level by level one stride, dilation and chain, and where no merged
level computes more than MAX_GROWTH times the multiply-adds of the convolutions it replaces: a
1x1 beside a 3x3 of as many channels costs 1.8 times the work, googlenet's block-diagonal 3x3s
1.4 to 1.7 times, and a 1x3 beside a 3x1 (inception_v3) 3 times, so the last stay apart. The
merged weights and biases are named `<first conv>.weight_merged`, `.bias_merged`. A pass that
rewrites weights: it takes and returns them beside the graph."""

from __future__ import annotations

import dataclasses

import torch

from ..ir import WEIGHT, Graph, Ref, TensorSpec, contiguous_strides
from ..ops import fusion
from .edit import Edit
from .rewrite import Facts
from .substitute import read_weights

_CAT = "aten::cat.default"
_CONVOLUTION = "aten::convolution.default"
MAX_GROWTH = 2.0  # a merged convolution's multiply-adds over those of the convolutions it replaces, at most


@dataclasses.dataclass(frozen=True)
class _Level:
    """One level of a tower: a convolution, then a chain of elementwise ops."""
    conv: object  # the convolution op
    size: tuple[int, int]  # its input's height and width
    chain: tuple  # the elementwise ops after it, in order
    weight: torch.Tensor
    bias: torch.Tensor | None

    @property
    def result(self) -> int:
        """The value this level writes: its last op's."""
        return (self.chain[-1] if self.chain else self.conv).outputs[0]


def merge_sibling_convolutions(graph: Graph, weights: dict[str, torch.Tensor]) -> tuple[Graph, dict]:
    """Merge every run of adjacent cat parts (along channels, of a 4-D result) that are towers
    over one input, level by level alike, where each merged level passes MAX_GROWTH."""
    facts = Facts(graph)
    weights = dict(weights)
    ops = {op.id: op for op in graph.ops}
    edit, dropped = Edit(graph), set()
    for cat in graph.ops:
        if not _joins_channels(graph, cat):
            continue
        parts, runs = list(cat.args[0]), _runs(graph, facts, weights, cat)
        for start, run in reversed(runs):  # from the end, so earlier starts keep their places
            for depth, level in enumerate(zip(*run)):
                weight, bias, padding = _merged(level, depth)
                base = graph.values[level[0].conv.args[1].id].name.removesuffix(".weight")
                first = level[0]
                new = [edit.weight(weights, f"{base}.weight_merged", weight, before=first.conv.outputs[0])]
                if bias is not None:
                    new.append(edit.weight(weights, f"{base}.bias_merged", bias, before=first.conv.outputs[0]))
                args = list(first.conv.args)
                args[1], args[2], args[4] = Ref(new[0].id), Ref(new[1].id) if bias is not None else None, padding
                ops[first.conv.id] = dataclasses.replace(first.conv, args=tuple(args))
                for op in (first.conv, *first.chain):  # the first tower's values now hold every tower's channels
                    v = edit.values[op.outputs[0]]
                    shape = (v.spec.shape[0], int(weight.shape[0]), *v.spec.shape[2:])
                    strides = contiguous_strides(shape) if v.spec.strides else ()
                    edit.change(dataclasses.replace(v, spec=TensorSpec(shape, v.spec.dtype, strides)))
                for other in level[1:]:
                    dropped.update(op.id for op in (other.conv, *other.chain))
            parts[start:start + len(run)] = [Ref(run[0][-1].result)]
        if not runs:
            continue
        if len(parts) == 1:
            edit.replace_uses(cat.outputs[0], parts[0].id)
            dropped.add(cat.id)
        else:
            ops[cat.id] = dataclasses.replace(cat, args=(tuple(parts), *cat.args[1:]))
    if not dropped:
        return graph, weights
    merged = edit.finish([ops[op.id] for op in graph.ops if op.id not in dropped])
    return read_weights(merged, weights)


def _joins_channels(graph: Graph, op) -> bool:
    """Whether `op` is a cat of 4-D parts along dimension 1 that writes a fresh result."""
    if op.target != _CAT or op.kwargs or op.mutates or len(op.outputs) != 1 or not isinstance(op.args[0], tuple):
        return False
    shape = graph.values[op.outputs[0]].spec.shape
    dim = op.args[1] if len(op.args) > 1 else 0
    return len(shape) == 4 and isinstance(dim, int) and dim % 4 == 1 and graph.values[op.outputs[0]].alias_of is None


def _runs(graph: Graph, facts: Facts, weights: dict, cat) -> list[tuple[int, list[tuple[_Level, ...]]]]:
    """(the first part's place, its towers) for each run of two or more adjacent parts of `cat`
    that merge."""
    found, run, start = [], [], 0

    def close():
        while len(run) >= 2 and max(_growth(level, depth) for depth, level in enumerate(zip(*run))) > MAX_GROWTH:
            run.pop()  # a longer run may pass where its head does not, but no model seen needs it
        if len(run) >= 2:
            found.append((start, list(run)))

    for k, part in enumerate(cat.args[0]):
        tower = _tower(graph, facts, weights, part, cat.id)
        if tower is not None and run and _siblings(run[0], tower):
            run.append(tower)
            continue
        close()
        run, start = ([tower] if tower is not None else []), k
    close()
    return found


def _tower(graph: Graph, facts: Facts, weights: dict, part, reader: int) -> tuple[_Level, ...] | None:
    """The levels, top first, of the tower that computes cat part `part`: while the input of the
    level found last is written by another level that nothing else reads, the tower goes up."""
    levels = []
    while True:
        level = _level(graph, facts, weights, part, reader)
        if level is None:
            break
        levels.insert(0, level)
        part, reader = level.conv.args[0], level.conv.id
    return tuple(levels) or None


def _level(graph: Graph, facts: Facts, weights: dict, part, reader: int) -> _Level | None:
    """The level that writes `part` for `reader` alone, if it is a plain convolution (one group,
    weights as constants, not transposed) then a chain of one-operand elementwise ops, each
    result read only by the next op."""
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
    return _Level(op, size, tuple(chain), weights[w.name], weights[b.name] if b is not None else None)


def _siblings(a: tuple[_Level, ...], b: tuple[_Level, ...]) -> bool:
    """Whether two towers read one input, have one depth, and level by level one stride,
    dilation, dtype and chain."""
    def alike(x: _Level, y: _Level) -> bool:
        return tuple(x.conv.args[3]) == tuple(y.conv.args[3]) and tuple(x.conv.args[5]) == tuple(y.conv.args[5]) \
            and x.weight.dtype == y.weight.dtype and [(op.target, op.args[1:], op.kwargs) for op in x.chain] == \
            [(op.target, op.args[1:], op.kwargs) for op in y.chain]
    return len(a) == len(b) and a[0].conv.args[0] == b[0].conv.args[0] and all(map(alike, a, b))


def _window(level: tuple[_Level, ...]) -> tuple[tuple[int, int], tuple[int, int], list[tuple[int, int]]] | None:
    """The merged kernel's size and padding, and where each tower's kernel lies in it; None where
    a tower's padding does not line up with the others' under the dilation."""
    dilation = tuple(level[0].conv.args[5])
    padding = tuple(max(tuple(t.conv.args[4])[d] for t in level) for d in (0, 1))
    offsets = []
    for t in level:
        shift = [padding[d] - tuple(t.conv.args[4])[d] for d in (0, 1)]
        if any(s % dilation[d] for d, s in enumerate(shift)):
            return None
        offsets.append((shift[0] // dilation[0], shift[1] // dilation[1]))
    size = tuple(max(o[d] + t.weight.shape[2 + d] for o, t in zip(offsets, level)) for d in (0, 1))
    return size, padding, offsets


def _inputs(level: tuple[_Level, ...], depth: int) -> list[tuple[int, int]]:
    """The input channels each tower's convolution reads at this level of the merged tower: all
    of the shared input at the top, below it its own stretch of the merged level above."""
    if depth == 0:
        return [(0, int(t.weight.shape[1])) for t in level]
    starts = [0]
    for t in level:
        starts.append(starts[-1] + int(t.weight.shape[1]))
    return list(zip(starts, starts[1:]))


def _growth(level: tuple[_Level, ...], depth: int) -> float:
    """The merged convolution's multiply-adds over the towers' own at this level (inf where they
    cannot merge, or where the merged result would not have the towers' height and width)."""
    window = _window(level)
    if window is None:
        return float("inf")
    (kh, kw), padding, _ = window
    stride, dilation = tuple(level[0].conv.args[3]), tuple(level[0].conv.args[5])

    def extent(n: int, pad: int, k: int, d: int) -> int:  # a convolution's output length
        return (n + 2 * pad - dilation[d] * (k - 1) - 1) // stride[d] + 1
    for t in level:
        own = tuple(t.conv.args[4])
        if any(extent(t.size[d], own[d], t.weight.shape[2 + d], d) != extent(t.size[d], padding[d], k, d)
               for d, k in ((0, kh), (1, kw))):
            return float("inf")
    channels_in = max(stop for _, stop in _inputs(level, depth))
    merged = sum(int(t.weight.shape[0]) for t in level) * channels_in * kh * kw
    return merged / sum(t.weight.numel() for t in level)


def _merged(level: tuple[_Level, ...], depth: int) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int]]:
    """The merged convolution's weight (each tower's zero-padded into the merged window and placed
    at its output channels and the input channels it reads), bias (zeros for a tower without
    one; None where none has one) and padding."""
    (kh, kw), padding, offsets = _window(level)
    inputs = _inputs(level, depth)
    outputs = sum(int(t.weight.shape[0]) for t in level)
    weight = torch.zeros((outputs, max(stop for _, stop in inputs), kh, kw), dtype=level[0].weight.dtype)
    row, biases = 0, []
    for t, (top, left), (first, last) in zip(level, offsets, inputs):
        rows = int(t.weight.shape[0])
        weight[row:row + rows, first:last, top:top + t.weight.shape[2], left:left + t.weight.shape[3]] = t.weight
        row += rows
        biases.append(t.bias if t.bias is not None else torch.zeros(rows, dtype=t.weight.dtype))
    bias = torch.cat(biases).contiguous() if any(t.bias is not None for t in level) else None
    return weight, bias, padding
