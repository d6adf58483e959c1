"""Training graphs only (`TrainStep` runs it after the joint passes): each training-mode batch norm
and its backward become `nimble::batch_norm_act` and `nimble::batch_norm_act_backward`
(`ops/norm_act.py`), with the activation that reads the norm's result and that activation's
backward folded in where the graph allows.

A batch norm `_native_batch_norm_legit_functional(x, w, b, running_mean, running_var, True, ...)`
is taken with the `native_batch_norm_backward` that reads its saved mean and inverse deviation
(and `x`), with affine weight and bias, momentum and eps numbers (not values of the graph), all
three gradients asked for. Its activation goes in too where:
- one relu, hardtanh or silu reads the norm's result, and nothing else does but that activation's
  backward (directly or through a `detach`);
- that backward (`threshold_backward` at 0, `hardtanh_backward` at the same bounds,
  `silu_backward`, or the fused body torch's decomposition of it became) reads the activation's
  input or result, and the batch norm backward alone reads its gradient.
Otherwise the pair is taken with no activation ("none"), and where one op alone reads the norm's
result and adds another map of its shape to it, with a relu after or not (a residual join, as at
the end of ResNet's blocks), the forward takes that join in: the norm writes the join's result,
and the map before it is never written. The join's relu keeps its own backward. A norm with no
such backward (a frozen or eval-mode one) stays as it is.
"""

from __future__ import annotations

import dataclasses

import torch

from ..ir import Graph, Local, Op, Ref
from ..ops import fusion, norm_act
from ..ops.arguments import to_torch
from ..ops.interpret import run_fused
from .substitute import rebuild

FORWARD = "aten::_native_batch_norm_legit_functional.default"
BACKWARD = "aten::native_batch_norm_backward.default"
DETACH = "aten::detach.default"


def fuse_batch_norm_activation(graph: Graph, ranks=frozenset({2, 3, 4, 5})) -> Graph:
    """`graph` with its batch norms of an input of these ranks (and their backwards) fused; the
    runtime's kernels take 2-D maps and 4-D ones laid out channels_last (`TrainStep` asks for
    those where its kernels run)."""
    readers: dict[int, list[Op]] = {}
    for op in graph.ops:
        for r in set(op.refs()):
            readers.setdefault(r, []).append(op)
    backward_of = {(op.args[5], op.args[6]): op for op in graph.ops
                   if op.target == BACKWARD and len(op.args) >= 9 and isinstance(op.args[5], Ref)}
    replaced: dict[int, Op] = {}
    dropped: set[int] = set()
    values = list(graph.values)
    for op in graph.ops:
        if op.target != FORWARD or len(op.args) != 8 or op.kwargs or op.args[5] is not True:
            continue
        x, w, b, running_mean, running_var, _, momentum, eps = op.args
        if not all(isinstance(a, Ref) for a in (x, w, b, running_mean, running_var)) \
                or not all(isinstance(a, (int, float)) for a in (momentum, eps)) \
                or len(graph.values[x.id].spec.shape) not in ranks:
            continue
        z, mean, rstd = op.outputs[:3]
        back = backward_of.get((Ref(mean), Ref(rstd)))
        if back is None or not _takes(back, x):
            continue
        found = _activation(graph, readers, z, back)
        name, low, high, result, grad, gone = found if found is not None else ("none", 0.0, 0.0, z, back.args[0], ())
        args = (name, float(low), float(high))
        replaced[back.id] = Op(back.id, norm_act.NORM_ACT_BACKWARD, (grad, x, w, b, Ref(mean), Ref(rstd), eps, *args),
                               (), back.outputs, source=back.source)
        joined = _residual(graph, readers, z) if found is None else None
        # a norm whose result a residual join alone reads becomes that join (of two norms' results,
        # the first takes it); the op goes where the join was, where its other operand exists
        if joined is not None and joined[0].id not in replaced:
            join, residual, join_act = joined
            dropped.add(op.id)
            replaced[join.id] = Op(join.id, norm_act.NORM_ACT, (x, w, b, running_mean, running_var, momentum, eps,
                                                                join_act, 0.0, 0.0, residual), (),
                                   (join.outputs[0], *op.outputs[1:]), source=op.source)
            for v in op.outputs[1:]:
                values[v] = dataclasses.replace(values[v], producer=join.id)
            continue
        replaced[op.id] = Op(op.id, norm_act.NORM_ACT, (x, w, b, running_mean, running_var, momentum, eps, *args), (),
                             (result, *op.outputs[1:]), source=op.source)
        if found is not None:
            dropped.update(o.id for o in gone)
            values[result] = dataclasses.replace(values[result], producer=op.id)
    if not replaced:
        return graph
    ops = [replaced.get(op.id, op) for op in graph.ops if op.id not in dropped]
    return rebuild(graph, ops, values=values)


def _takes(back: Op, x: Ref) -> bool:
    """Whether batch norm's backward `back` is the training one of input `x`, asking for all three
    gradients."""
    mask = back.args[9] if len(back.args) > 9 else None
    return back.args[1] == x and back.args[7] is True and not back.kwargs and len(back.outputs) == 3 \
        and (mask is None or all(mask))


