"""Which ops must stay float32 for a reduced-precision graph to meet a tolerance, in the manner of
Polygraphy's `debug precision`: try, measure, keep more in float32, try again; then give back
whatever the tolerance does not need.

The measure is the relative L2 error of each graph output against the float32 graph on the same
inputs, on the device the compile checks on (`run(graph, weights)` gives every value's tensor).
Where it is above the tolerance, the ops to blame are those whose own result is furthest off
float32 beyond what their inputs already were (an overflow to inf ranks first). Each round keeps
twice as many of them as the round before; once the tolerance is met, each kept op is tried back
in the reduced dtype, the least to blame first, and stays there if the outputs still pass.

`first_loss` names the op that first loses accuracy, for the one-line error of a compile with no
tolerance whose check fails.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .ir import ACTIVATION, Graph
from .passes.reduce_precision import Converted, Precision, convert, short_target
from .runtime.base.compare import relative_l2

PRUNE_TRIES = 8  # kept ops tried back in the reduced dtype one by one, at most


@dataclass
class Found:
    precision: Precision  # with the kept ops
    converted: Converted
    errors: list[float]  # relative L2 error per output against float32
    tries: int  # graphs converted and run
    loss: str | None = None  # where the errors are above the check's limit: the op that first loses accuracy


Runner = Callable[[Graph, dict], dict[int, torch.Tensor]]


def search(graph: Graph, weights: dict, precision: Precision, run: Runner, tolerance: float | None,
           limit: float, progress: Callable[[str], None] = lambda text: None) -> Found:
    """The reduced graph of `graph` with the fewest float32 ops found that keep every output within
    `tolerance` (None: no search, none kept beyond the rule's). Where the result is still more
    than `limit` off, `Found.loss` names the op that first loses accuracy. Raises ValueError where
    even every op in float32 does not meet `tolerance`."""
    reference = run(graph, weights)
    tries = 0

    def attempt(keep: frozenset[int]):
        nonlocal tries
        tries += 1
        converted = convert(graph, weights, dataclasses.replace(precision, keep=keep))
        values = run(converted.graph, converted.weights)
        errors = [relative_l2(values[new], reference[o])  # as the graph hands them out (--io-dtype casts)
                  for new, o in zip(converted.graph.outputs, graph.outputs)]
        return converted, values, errors

    def ok(errors: list[float]) -> bool:
        return all(e <= tolerance for e in errors)

    keep: frozenset[int] = frozenset()
    first = attempt(keep)
    converted, values, errors = first
    step, added = 1, []
    while tolerance is not None and not ok(errors):
        blamed = [op for op, _ in blame(graph, converted, values, reference, precision.dtype) if op not in keep]
        if not blamed:
            raise ValueError(f"with every op that differs kept in float32 the outputs are {max(errors):.3g} off "
                             f"(relative L2), above the tolerance {tolerance:g}"
                             + _outputs_out_of_range(graph, reference, precision))
        added = blamed[:step]
        keep = keep | frozenset(added)
        progress(f"precision search: {len(keep)} op(s) kept in float32, error {max(errors):.3g}")
        converted, values, errors = attempt(keep)
        step *= 2
    if tolerance is not None and len(added) > 1:  # the last round may have kept up to twice what it needed
        lo, hi, best = 0, len(added), (converted, values, errors)
        base = keep - frozenset(added)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            trial = attempt(base | frozenset(added[:mid]))
            if ok(trial[2]):
                hi, best = mid, trial
            else:
                lo = mid
        keep = base | frozenset(added[:hi])
        converted, values, errors = best
    if tolerance is not None and keep:
        scores = dict(blame(graph, first[0], first[1], reference, precision.dtype))
        for op in sorted(keep, key=lambda o: (scores.get(o, 0.0), o))[:PRUNE_TRIES]:
            trial = attempt(keep - {op})
            if ok(trial[2]):
                keep = keep - {op}
                converted, values, errors = trial
        progress(f"precision search: {len(keep)} op(s) kept in float32, error {max(errors):.3g}")
    loss = None if all(e <= limit for e in errors) else first_loss(graph, converted, values, reference, limit,
                                                                        precision)
    return Found(dataclasses.replace(precision, keep=keep), converted, errors, tries, loss)


class _Errors:
    """The relative L2 error of each old value's reduced counterpart against float32, worked out
    once per value (0 for values that are not floating or were not converted)."""

    def __init__(self, graph: Graph, converted: Converted, values: dict, reference: dict):
        self.graph, self.converted, self.values, self.reference = graph, converted, values, reference
        self._of: dict[int, float] = {}

    def __call__(self, vid: int) -> float:
        if vid not in self._of:
            new = self.converted.value_of.get(vid)
            floating = new is not None and self.graph.values[vid].spec.dtype in ("float32", "float16", "bfloat16")
            self._of[vid] = relative_l2(self.values[new], self.reference[vid]) if floating else 0.0
        return self._of[vid]


def blame(graph: Graph, converted: Converted, values: dict, reference: dict, dtype: str) -> list[tuple[int, float]]:
    """(op id, score) for every op that computes in the reduced dtype and writes a fresh floating
    result that differs from float32's, most to blame first: a result `dtype` cannot hold
    (float32's values beyond its range, or so far below its smallest normal number that fewer than
    four bits are left), then how much further off float32 its result is than its most inaccurate
    input (infinite for a result that turned inf or NaN from finite inputs); among equal scores,
    the furthest off first, then program order."""
    info = torch.finfo(getattr(torch, dtype))
    off = _Errors(graph, converted, values, reference)
    scores = []
    for op in graph.ops:
        if op.id in converted.fp32 or len(op.outputs) != 1:
            continue
        v = graph.values[op.outputs[0]]
        if v.kind != ACTIVATION or v.alias_of is not None or v.spec.dtype != "float32":
            continue
        mine = off(v.id)
        if mine == 0:
            continue
        inputs = max((off(r) for r in op.refs()), default=0.0)
        score = 0.0 if mine <= inputs else (math.inf if math.isinf(mine) else mine - inputs)
        biggest = _largest(reference[v.id])
        if biggest > info.max or 0 < biggest < info.tiny / 16:
            score = math.inf
        scores.append((op.id, score, mine))
    return [(op, score) for op, score, _ in sorted(scores, key=lambda s: (-s[1], -s[2], s[0]))]


def first_loss(graph: Graph, converted: Converted, values: dict, reference: dict, tolerance: float,
               precision: Precision) -> str:
    """'silu_57 (aten::silu at model.py:12), whose result is inf or NaN where float32's is
    finite': the first op, in program order, whose result is not finite or is more than
    `tolerance` off float32 (relative L2), where no input of it was yet."""
    off = _Errors(graph, converted, values, reference)
    for op in graph.ops:
        for o in op.outputs:
            v = graph.values[o]
            if v.kind != ACTIVATION or v.spec.dtype != "float32" or (mine := off(o)) <= tolerance:
                continue
            if max((off(r) for r in op.refs()), default=0.0) <= tolerance:
                where = f" at {op.source}" if op.source else ""
                what = "is inf or NaN where float32's is finite" if math.isinf(mine) else \
                    f"is {mine:.3g} off float32 (relative L2)"
                fact = _outside(reference[o], precision.dtype)
                return (f"{v.name} ({short_target(op.target)}{where}), whose result {what}"
                        + (f"; {fact}: use --precision bf16 (float32's range)" if fact else ""))
    outside = _outputs_out_of_range(graph, reference, precision)
    return (f"none: the outputs themselves{outside}" if outside else
            "no single op: the error builds up over many")


def _largest(x: torch.Tensor) -> float:
    """The largest finite magnitude in `x` (0 if none)."""
    finite = x[torch.isfinite(x)]
    return finite.abs().max().item() if finite.numel() else 0.0


def _outside(x: torch.Tensor, dtype: str) -> str:
    """How float32's values `x` lie outside what `dtype` holds, or ''."""
    info = torch.finfo(getattr(torch, dtype))
    biggest = _largest(x)
    if biggest > info.max:
        return f"float32's values reach {biggest:.3g}, beyond {dtype}'s largest {info.max:.5g}"
    if 0 < biggest < info.tiny:
        return (f"float32's values are at most {biggest:.3g}, below {dtype}'s smallest normal number "
                f"{info.tiny:.3g}, so {dtype} loses them")
    return ""


def _outputs_out_of_range(graph: Graph, reference: dict, precision: Precision) -> str:
    """With --io-dtype reduced, where float32's outputs lie outside what the reduced dtype holds:
    why, and what to do; else ''."""
    if precision.io != "reduced":
        return ""
    for o in graph.outputs:
        fact = _outside(reference[o], precision.dtype) if graph.values[o].spec.dtype == "float32" else ""
        if fact:
            return (f", which --io-dtype reduced hands out in {precision.dtype}; {fact}: use --io-dtype model "
                    "(float32 outputs)")
    return ""
