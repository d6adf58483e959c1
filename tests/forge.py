"""Forging `.nimble` artifacts the way an attacker would: any graph, schedule and plan written by
nimble's own encoder, or any member edited afterwards, with the manifest's hashes re-sealed so
that the forgery reaches the deep checks. Used by test_artifact.py and test_hostile.py."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import torch

from nimble.formats.artifact import Artifact, encode
from nimble.ir import ACTIVATION, INPUT, WEIGHT, Graph, Op, Ref, TensorSpec, Value
from nimble.plan.memory import MemoryPlan, plan
from nimble.plan.schedule import assign_streams


def members_of(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {i.filename: z.read(i.filename) for i in z.infolist()}


def rebuild(data: bytes, changes: dict, manifest_edit=None, fix_hashes: bool = True,
            raw_manifest: bytes | None = None) -> bytes:
    """A copy of the artifact with members replaced (None drops one), hashes re-sealed unless told."""
    members = members_of(data)
    manifest = json.loads(members.pop("manifest.json"))
    for name, new in changes.items():
        if new is None:
            members.pop(name)
        else:
            members[name] = new
    if fix_hashes:
        for name, content in members.items():
            manifest["members"][name] = {"sha256": hashlib.sha256(content).hexdigest(), "size": len(content)}
    if manifest_edit:
        manifest_edit(manifest)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr("manifest.json", raw_manifest if raw_manifest is not None else json.dumps(manifest))
        for name, content in members.items():
            z.writestr(name, content)
    return out.getvalue()


def edit_json(data: bytes, member: str, edit) -> bytes:
    """Edit one JSON member as a Python object, then re-seal."""
    doc = json.loads(members_of(data)[member])
    edit(doc)
    return rebuild(data, {member: json.dumps(doc).encode()})


def edit_text(data: bytes, member: str, edit) -> bytes:
    """Edit one JSON member as text (for what json.dumps cannot write: duplicate keys, NaN)."""
    return rebuild(data, {member: edit(members_of(data)[member].decode()).encode()})


def spec(*shape: int, dtype: str = "float32", strides=(), offset: int = 0) -> TensorSpec:
    return TensorSpec(tuple(shape), dtype, tuple(strides), offset)


def forge(values: list[tuple], ops: list[tuple], outputs: list[int], weights: dict | None = None,
          memory: MemoryPlan | None = None, validate: bool = True) -> bytes:
    """An artifact from a hand-written graph.

    values: (kind, spec, name, producer, alias_of) per value, ids in order;
    ops: (target, args, outputs, mutates) per op, args as IR constants (Ref for tensors).
    The schedule is nimble's own one-stream schedule; the plan is nimble's own unless given.
    Weights default to zeros of their declared shape; sample inputs and outputs to zeros."""
    vals = tuple(Value(i, kind, s, name, producer, alias)
                 for i, (kind, s, name, producer, alias) in enumerate(values))
    op_list = tuple(Op(i, target, tuple(args), (), tuple(outs), tuple(mutates), (), "forged.py:1")
                    for i, (target, args, outs, mutates) in enumerate(ops))
    graph = Graph(vals, op_list, tuple(v.id for v in vals if v.kind == INPUT), tuple(outputs))
    if validate:
        graph.lint()
    schedule = assign_streams(graph, 1) if validate else _one_stream(graph)
    memory = memory if memory is not None else plan(graph, schedule)

    def zeros(s: TensorSpec):
        return torch.zeros(s.shape, dtype=getattr(torch, s.dtype))

    weights = weights or {v.name: zeros(v.spec) for v in vals if v.kind == WEIGHT}
    art = Artifact({"model": "forged.pt", "source_sha256": "0" * 64, "options": {"streams": "1"}}, graph,
                   schedule, memory, weights, [zeros(vals[i].spec) for i in graph.inputs],
                   [zeros(vals[o].spec) for o in graph.outputs])
    return encode(art)


def _one_stream(graph: Graph):
    from nimble.plan.schedule import Schedule

    n = len(graph.ops)
    return Schedule(tuple([0] * n), tuple(range(n)), tuple(range(n)), tuple(() for _ in range(n)), 0, 0, 0, 0, "1")


def tiny(*extra_ops, outputs=None, extra_values=()):
    """Values for a tiny model: input x [1, 4] (16 bytes, id 0) and weight w [4096] (id 1), plus
    `extra_values`; returns (values, ops) ready for `forge`."""
    values = [(INPUT, spec(1, 4), "x", None, None), (WEIGHT, spec(4096), "w", None, None), *extra_values]
    return values, list(extra_ops)


__all__ = ["ACTIVATION", "INPUT", "WEIGHT", "Ref", "edit_json", "edit_text", "forge", "members_of", "rebuild",
           "spec", "tiny"]
