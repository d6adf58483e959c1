"""Seeded NASNet-like cell networks as IR graphs, for memory-plan and schedule benchmarks and tests.

    graph = cell_network(seed)

Each seed picks a stem width, an input size, a cell count, blocks per cell, the cells that reduce
(halve the map, double the width) and per-branch expansion factors, so tensor sizes mix from a few
KiB to several MiB. A cell takes the two previous cell outputs, adjusts each to the cell's width
and map with a 1x1 convolution, builds its blocks (each adds two branches: a separable convolution
of relu, an expanding depthwise and a projecting pointwise convolution, a pooling, or the state
itself) and concatenates the blocks nothing else consumed, as NASNet-A does. Some cells hand a view
of their output on. The graph ends in a global pool, a flattening view and a linear layer.

Only shapes, data flow and aliases are real: the ops carry no weights or convolution arguments,
so the graphs are for planning (no torch needed), not for running.
"""

from __future__ import annotations

import random
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nimble.ir import ACTIVATION, INPUT, Graph, Op, Ref, TensorSpec, Value  # noqa: E402


class _Builder:
    def __init__(self):
        self.values: list[Value] = []
        self.ops: list[Op] = []

    def input(self, shape) -> int:
        self.values.append(Value(len(self.values), INPUT, TensorSpec(tuple(shape), "float32"), "x"))
        return len(self.values) - 1

    def op(self, target: str, reads, shape, view_of: int | None = None) -> int:
        vid, oid = len(self.values), len(self.ops)
        root = None
        if view_of is not None:
            base = self.values[view_of]
            root = base.alias_of if base.alias_of is not None else base.id
        self.values.append(Value(vid, ACTIVATION, TensorSpec(tuple(shape), "float32"), f"v{vid}", oid, root))
        self.ops.append(Op(oid, target, tuple(Ref(r) for r in reads), (), (vid,)))
        return vid

    def shape(self, v: int) -> tuple[int, ...]:
        return self.values[v].spec.shape


def cell_network(seed: int, cells: int | None = None) -> Graph:
    """The network of `seed`; `cells` overrides its cell count (about 45 ops a cell)."""
    rng = random.Random(seed)
    width = rng.choice([8, 16, 24, 32, 48])
    size = rng.choice([28, 56, 112])
    drawn = rng.randint(3, 9)
    cells = drawn if cells is None else cells
    blocks = rng.randint(3, 6)
    reducing = set(rng.sample(range(1, cells), k=min(2, cells - 1)))
    b = _Builder()
    x = b.input((1, 3, size, size))
    stem = b.op("aten::convolution.default", [x], (1, width, size, size))
    prev2 = prev = stem
    for cell in range(cells):
        if cell in reducing:
            width, size = width * 2, max(size // 2, 1)
        target = (1, width, size, size)
        states = [b.op("aten::convolution.default", [b.op("aten::relu.default", [s], b.shape(s))], target)
                  for s in (prev2, prev)]
        used: set[int] = set()
        for _ in range(blocks):
            ends = []
            for _ in range(2):
                state = rng.choice(states)
                used.add(state)
                kind = rng.random()
                if kind < 0.55:  # separable convolution, once or twice, with an expansion
                    node = state
                    for _ in range(rng.choice([1, 1, 2])):
                        mid = (1, width * rng.choice([1, 2, 4]), size, size)
                        node = b.op("aten::relu.default", [node], b.shape(node))
                        node = b.op("aten::convolution.default", [node], mid)
                        node = b.op("aten::convolution.default", [node], target)
                    ends.append(node)
                elif kind < 0.85:
                    ends.append(b.op(rng.choice(["aten::avg_pool2d.default", "aten::max_pool2d.default"]),
                                     [state], target))
                else:
                    ends.append(state)
            block = b.op("aten::add.Tensor", ends, target)
            states.append(block)
        loose = [s for s in states[2:] if s not in used] or states[-1:]
        out = b.op("aten::cat.default", loose, (1, width * len(loose), size, size))
        if rng.random() < 0.3:  # hand a view on: it keeps the cat's buffer alive
            out = b.op("aten::view.default", [out], (1, width * len(loose), size * size), view_of=out)
            out = b.op("aten::view.default", [out], (1, width * len(loose), size, size), view_of=out)
        prev2, prev = prev, out
    pooled = b.op("aten::mean.dim", [prev], b.shape(prev)[:2] + (1, 1))
    flat = b.op("aten::flatten.using_ints", [pooled], b.shape(pooled)[:2], view_of=pooled)
    logits = b.op("aten::linear.default", [flat], (1, 10))
    graph = Graph(tuple(b.values), tuple(b.ops), (x,), (logits,))
    graph.lint()
    return graph
