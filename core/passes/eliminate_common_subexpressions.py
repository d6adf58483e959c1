"""Inference graphs: an op computed again from the same values is computed once (common
subexpressions), and the same view of one value, made again, is made once (view de-duplication).

One walk does both, in program order, so each merge can enable the next: two relus of one value
become one, and then so do the two views of it that followed. As TorchScript's CSE finds, but
after host arithmetic was folded, so it finds more: NASNet cells apply one ReLU or one padding to a
value in several branches.
"""

from __future__ import annotations

import functools

from ..ir import Graph, Ref
from ..ops import targets
from ..ops.allowlist import NONDETERMINISTIC
from .substitute import rebuild, substitute


def eliminate_common_subexpressions(graph: Graph) -> Graph:
    """Merge each op into the first op with the same target and arguments:

    - a pure op (it neither writes nor aliases anything and draws no random numbers) when no op
      wrote anything between the two, and no op ever writes the result of either (else the write
      would reach both);
    - a view (every result aliases its input, nothing is written) whatever ran between: two views
      of one value with the same arguments are the same tensor.
    """
    written = {graph.root(m) for op in graph.ops for m in op.mutates}
    same: dict[int, int] = {}  # value id -> the value it is merged into
    pure: dict[tuple, tuple[int, ...]] = {}  # key -> results, since the last write
    views: dict[tuple, tuple[int, ...]] = {}
    kept = []
    for op in graph.ops:
        op = substitute(op, lambda v: same.get(v, v)) if same else op
        kind, key = _key(op.target, op.args, op.kwargs)
        results = [graph.values[o] for o in op.outputs]
        if op.mutates:
            pure.clear()  # what was computed before may differ after this
        elif kind == "view" and all(v.alias_of is not None for v in results):
            if key in views:
                same.update(zip(op.outputs, views[key]))
                continue
            views[key] = op.outputs
        elif kind == "pure" and all(v.alias_of is None and v.id not in written for v in results):
            if key in pure:
                same.update(zip(op.outputs, pure[key]))
                continue
            pure[key] = op.outputs
        kept.append(op)
    return rebuild(graph, kept, same) if same else graph


def _key(target: str, args, kwargs) -> tuple[str | None, tuple | None]:
    """("view", key), ("pure", key) or (None, None) for an op."""
    kind = _kind(target)
    if kind is None:
        return None, None
    try:
        key = (target, _frozen(args), _frozen(kwargs))
        hash(key)
    except TypeError:
        return None, None
    return kind, key


@functools.cache
def _kind(target: str) -> str | None:
    """"view", "pure" or None for a target, from its schema's alias annotations."""
    try:
        schema = targets.schema_op(target)._schema
    except Exception:  # not an aten op (a fused body): never merged
        return None
    arguments, returns = schema.arguments, schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns) \
            and not any(a.alias_info is not None and a.alias_info.is_write for a in arguments):
        return "view"
    if any(a.alias_info is not None for a in arguments) or any(r.alias_info is not None for r in returns) \
            or target.split("::")[1].split(".")[0] in NONDETERMINISTIC:
        return None
    return "pure"


def _frozen(obj):
    """`obj` as a hashable key that tells 1, 1.0 and True apart."""
    if isinstance(obj, tuple):
        return ("tuple", *(_frozen(o) for o in obj))
    return obj if isinstance(obj, Ref) or obj is None else (type(obj).__name__, obj)