def _activation(graph: Graph, readers: dict[int, list[Op]], z: int, back: Op):
    """(name, low, high, the activation's result, the gradient its backward takes in, the ops that
    go: that backward, the activation and the detaches between them) for the activation between
    batch norm's result `z` and its backward `back`, or None."""
    grad = back.args[0]
    if not isinstance(grad, Ref):
        return None
    producer = graph.values[grad.id].producer
    backward = graph.ops[producer] if producer is not None else None
    if backward is None or [o.id for o in readers.get(grad.id, [])] != [back.id]:
        return None
    forwards = [o for o in readers.get(z, []) if o.target in norm_act.ACTIVATIONS and o.args[0] == Ref(z)]
    if len(forwards) != 1:
        return None
    act = forwards[0]
    name, backward_target = norm_act.ACTIVATIONS[act.target]
    if act.kwargs or (name != "hardtanh" and len(act.args) != 1):
        return None
    y = act.outputs[0]
    low, high = 0.0, 0.0
    if name == "hardtanh":
        low, high = (list(act.args[1:3]) + [-1.0, 1.0][len(act.args) - 1:])[:2]
        if not all(isinstance(v, (int, float)) for v in (low, high)):
            return None
    chain: list[Op] = []
    if name == "silu" and backward.target == fusion.FUSED:  # silu_backward as torch decomposed and nimble fused it
        incoming = _silu_backward(backward, z)
        if incoming is None:
            return None
    else:
        if backward.target != backward_target or backward.kwargs \
                or (name == "hardtanh" and list(backward.args[2:4]) != [low, high]) \
                or (name == "relu" and (len(backward.args) != 3 or backward.args[2] != 0)):
            return None
        incoming, source = backward.args[0], backward.args[1]
        while isinstance(source, Ref) and graph.values[source.id].producer is not None \
                and graph.ops[graph.values[source.id].producer].target == DETACH:
            chain.append(graph.ops[graph.values[source.id].producer])
            source = chain[-1].args[0]
        if source not in ((Ref(z),) if name == "silu" else (Ref(z), Ref(y))):
            return None
    gone = {backward.id: backward, act.id: act}
    # the detaches between the backward and what it reads, where nothing else reads them
    for d in chain:
        if all(o.id in gone for o in readers.get(d.outputs[0], [])):
            gone[d.id] = d
    # z goes: nothing may read it but the activation and its backward, through detaches or not
    if any(o.id not in gone for o in readers.get(z, [])):
        return None
    return name, low, high, y, incoming, list(gone.values())


def _silu_backward(op: Op, z: int) -> Ref | None:
    """The gradient `op` takes in, where `op` is a fused body of `z` and one other value that
    computes `silu_backward(that value, z)` (torch decomposes silu's backward into seven
    elementwise ops, which fusion makes one body): checked by running the body on samples in
    float64, whatever order its ops come in."""
    refs = set(op.refs())
    if len(refs) != 2 or z not in refs:
        return None
    grad = (refs - {z}).pop()
    generator = torch.Generator().manual_seed(0)
    zs = torch.randn(64, dtype=torch.float64, generator=generator) * 4
    gs = torch.randn(64, dtype=torch.float64, generator=generator)
    try:
        got = run_fused(to_torch(op.args[0], {z: zs, grad: gs}, torch.device("cpu")))
    except (RuntimeError, TypeError, ValueError):
        return None
    expected = torch.ops.aten.silu_backward(gs, zs)
    same = got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-12, atol=1e-12)
    return Ref(grad) if same else None


ADD = "aten::add.Tensor"


def _residual(graph: Graph, readers: dict[int, list[Op]], z: int):
    """(the op, the other operand, "relu" or "none") where batch norm's result `z` is read by one
    op alone, and that op adds another map of its shape and dtype to it, then takes the relu of
    the sum or not: a residual join (`add(z, r)`, or a fused body of that add and a relu). None
    otherwise."""
    reading = readers.get(z, [])
    if len(reading) != 1:
        return None
    join = reading[0]
    if join.target == ADD:
        nodes, name = ((ADD, join.args, join.kwargs),), "none"
    elif join.target == fusion.FUSED:
        nodes = join.args[0]
        name = "relu" if len(nodes) == 2 and nodes[1][0] == "aten::relu.default" and nodes[1][1] == (Local(0),) \
            and not nodes[1][2] else "none"
        if len(nodes) != (2 if name == "relu" else 1) or nodes[0][0] != ADD:
            return None
    else:
        return None
    _, operands, kwargs = nodes[0]
    if len(operands) != 2 or any(k != "alpha" or a != 1 for k, a in kwargs) or Ref(z) not in operands:
        return None
    other = operands[1] if operands[0] == Ref(z) else operands[0]
    spec = graph.values[z].spec
    if not isinstance(other, Ref) or other == Ref(z) or graph.values[other.id].spec.shape != spec.shape \
            or graph.values[other.id].spec.dtype != spec.dtype:
        return None
    return join, other, name
