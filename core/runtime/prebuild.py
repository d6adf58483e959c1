"""Every generated kernel a load will launch, found and built before the load runs an op: ahead
of time on a machine with no GPU (`nimble compile --gpu-arch`, into a kernel pack), or at the
start of a load, in parallel, where neither the cache folder nor a trusted pack has them.

`walk` finds them. It does what a load does for each of its tuning candidates (`tune/`): makes
the candidate's kernels afresh (`assemble/lower.py`), its issue order and pairs, and issues every
op, but over claimed tensors (`base/claimed.py`: CUDA tensors that hold only their shapes, at
the addresses a load's allocations would have). Generated kernels note their launches instead of
launching; a choice made by measurement tries every candidate (a tie), and keeps nothing; an op
that cannot run on shapes alone (a cuDNN plan) is passed over. Candidates that differ only in
what launches no generated kernel (cuDNN's algorithms) are walked once; candidates on other
streams are walked too where their streams pair other ops (`pairs/` finds pairs per issue order
and stream: two ops on different streams never pair).

A launch the walk misses is not an error: the load builds it when it first runs, as it always
did. A launch the walk finds that the load never makes costs a build, nothing more.

`ahead` builds the walk's launches for named architectures into a pack (`kernels/pack.py`);
`before_load` takes each launch from the cache folder, else from a trusted pack, else builds it,
all builds at once on the machine's cores, and says so on stderr. A trusted pack that covers the
load (walked from this artifact's plan, for this GPU's multiprocessors, with this torch:
`Pack.covers`) spares the walk: each kernel is taken from it as it first launches
(`binaries.trust`). The walk was most of such a load (densenet121 on the H200: 5.4 of 13.5 s, with
torch's import of its distributed tensors on the first dispatch to a claimed tensor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import first_line
from ..ir import WEIGHT
from ..ops import shapes, types
from ..ops.execute import run_ops
from ..plan import capped
from .assemble import lower
from .assemble.choice import channels_last_values, conv_weights
from .assemble.order import issue_order
from .base import claimed as claims
from .base.claimed import claimed
from .base.settings import current
from .kernels import aot, binaries, cudnn_graph, gemm
from .kernels import pack as packs
from .pairs.run import PairedRun
from .placed.placement import PlacedOp, arena_views, prepare
from .tune import choices as tuning


@dataclass
class Prebuilt:
    """What `before_load` found for a load's kernels."""

    found: int = 0  # distinct launches the walk found
    cached: int = 0  # of which the cache folder held a binary
    from_pack: int = 0  # taken from a trusted pack
    built: int = 0  # built here, in parallel
    failed: list[str] = field(default_factory=list)  # launches that did not build (built, or fallen back, at load)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # one line each: a pack not used, a binary refused
    # seconds of each part: the walk, taking binaries from the cache folder and the pack (checked,
    # kept, loaded), and the builds (with their records kept)
    stages: dict[str, float] = field(default_factory=lambda: {"walk": 0.0, "take": 0.0, "build": 0.0})
    walked: bool = True  # False where a pack covered the load: `found` is then the pack's kernels
    pack: packs.Pack | None = field(default=None, repr=False)  # that pack, taken from as kernels launch
    _taken: int = 0  # what the pack had given before this load
    _refused: int = 0

    def cover(self, pack: packs.Pack) -> None:
        """Say that `pack` (trusted for the process) stands in for this load's walk."""
        self.found, self.walked, self.pack = len(pack), False, pack
        self._taken, self._refused = pack.taken, len(pack.refused)
        self.notes += pack.notes

    def settle(self) -> list[str]:
        """Once the load has run: what an unwalked load took from its pack (`from_pack`), and the
        lines for binaries it refused meanwhile (also in `notes`)."""
        if self.pack is None:
            return []
        self.from_pack = self.pack.taken - self._taken
        new = self.pack.refused[self._refused:]
        self._taken, self._refused = self.pack.taken, len(self.pack.refused)
        self.notes += new
        return new

    def document(self) -> dict:
        """What `run --json` and `bench --json` report of it."""
        return {"found": self.found, "cached": self.cached, "from_pack": self.from_pack, "built": self.built,
                "failed": self.failed, "seconds": round(self.seconds, 4), "notes": self.notes, "walked": self.walked,
                "stages": {k: round(v, 4) for k, v in self.stages.items()}}


