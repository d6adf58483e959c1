"""Writing and reading `.nimble` artifacts.

Layout (every member stored, uncompressed, with fixed timestamps, in this order):
    manifest.json               format and tool versions, source hash, I/O specs, options,
                                and the sha256 and size of every other member
    graph.json                  the op graph (nimble.ir)
    schedule.json               the multi-stream schedule and its capped stream candidates
    memory.json                 the arena plan
    batch/<b>/graph.json, ...   an artifact of several batch sizes (`--batch-sizes`): the graph,
                                schedule and memory plan of each batch size after the first, the
                                first's at the top; the weights and the sample I/O (at the first
                                batch size) are shared; format version 3
    weights.safetensors         weights, by value name
    sample/inputs.safetensors   a reference input ...
    sample/outputs.safetensors  ... and the source model's outputs for it

Threat model: an artifact may come from anyone. It can make nimble compute its declared graph, on
its declared shapes, inside its declared arena and weights, and nothing else. `read_artifact`
checks, in order, before allocating any tensor: the zip and its members; sizes, hashes and strict
JSON (no duplicate keys, NaN or Infinity) under the caps in `spec.py`; every field's type and range
(`codec`), the graph's invariants (`Graph.lint`, which raises rather than asserts); exact
allowlisted overloads, never `out=` ones (`nimble.ops.targets.device_ops`); the schedule and the
memory plan (`nimble.plan.verify`, O(n log n)); the safetensors headers. Before any data moves,
loading for execution also runs the op list on the meta device against every declared spec and
buffer (`nimble.runtime.preflight`). Every refusal is one ArtifactError line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import io
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nimble import __version__
from nimble.errors import ArtifactError, NimbleError, first_line
from nimble.fileio import atomic_file
from nimble.model_files import check_artifact_file
from nimble.ir import WEIGHT, Graph
from nimble.ops.batches import check_batches
from nimble.ops.rows import RowsError
from nimble.plan.memory import MemoryPlan
from nimble.plan.schedule import Schedule
from nimble.plan.verify import check_plan

from . import checks, codec, tensors
from .spec import (BATCH_MEMBER, FORMAT_VERSION, GRAPH, MANIFEST, MEMBERS, MEMORY, ONE_BATCH_VERSION, SAMPLE_INPUT_KEY,
                   SAMPLE_INPUTS, SAMPLE_OUTPUT_KEY, SAMPLE_OUTPUTS, SCHEDULE, WEIGHTS, ZIP_DATE, batch_members)


@dataclass
class Artifact:
    manifest: dict
    graph: Graph
    schedule: Schedule
    memory: MemoryPlan
    weights: dict[str, torch.Tensor]
    sample_inputs: list[torch.Tensor]
    sample_outputs: list[torch.Tensor]
    # the other batch sizes of a multi-batch artifact: batch -> (graph, schedule, memory plan)
    batches: dict[int, tuple[Graph, Schedule, MemoryPlan]] = field(default_factory=dict)

    @property
    def batch(self) -> int | None:
        """The batch size of the top-level graph: the first dimension of its inputs (None: no input
        has one)."""
        shapes = [self.graph.values[i].spec.shape for i in self.graph.inputs]
        return shapes[0][0] if shapes and shapes[0] else None

    @property
    def batch_sizes(self) -> list[int]:
        """Every batch size the artifact holds a graph for, smallest first ([] for one with no
        batch dimension)."""
        return sorted({self.batch, *self.batches}) if self.batch is not None else []

    def for_batch(self, batch: int) -> Artifact:
        """The artifact of one of its batch sizes: that graph, schedule and memory plan with the
        shared weights, and sample inputs and outputs made of the stored ones' rows, repeated (the
        compile checked that the model maps rows so)."""
        if batch == self.batch:
            return dataclasses.replace(self, batches={})
        graph, schedule, memory = self.batches[batch]
        rows = torch.arange(batch) % self.batch
        return Artifact(self.manifest, graph, schedule, memory, self.weights,
                        [x[rows] for x in self.sample_inputs], [y[rows] for y in self.sample_outputs])

    @property
    def model(self) -> str:
        return self.manifest["model"]

    @property
    def passes(self) -> list[tuple[str, int]] | None:
        """(pass, ops after it) in the order they ran, the lowered graph first; None if unrecorded."""
        passes = self.manifest.get("passes")
        return None if passes is None else [(name, n) for name, n in passes]

    @property
    def precision(self) -> dict | None:
        """A reduced-precision artifact's record (dtype, io, tolerance, the float32 ops and why);
        None for float32."""
        return self.manifest.get("precision")


def _json(obj) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), sort_keys=False, allow_nan=False) + "\n").encode()


def _io_specs(graph: Graph, ids) -> list[dict]:
    return [{"name": graph.values[i].name, **codec.encode_spec(graph.values[i].spec)} for i in ids]


def encode(art: Artifact) -> bytes:
    """The artifact's bytes: the same objects always give the same bytes."""
    buffer = io.BytesIO()
    _write_zip(buffer, art)
    return buffer.getvalue()


