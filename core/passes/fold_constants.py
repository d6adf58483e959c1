"""What a model computes from its weights and numbers alone is computed here, once, and stored as
a weight, instead of on every call (inference graphs, and a training step's joint graph, where the
parameters are inputs and so never constant).

torchvision's Swin Transformer builds each shifted window's attention mask in its forward
(`x.new_zeros(...)`, nine slice fills, a subtraction, two `masked_fill`s) and gathers each
block's relative position bias from its table: about a fifth of its ops, the same on every call.
An op is constant when every tensor it reads is a weight or a constant value (the `new_zeros`
family reads only its argument's dtype, so that argument does not count), it writes only
constant storage, and it draws no random numbers. The constant ops run here, on the CPU, in
program order; each constant value that a computed op reads becomes a weight (`<value>_folded`)
holding its contents, and the constant ops go.

A view of a weight (a transpose, a slice) is left as it is: it costs no kernel, and a folded copy
would store the weight twice. A tensor whose elements are all equal is left to its one fill
kernel (an initial state shaped by the batch would otherwise tie a multi-batch artifact to one
size). A constant op never writes a weight. Nothing is folded where a computed op reads a
constant storage before a constant op writes it, where a result would pass FOLD_BYTES (a large
table is cheaper to build than to store), or where an op fails to run on the CPU: then the graph
is returned as it was. Graph outputs are never folded. A pass that adds weights.
"""

from __future__ import annotations

import torch

from ..dtypes import STORABLE
from ..ir import WEIGHT, Graph, TensorSpec
from ..ops import arguments, targets, types
from .edit import Edit
from .substitute import free_name, read_weights

FOLD_BYTES = 16 * 2**20  # the most one folded value may hold
# ops that read only the dtype, device (and for the _like ones, the shape) of their first argument
METADATA_ONLY = frozenset({"aten::new_zeros.default", "aten::new_ones.default", "aten::new_full.default",
                           "aten::zeros_like.default", "aten::ones_like.default", "aten::full_like.default"})
RANDOM = ("rand", "normal", "bernoulli", "dropout", "uniform", "multinomial", "poisson", "empty", "exponential",
          "geometric", "cauchy", "log_normal")


