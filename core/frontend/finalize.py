"""What the builder emitted, as a `Graph`: every op in the order it was emitted (dead ones too),
with the ordering edges its in-place writes need. The rewrites (`passes/`) start from here."""

from __future__ import annotations

import torch

from ..ir import Graph, Op, Value, with_ordering_edges


def finalize(values: list[Value], ops: list[Op], inputs: list[int], outputs: list[int],
             weights: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    graph = with_ordering_edges(Graph(tuple(values), tuple(ops), tuple(inputs), tuple(outputs)))
    graph.lint()
    return graph, weights