def write_artifact(path: str | Path, art: Artifact) -> int:
    """Write `art` to `path` atomically, streaming into the temp file; returns the size in bytes."""
    with atomic_file(path) as f:
        _write_zip(f, art)
        return f.tell()


def _plan_members(art: Artifact) -> dict[str, list[bytes]]:
    """The members that say what an artifact runs: each batch size's graph, schedule and memory plan."""
    return {
        GRAPH: [_json(codec.encode_graph(art.graph))],
        SCHEDULE: [_json(codec.encode_schedule(art.schedule))],
        MEMORY: [_json(codec.encode_memory(art.memory))],
        **{BATCH_MEMBER.format(b, m): [_json(doc)] for b, (graph, schedule, memory) in sorted(art.batches.items())
           for m, doc in ((GRAPH, codec.encode_graph(graph)), (SCHEDULE, codec.encode_schedule(schedule)),
                          (MEMORY, codec.encode_memory(memory)))},
    }


def plan_digest(art: Artifact) -> str:
    """A sha256 of what `art` runs (`_plan_members`), its weights and samples left out: the same for
    the artifact in memory at compile and read back from its file (whose manifest has each
    member's digest, checked as it was read)."""
    members = art.manifest.get("members") or {name: _digest(chunks) for name, chunks in _plan_members(art).items()}
    plan = {name: d["sha256"] for name, d in members.items() if name not in (WEIGHTS, SAMPLE_INPUTS, SAMPLE_OUTPUTS)}
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def _write_zip(file, art: Artifact) -> None:
    g = art.graph
    members = {  # each member as a list of chunks, so that weights stream without a copy
        **_plan_members(art),
        WEIGHTS: tensors.serialize({g.values[w].name: art.weights[g.values[w].name] for w in g.weights}),
        SAMPLE_INPUTS: tensors.serialize({SAMPLE_INPUT_KEY.format(i): t for i, t in enumerate(art.sample_inputs)}),
        SAMPLE_OUTPUTS: tensors.serialize({SAMPLE_OUTPUT_KEY.format(i): t
                                           for i, t in enumerate(art.sample_outputs)}),
    }
    manifest = {
        "format_version": FORMAT_VERSION if art.batches else ONE_BATCH_VERSION,
        "nimble_version": __version__,
        "torch_version": torch.__version__,
        **{k: art.manifest[k] for k in ("model", "source_sha256", "options", "passes", "precision")
           if k in art.manifest},
        **({"batch_sizes": art.batch_sizes} if art.batches else {}),
        "inputs": _io_specs(g, g.inputs),
        "outputs": _io_specs(g, g.outputs),
        "members": {name: _digest(chunks) for name, chunks in members.items()},
    }
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED) as z:
        for name, chunks in [(MANIFEST, [_json(manifest)]), *members.items()]:
            info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            info.create_system = 3
            info.file_size = sum(len(c) for c in chunks)
            with z.open(info, "w", force_zip64=info.file_size >= 2**31) as out:
                for chunk in chunks:
                    out.write(chunk)