class _Walk(PairedRun):
    """One issue of the op list over claimed tensors: an op that cannot run on shapes alone is
    passed over, its planned buffers (or claimed tensors of its declared shapes) its results."""

    def __init__(self, graph, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.graph, self.passed = graph, []

    def call(self, p, args, kwargs):
        try:
            return super().call(p, args, kwargs)
        except Exception as e:
            self.passed.append(f"op {p.op.id} ({p.op.target}): {first_line(e)}")
            return [self.views[o] if o in self.views else _declared(self.graph, o) for o in p.op.outputs]


def _declared(graph, vid: int):
    spec = graph.values[vid].spec
    return claimed(spec.shape, types.DTYPES[spec.dtype])


class _Properties:
    def __init__(self, target: aot.Target):
        self.major, self.minor = target.capability
        self.multi_processor_count, self.name = target.multiprocessors, target.name


class _Stream:
    cuda_stream, device_index = 0, 0


@contextlib.contextmanager
def _as_target(target: aot.Target, device: torch.device):
    """torch.cuda answers as a GPU of `target` would, where this machine has none, or another."""
    local = torch.cuda.is_available() and torch.cuda.get_device_capability(device) == target.capability \
        and torch.cuda.get_device_properties(device).multi_processor_count == target.multiprocessors
    answers = {"is_current_stream_capturing": lambda: False}  # nothing is captured in a walk, on any machine
    if not local:
        answers.update(get_device_properties=lambda d=None: _Properties(target),
                       get_device_capability=lambda d=None: target.capability, current_stream=lambda d=None: _Stream())
    real = {name: getattr(torch.cuda, name) for name in answers}
    try:
        for name, answer in answers.items():  # answered so for the walking thread only; any other asks CUDA
            setattr(torch.cuda, name, _for_walk(answer, real[name]))
        yield
    finally:
        for name, function in real.items():
            setattr(torch.cuda, name, function)


def _for_walk(answer, real):
    def asked(*args, **kwargs):
        return answer(*args, **kwargs) if claims.walking() else real(*args, **kwargs)
    return asked


def walk(artifact, target: aot.Target, device: torch.device | None = None, only=None) -> dict[tuple, tuple]:
    """(source digest, call signature) -> (kernel, args, constants): every generated kernel launch
    a load of `artifact` on a GPU of `target` (`device`) could make, each once; under the one
    choice `only` where given (a load whose choice is forced)."""
    device = device or torch.device("cuda", 0)
    graph, schedule, memory = artifact.graph, artifact.schedule, artifact.memory
    seen: list = []
    # The meta kernels of ops without a quick claimed result (swin_t's layer norms: torch._refs)
    # would import torch._dynamo on their first call (1.8 s of swin_t's 4.4 s walk on the CPU
    # builder). torch's own first dispatch to a claimed tensor imports its distributed tensors,
    # which cannot import beside the stand-in, so they are imported first.
    if torch.distributed.is_available():
        importlib.import_module("torch.distributed.tensor")
    with claims.walk(seen, device), _as_target(target, device), shapes.without_dynamo_import():
        prepared = prepare(graph)
        weights = {v.id: claimed(v.spec.shape, types.DTYPES[v.spec.dtype]) for v in graph.values if v.kind == WEIGHT}
        for k in gemm.k_major_weights(graph):  # stored transposed, as `assemble/buffers.allocate` stores them
            rows, cols = weights[k].shape
            weights[k] = claims.Claimed(torch.empty_strided((rows, cols), (1, rows), dtype=weights[k].dtype,
                                                            device="meta"))
        convs_last = {k: claimed(weights[k].shape, weights[k].dtype, torch.channels_last) for k in conv_weights(graph)}
        inputs = [_declared(graph, i) for i in graph.inputs]
        arena = claimed((max(memory.arena_bytes, 1),), torch.uint8)
        options = [only] if only is not None else \
            tuning.candidates(graph, max(capped.streams_under(schedule, None), default=0) + 1, True)
        walked, fresh = set(), {}
        for choice in options:
            kernels = (choice.layout, choice.convolutions, choice.gemm_bias, choice.prologues)
            placed = fresh.pop(kernels, None) or lower.lower(prepared, choice, cudnn_graph.Workspaces())
            order = issue_order(graph, schedule, memory, placed, choice, single_stream=False, paired=True,
                                settings=current())
            if (kernels, _pairing(order.pairs)) in walked:  # the streams change only which ops pair
                fresh[kernels] = placed  # (unpaired yet: the next candidate of these kernels takes it)
                continue
            walked.add((kernels, _pairing(order.pairs)))
            channels_last = choice.layout == "channels_last"
            views = arena_views(graph, memory, arena, channels_last_values(graph, by_use=True) if channels_last else ())
            env = {**weights, **(convs_last if channels_last else {}), **dict(zip(graph.inputs, inputs))}
            lower.pair(placed, order.pairs, choice)
            run = _Walk(graph, env, views, device, name_failures=True, release=None, kept=frozenset(),
                        pairs=order.pairs)
            run_ops(placed, run, order.order)
    found: dict[tuple, tuple] = {}
    for kernel, args, constants in seen:
        signature = binaries.specialisation(args, constants)
        if "?" not in signature:
            found.setdefault((kernel.digest, signature), (kernel, args, constants))
    return found


def _pairing(found) -> tuple:
    """What of an issue order's pairs (`pairs.Pairs`) decides the kernels a walk generates: each
    kind's pairs, as the ids of the ops they join."""
    def ident(v):
        if isinstance(v, PlacedOp):
            return v.op.id
        if isinstance(v, (list, tuple)):
            return tuple(ident(x) for x in v)
        return v if isinstance(v, (bool, int, type(None))) else type(v).__name__
    return tuple((f.name, tuple(sorted((k, ident(v)) for k, v in getattr(found, f.name).items())))
                 for f in dataclasses.fields(found))


def ahead(artifact, targets: list[aot.Target], out: Path, key: bytes | None = None, threads: int | None = None,
          say=None) -> list[tuple[aot.Target, Path, int, list[str]]]:
    """Build the kernels of `artifact` (each of its batch sizes) for each of `targets` into a pack:
    `out` for one target, else `out` with the architecture after it. Signed with `key` where
    given; `say(line)` hears progress. Returns (target, path, kernels, failures) per target."""
    from nimble.formats import plan_digest  # formats sits beside the runtime

    plans = [artifact.for_batch(b) for b in artifact.batch_sizes] if artifact.batches else [artifact]
    walked = {"plan": plan_digest(artifact)}
    written = []
    for target in targets:
        found: dict[tuple, tuple] = {}
        for plan in plans:
            for name, launch in walk(plan, target).items():
                found.setdefault(name, launch)
        if say:
            say(f"building {len(found)} kernels for {target.name} on {threads or aot.workers()} cores...")
        built, failed, _ = aot.build_described(list(found.values()), target.arch, threads or aot.workers())
        entries = []
        for (kernel, args, constants), described in built:
            if described is None:
                failed.append(f"kernel k{kernel.digest}: not one the static launcher runs")
                continue
            record, binary = described
            entries.append(packs.Entry(kernel.digest, binaries.specialisation(args, constants), record, binary))
        path = out if len(targets) == 1 else out.with_name(f"{out.name}.{target.name}")
        packs.write(path, target.arch, entries, key, {**walked, "multiprocessors": target.multiprocessors})
        written.append((target, path, len(entries), failed))
    return written


def local_target(device: torch.device) -> aot.Target:
    props = torch.cuda.get_device_properties(device)
    return aot.Target(props.major * 10 + props.minor, props.multi_processor_count)


def before_load(artifact, device: torch.device, pack: packs.Pack | None, only=None, threads: int | None = None,
                quiet: bool = False) -> Prebuilt:
    """Have every kernel a load of `artifact` on `device` will launch ready before it runs: each
    from the cache folder, else from `pack`, else built now, all at once (see the module
    docstring), under the one choice `only` where given. Says on stderr how many it builds,
    unless `quiet`."""
    t = time.perf_counter()
    stats = Prebuilt()
    if not binaries.enabled(device):
        return stats
    try:
        _prebuild(stats, artifact, device, pack, only, threads, quiet)
    except Exception as e:  # never a reason to fail a load: each kernel then builds as it first runs
        stats.notes.append(f"kernels not readied ahead of the load ({type(e).__name__}: {first_line(e)}); each builds "
                           "as it first runs")
    stats.seconds = time.perf_counter() - t
    return stats


def _prebuild(stats: Prebuilt, artifact, device: torch.device, pack, only, threads, quiet) -> None:
    device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    target = local_target(device)
    if pack is not None and _covered(stats, artifact, pack, target):
        return
    threads = threads or aot.workers()
    builders = aot.start_builders(threads) if current().early_builders else None  # ready when the walk ends
    try:
        _walk_and_build(stats, artifact, device, target, pack, only, threads, quiet, builders)
    finally:
        if builders is not None:
            builders.close()


def _walk_and_build(stats: Prebuilt, artifact, device: torch.device, target, pack, only, threads: int, quiet: bool,
                    builders) -> None:
    t = time.perf_counter()
    found = walk(artifact, target, device, only)
    stats.found = len(found)
    stats.stages["walk"] = time.perf_counter() - t
    t = time.perf_counter()
    missing = []
    for (source, signature), (kernel, args, constants) in found.items():
        if binaries.recall(source, signature, args, constants) is not None:
            stats.cached += 1
        elif pack is not None and pack.take(source, signature, args, constants, device) is not None:
            stats.from_pack += 1
        else:
            missing.append((kernel, args, constants))
    stats.stages["take"] = time.perf_counter() - t
    t = time.perf_counter()
    if pack is not None:
        stats.notes += pack.notes + pack.refused
        if missing:
            stats.notes.append(f"{pack.path}: {stats.from_pack} of {stats.found} kernels taken from it; the {len(missing)} "
                               "it lacks build here")
    if missing:
        if not quiet:
            print(f"nimble: building {len(missing)} kernels on {threads} cores...", file=sys.stderr, flush=True)
        major, minor = torch.cuda.get_device_capability(device)
        built, stats.failed, _ = aot.build_described(missing, major * 10 + minor, threads, builders=builders)
        for (kernel, args, constants), described in built:
            if described is not None and binaries.install(kernel.digest, binaries.specialisation(args, constants),
                                                          *described, device) is not None:
                stats.built += 1
        if stats.failed:
            stats.notes.append(f"{len(stats.failed)} kernels did not build ahead of the load (the first: "
                               f"{stats.failed[0]}); each builds as it first runs")
    stats.stages["build"] = time.perf_counter() - t


def _covered(stats: Prebuilt, artifact, pack: packs.Pack, target: aot.Target) -> bool:
    """Where `pack` covers this load (`Pack.covers`): trust it for the kernels' first launches
    instead of walking, and say so in `stats`."""
    from nimble.formats import plan_digest  # formats sits beside the runtime

    if not pack.covers(plan_digest(artifact), target.multiprocessors):
        return False
    stats.cover(binaries.trust(pack))
    return True


def after_load(stats: Prebuilt | None) -> None:
    """Once a load has run: settle what it took from a pack it did not walk (`Prebuilt.settle`),
    each binary refused said on stderr in one line."""
    if stats is not None:
        for line in stats.settle():
            print(f"nimble: {line}", file=sys.stderr)


def for_load(artifact, device: torch.device, only, kernels: str | None, beside: str | None) -> Prebuilt:
    """`before_load` with the pack this load may use: the one named (`kernels`), else, where a key
    is configured, the one beside the artifact (`beside`, its path). A pack it may not use, and
    each binary refused, is said on stderr in one line."""
    pack = None
    try:
        key = packs.configured_key()
        found = None if beside is None else f"{beside}{packs.SUFFIX}"
        path = kernels or (found if key is not None and found and os.path.exists(found) else None)
        if path is not None:
            pack = packs.Pack.open(path, local_target(device).arch, key, named=kernels is not None)
    except packs.PackMiss as e:
        print(f"nimble: {e}", file=sys.stderr)
    done = before_load(artifact, device, pack, only)
    for note in done.notes:
        print(f"nimble: {note}", file=sys.stderr)
    return done