def fold_constants(graph: Graph, weights: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Each value computed from weights and numbers alone that a computed op reads becomes a weight."""
    constant = _constant_ops(graph)
    if not constant:
        return graph, weights
    reader_of: dict[int, list[int]] = {}
    for op in graph.ops:
        if op.id not in constant:
            for r in op.refs():
                reader_of.setdefault(r, []).append(op.id)
    produced = {o for i in constant for o in graph.ops[i].outputs}
    boundary = [v for v in sorted(produced) if v in reader_of and v not in set(graph.outputs)]
    if not boundary or not _writes_precede_reads(graph, constant, reader_of):
        return graph, weights
    tensors = _evaluate(graph, constant, weights)
    if tensors is None:
        return graph, weights
    weights = dict(weights)
    edit = Edit(graph)
    storable = {d.name for d in STORABLE}
    kept_constant: set[int] = set()  # constant values left to their ops (see the module docstring)
    for v in boundary:
        t = tensors.get(v)
        if graph.values[graph.root(v)].kind == WEIGHT:  # a view of a weight costs no kernel: it stays
            kept_constant.add(v)
            continue
        dtype = types.dtype_name(t.dtype) if isinstance(t, torch.Tensor) else None
        if dtype not in storable or t.numel() * t.element_size() > FOLD_BYTES or _uniform(t):
            kept_constant.add(v)
            continue
        name = free_name(f"{graph.values[v].name}_folded", weights)
        weights[name] = t.detach().clone().contiguous()
        edit.replace_uses(v, edit.value(WEIGHT, TensorSpec(tuple(t.shape), dtype), name, before=v).id)
    if not edit.changed:
        return graph, weights
    needed = _producers_of(graph, constant, kept_constant)
    ops = [op for op in graph.ops if op.id not in constant or op.id in needed]
    return read_weights(edit.finish(ops), weights)


def _constant_ops(graph: Graph) -> set[int]:
    """Ids of the ops that compute from weights and numbers alone (see the module docstring)."""
    constant_values = {v.id for v in graph.values if v.kind == WEIGHT}
    computed_roots: set[int] = set()  # storages some computed op writes: nothing of them is constant
    constant: set[int] = set()
    while True:
        changed = False
        for op in graph.ops:
            if op.id in constant:
                continue
            reads = list(op.refs())
            if op.target in METADATA_ONLY and op.args:
                reads = reads[1:] if reads and reads[0] == getattr(op.args[0], "id", None) else reads
            name = op.target.split("::")[-1].split(".")[0]
            ok = op.target.startswith("aten::") and not any(w in name for w in RANDOM) \
                and all(r in constant_values and graph.root(r) not in computed_roots for r in reads) \
                and all(graph.root(m) not in computed_roots and graph.values[graph.root(m)].kind != WEIGHT
                        for m in op.mutates)
            if ok:
                constant.add(op.id)
                constant_values.update(op.outputs)
                changed = True
        poisoned = {graph.root(m) for op in graph.ops if op.id not in constant for m in op.mutates}
        if poisoned - computed_roots:
            computed_roots |= poisoned
            constant = {i for i in constant if not any(graph.root(o) in computed_roots for o in graph.ops[i].outputs)
                        and not any(graph.root(r) in computed_roots for r in graph.ops[i].refs())}
            constant_values = {v.id for v in graph.values if v.kind == WEIGHT}
            constant_values.update(o for i in constant for o in graph.ops[i].outputs)
            changed = True
        if not changed:
            return constant


def _uniform(t: torch.Tensor) -> bool:
    """A tensor of more than one element, all equal (zeros, a fill): one kernel makes it, and it is
    often shaped by the batch (an RNN's initial state), which a multi-batch artifact must not fix."""
    flat = t.reshape(-1)
    return flat.numel() > 1 and bool((flat == flat[0]).all())


def _writes_precede_reads(graph: Graph, constant: set[int], reader_of: dict[int, list[int]]) -> bool:
    """Whether every computed read of a constant storage comes after the last constant op that
    writes that storage (else the folded contents, its final state, would be read too early)."""
    last_write: dict[int, int] = {}
    for i in sorted(constant):
        for m in graph.ops[i].mutates:
            last_write[graph.root(m)] = i
    for v, readers in reader_of.items():
        root = graph.root(v)
        if root in last_write and min(readers) < last_write[root]:
            return False
    return True


def _evaluate(graph: Graph, constant: set[int], weights) -> dict[int, torch.Tensor] | None:
    """Every constant op run on the CPU in program order: value id -> tensor, or None if one fails."""
    cpu = torch.device("cpu")
    tensors = {v.id: weights[v.name] for v in graph.values if v.kind == WEIGHT}
    with torch.no_grad():
        for i in sorted(constant):
            op = graph.ops[i]
            try:
                if op.target in METADATA_ONLY:  # its first argument lends a dtype and shape, no contents
                    spec = graph.values[op.args[0].id].spec
                    stand_in = torch.zeros((), dtype=types.DTYPES[spec.dtype]).expand(spec.shape)
                    tensors.setdefault(op.args[0].id, stand_in)
                args, kwargs = arguments.op_arguments(op, tensors, cpu)
                # a training graph's own ops too (`fill.Tensor` of swin_t's masks): the graph's
                # lowering already held each op to its own mode's allowlist
                results = arguments.flatten_result(targets.resolve(op.target, training=True)(*args, **kwargs))
            except Exception:  # any failure leaves the graph as it was
                return None
            tensors.update(zip(op.outputs, results))
    return tensors


def _producers_of(graph: Graph, constant: set[int], values: set[int]) -> set[int]:
    """The constant ops `values` need: their producers, and the writers of their storages, and so
    on back through what those read."""
    writers: dict[int, list[int]] = {}  # storage root -> the constant ops that write it
    for i in constant:
        for m in graph.ops[i].mutates:
            writers.setdefault(graph.root(m), []).append(i)
    needed: set[int] = set()
    seen_roots: set[int] = set()
    stack = list(values)  # values whose producers and storage writers are needed
    while stack:
        v = stack.pop()
        ops = [graph.values[v].producer] if graph.values[v].producer is not None else []
        root = graph.root(v)
        if root not in seen_roots:
            seen_roots.add(root)
            ops += writers.get(root, [])
        for i in ops:
            if i in constant and i not in needed:
                needed.add(i)
                stack.extend(graph.ops[i].refs())
    return needed