def _digest(chunks) -> dict:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return {"sha256": h.hexdigest(), "size": sum(len(c) for c in chunks)}


def read_artifact(path: str | Path) -> Artifact:
    """Read and validate an artifact. Any defect raises ArtifactError with one line naming it."""
    path = Path(path)
    check_artifact_file(path)
    try:
        with paused_gc():
            return _read(path)
    except NimbleError:
        raise
    except Exception as e:  # whatever a damaged zip or blob throws, it is the artifact's defect
        raise ArtifactError(f"{path} is corrupt ({type(e).__name__}: {first_line(e)}); recompile the model") from e


@contextlib.contextmanager
def paused_gc():
    """Pause the cyclic garbage collector while a large graph is built: its objects hold no
    cycles, and the collector's passes over them took a third of validating 30,000 ops."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _read(path: Path) -> Artifact:
    name = path.name
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            if f.read(4) == b"PK\x03\x04":  # a zip's start without its end: cut short in a copy
                raise ArtifactError(f"{name} is truncated (a zip archive without its end); copy or compile it again")
        raise ArtifactError(f"{name} is not a .nimble artifact (not a zip file)")
    size = path.stat().st_size
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        names = [i.filename for i in infos]
        if len(names) != len(set(names)):
            raise ArtifactError(f"{name} has duplicate members")
        if MANIFEST not in names:
            if any(n.rsplit("/", 1)[-1] in ("data.pkl", "archive_format") or "/code/" in n for n in names):
                raise ArtifactError(f"{name} is a PyTorch model, not a .nimble artifact; compile it first: nimble "
                                    f"compile {name} --shape ... -o model.nimble, then give model.nimble")
            raise ArtifactError(f"{name} has no {MANIFEST}; it is not a .nimble artifact")
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED or info.file_size > size:
                raise ArtifactError(f"{name}: member {info.filename} is compressed or larger than the file")
        manifest = checks.load_json(z, MANIFEST, name)
        checks.check_manifest(manifest, name)
        expected = [*MEMBERS, *batch_members(manifest.get("batch_sizes", []))]
        extra = sorted(set(names) - set(expected))
        missing = [m for m in expected if m not in names]
        if missing or extra:
            raise ArtifactError(f"{name}: member {(missing or extra)[0]} is {'missing' if missing else 'unexpected'}")
        data = {}
        with open(path, "rb") as raw:
            for member in expected[1:]:
                want = manifest["members"][member]
                if member.endswith(".json"):
                    checks.check_json_size(z, member, name)
                if z.getinfo(member).file_size != want["size"]:
                    raise ArtifactError(f"{name}: {member} is {z.getinfo(member).file_size} bytes, "
                                        f"the manifest says {want['size']}")
                data[member] = checks.read_member(raw, z.getinfo(member), size, want["sha256"], name)
    try:  # the decoders name the field; the message gets the file's name too
        graph = codec.decode_graph(checks.parse_json(data[GRAPH], GRAPH, name))
        schedule = codec.decode_schedule(checks.parse_json(data[SCHEDULE], SCHEDULE, name), len(graph.ops))
        memory = codec.decode_memory(checks.parse_json(data[MEMORY], MEMORY, name), len(graph.values))
    except ArtifactError as e:
        if str(e).startswith(f"{name}:"):
            raise
        raise ArtifactError(f"{name}: {e}") from None
    checks.check_ops(graph, name)
    try:
        check_plan(graph, schedule, memory)
    except ValueError as e:
        raise ArtifactError(f"{name}: unsafe plan: {e}") from None
    _check_io(manifest, graph, name)
    batches = _read_batches(manifest, data, graph, name)

    def spec(v):
        return v.spec.dtype, v.spec.shape

    weights = tensors.load(data[WEIGHTS], WEIGHTS, {v.name: spec(v) for v in graph.values if v.kind == WEIGHT})
    sample_in = tensors.load(data[SAMPLE_INPUTS], SAMPLE_INPUTS, {
        SAMPLE_INPUT_KEY.format(i): spec(graph.values[v]) for i, v in enumerate(graph.inputs)})
    sample_out = tensors.load(data[SAMPLE_OUTPUTS], SAMPLE_OUTPUTS, {
        SAMPLE_OUTPUT_KEY.format(i): spec(graph.values[v]) for i, v in enumerate(graph.outputs)})
    return Artifact(manifest, graph, schedule, memory, weights,
                    [sample_in[SAMPLE_INPUT_KEY.format(i)] for i in range(len(graph.inputs))],
                    [sample_out[SAMPLE_OUTPUT_KEY.format(i)] for i in range(len(graph.outputs))], batches)


def _read_batches(manifest: dict, data: dict, top: Graph, name: str) -> dict:
    """The plans of the batch sizes after the first, each checked as the top one is, and against
    it: the same weights, the same inputs and outputs but for their first dimension."""
    sizes = manifest.get("batch_sizes", [])
    if sizes and [top.values[i].spec.shape[:1] for i in top.inputs][:1] != [(sizes[0],)]:
        raise ArtifactError(f"{name}: the first batch size in the manifest, {sizes[0]}, is not the graph's")
    weights = sorted((v.name, v.spec) for v in top.values if v.kind == WEIGHT)
    batches = {}
    for b in sizes[1:]:
        where = f"{name}: batch {b}"
        try:
            graph = codec.decode_graph(checks.parse_json(data[BATCH_MEMBER.format(b, GRAPH)], GRAPH, where))
            schedule = codec.decode_schedule(checks.parse_json(data[BATCH_MEMBER.format(b, SCHEDULE)], SCHEDULE, where),
                                             len(graph.ops))
            memory = codec.decode_memory(checks.parse_json(data[BATCH_MEMBER.format(b, MEMORY)], MEMORY, where),
                                         len(graph.values))
        except ArtifactError as e:
            raise ArtifactError(e.args[0] if str(e).startswith(where) else f"{where}: {e}") from None
        checks.check_ops(graph, where)
        try:
            check_plan(graph, schedule, memory)
        except ValueError as e:
            raise ArtifactError(f"{where}: unsafe plan: {e}") from None
        if sorted((v.name, v.spec) for v in graph.values if v.kind == WEIGHT) != weights:
            raise ArtifactError(f"{where} reads other weights than batch {sizes[0]}")
        for key in ("inputs", "outputs"):
            mine, theirs = getattr(graph, key), getattr(top, key)
            same = len(mine) == len(theirs) and all(
                graph.values[a].name == top.values[t].name and graph.values[a].spec.dtype == top.values[t].spec.dtype
                and graph.values[a].spec.shape == (b, *top.values[t].spec.shape[1:])
                for a, t in zip(mine, theirs))
            if not same:
                raise ArtifactError(f"{where}: its {key} are not those of batch {sizes[0]} with a first dimension "
                                    f"of {b}")
        batches[b] = (graph, schedule, memory)
    if batches:  # one program at every batch size, each row computed from that row alone
        try:
            check_batches({sizes[0]: top, **{b: graph for b, (graph, _, _) in batches.items()}})
        except RowsError as e:
            raise ArtifactError(f"{name}: {e}") from None
    return batches


def _check_io(manifest: dict, graph: Graph, name: str) -> None:
    for key, ids in (("inputs", graph.inputs), ("outputs", graph.outputs)):
        declared = manifest[key]
        actual = _io_specs(graph, ids)
        if declared != actual:
            raise ArtifactError(f"{name}: manifest {key} do not match the graph")

