"""Load-time choices, made by timing them on this GPU, and the cache that keeps them.

An artifact fixes what is computed and where every activation lives. How it runs on one GPU is
left to load time, where `Executable` times the candidates that `candidates` lists and keeps the
fastest:

- layout: 4-D activations contiguous (NCHW), or channels_last (NHWC) with the convolution
  weights to match. Only the strides of buffers change: a channels_last tensor spans exactly the
  bytes of its planned buffer. Buffers that a view shares keep the strides the artifact declares.
  One layout for the whole model: a per-op choice could save at most 0 to 2.2 % of kernel time on
  the conv nets before paying a single conversion (H200, batch 8, `benchmarks/layout_bound.py`);
- streams: the artifact's schedule as planned (its streams folded onto as few CUDA streams as
  keep them parallel), the candidate on at most `CAP` CUDA streams that the artifact stores with
  it (`plan/capped.py`), or every op on one stream in the schedule's issue order. All three are
  safe under the one memory plan the artifact stores: sharing a stream only adds ordering to what
  the plan already proved safe, and reading the artifact proved the plan on the stored candidate. Fewer
  streams compete less for a busy GPU, and hold fewer per-stream workspaces and pool segments;
- convolution algorithms: cuDNN's heuristic choice, or the fastest of its algorithms timed per
  convolution during the warm-up (what `torch.backends.cudnn.benchmark` does);
- convolution fusion: conv-led bodies as one cuDNN kernel each (a cuDNN graph where
  `cudnn_graph` chose one for that convolution, by timing it against nimble's own way; else
  PyTorch's fused kernels for conv -> relu and conv -> add -> relu), or split into cuDNN's plain
  convolution and a generated epilogue kernel. Neither wins everywhere;
- GEMM bias: a float32 addmm or linear with its bias in cuBLASLt's epilogue, or the GEMM alone
  then an in-place add (`placement.BiasedGemm`). The second wins with few rows, the first with
  many (`benchmarks/gemm_bias.py`);
- depthwise prologues (channels_last only, where `pairs.prologue_pairs` finds a pair): a
  convolution's epilogue run in its own kernel, or applied by the depthwise convolution that
  reads its result, as it loads each tap. The second saves a kernel and a pass of the map
  through memory, but applies the epilogue nine times per element: on the H200 it made
  mobilenet_v2 3.2 % faster at batch 8 and 3.2 % slower at batch 1
  (`benchmarks/results/setting_ab_prologue_2026-11-27.md`).

Timing is greedy: every layout and algorithm setting on the planned streams with cuDNN's fused
convolutions, then the best of those split, then the best so far on at most `CAP` streams and on
one, then that with its GEMM biases separate, then that with depthwise prologues. Where cuDNN
graphs can run (the `cudnn` extra), the split candidate is not timed: each conv-led body has then
already been timed against its alternative, a graph against the split way or PyTorch's fused
kernel (`cudnn_graph`). On the H100, with graphs, split was 1.14 to 1.33 times the best
candidate's time on every peers row that had it (googlenet, inception_v3, resnet50,
squeezenet1_1, batch 1 and 8: `peers_final_*.json`), and timing it was half of inception_v3's
cold load (5 s: with benchmark algorithms, each plain convolution first runs cuDNN's search of
its algorithms). A forced choice can still split.

The best of a stage is the fastest, unless a candidate at most `memory_slack` (a setting) slower holds at
least `memory_worth` less in its graph pool (the workspaces and temporaries of its capture): then
the one that holds least (`pick`).

The choice is kept in `tuning.json` in nimble's cache folder, keyed by the artifact's hash, the
GPU and the torch version, like TensorRT's timing cache. `--tune off` takes the defaults without
timing, `cached` (the default) times only on a cache miss, and `full` always times and rewrites
the entry.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace

import torch

from ...ir import ACTIVATION, WEIGHT, Graph, Ref, refs_of
from ...ops import fusion
from ...plan.capped import CAPS
from ..base import cache
from ..placed.placement import BiasedGemm, small_product
from ..base.settings import DEFAULT, Settings

LAYOUTS = ("contiguous", "channels_last")
CAP = CAPS[0]  # the CUDA streams of the capped stream candidate, which the artifact stores
STREAMS = ("planned", f"at most {CAP}", "serial")
ALGORITHMS = ("heuristic", "benchmark")
CONVOLUTIONS = ("cudnn-fused", "split")
GEMM_BIAS = ("epilogue", "separate")
PROLOGUES = ("apart", "in depthwise")


@dataclass(frozen=True)
class Choice:
    layout: str = "contiguous"
    streams: str = "planned"
    algorithms: str = "heuristic"
    convolutions: str = "cudnn-fused"
    gemm_bias: str = "epilogue"
    prologues: str = "apart"

    def describe(self) -> str:
        """The four first settings; the GEMM bias and the prologues only where not the default."""
        separate = ", separate GEMM bias" if self.gemm_bias == "separate" else ""
        prologues = ", depthwise prologues" if self.prologues == PROLOGUES[1] else ""
        return (f"{self.layout}, {self.streams} streams, {self.algorithms} algorithms, {self.convolutions}"
                f"{separate}{prologues}")


def stream_cap(streams: str) -> int | None:
    """The most CUDA streams a `Choice.streams` setting allows (None: as many as planned)."""
    return {"planned": None, "serial": 1}.get(streams, CAP)


def candidates(graph: Graph, num_streams: int, prologues: bool = False) -> list[Choice]:
    """Every choice worth considering for this graph: layouts and algorithms only where a 4-D
    convolution exists, split convolutions only where cuDNN's fused ones could run, a stream cap
    only below `num_streams` (the CUDA streams the planned ones fold onto), a separate GEMM bias
    only where a float32 GEMM has one, depthwise prologues only with `prologues` (the executable
    found prologue pairs) and channels_last."""
    convs = bool(conv_weights(graph))
    layouts, algorithms = (LAYOUTS, ALGORITHMS) if convs else (LAYOUTS[:1], ALGORITHMS[:1])
    streams = [s for s in STREAMS if stream_cap(s) is None or stream_cap(s) < num_streams]
    fused = any(op.target == fusion.FUSED and fusion.convolution_pattern(fusion.body_of(op)) for op in graph.ops)
    kinds = CONVOLUTIONS if fused else CONVOLUTIONS[:1]
    biases = GEMM_BIAS if any(BiasedGemm.applies(graph, op) and not small_product(graph, op) for op in graph.ops) \
        else GEMM_BIAS[:1]  # a small linear runs as a generated kernel (`pooled_conv.SmallLinear`) either way
    return [Choice(layout, s, a, k, b, p) for layout in layouts for s in streams for a in algorithms for k in kinds
            for b in biases for p in PROLOGUES if p == PROLOGUES[0] or (prologues and layout == "channels_last")]


def every_choice() -> list[Choice]:
    return [Choice(layout, s, a, k, b, p) for layout in LAYOUTS for s in STREAMS for a in ALGORITHMS
            for k in CONVOLUTIONS for b in GEMM_BIAS for p in PROLOGUES]


def choice_of(fields: str) -> Choice | None:
    """The load-time choice that comma-separated `fields` name, Choice's fields in order (the later
    ones may be left out: their defaults), or None where they name none."""
    try:
        choice = Choice(*fields.split(","))
    except TypeError:  # too many fields
        return None
    return choice if choice in every_choice() else None


def stages(options: list[Choice], graphs: bool = False):
    """The greedy order of timing: a list of candidates, then functions from the best so far to
    the next candidates. With `graphs` (cuDNN graphs can run: `cudnn_graph.frontend()`), split
    convolutions are not timed (see the module docstring)."""
    yield [c for c in options if c.streams == "planned" and c.convolutions == CONVOLUTIONS[0]
           and c.gemm_bias == GEMM_BIAS[0] and c.prologues == PROLOGUES[0]]
    yield lambda best: [] if graphs else [c for c in options if c == replace(best, convolutions="split")]
    yield lambda best: [c for c in options if c in [replace(best, streams=s) for s in STREAMS[1:]]]
    yield lambda best: [c for c in options if c == replace(best, gemm_bias="separate")]
    yield lambda best: [c for c in options if c == replace(best, prologues=PROLOGUES[1])]




def pick(options: list[Choice], ms: dict[str, float], held: dict[str, int], settings: Settings = DEFAULT) -> Choice:
    """The best of timed `options`: the fastest by `ms` (GPU-bound ms by `describe()`), or, among
    those within the `memory_slack` setting of it whose graph pool (`held`, bytes) is at least `memory_worth`
    smaller than the fastest's, the one that holds least (the faster of equals)."""
    fastest = min(options, key=lambda c: ms[c.describe()])
    limit_ms = ms[fastest.describe()] * (1 + settings.memory_slack)
    limit_bytes = held.get(fastest.describe(), 0) - settings.memory_worth
    leaner = [c for c in options if ms[c.describe()] <= limit_ms and held.get(c.describe(), 0) <= limit_bytes]
    return min(leaner, key=lambda c: (held.get(c.describe(), 0), ms[c.describe()])) if leaner else fastest


def conv_weights(graph: Graph) -> set[int]:
    """4-D weights that only convolutions read, as their weight operand."""
    as_weight, elsewhere = set(), set()
    for op in graph.ops:
        nodes = fusion.body_of(op) if op.target == fusion.FUSED else ((op.target, op.args, op.kwargs),)
        for target, args, kwargs in nodes:
            params = fusion.conv_params(target, args) if target in fusion.CONVOLUTIONS else None
            w = params["weight"] if params else None
            for r in refs_of((args, tuple(v for _, v in kwargs))):
                if graph.values[r].kind == WEIGHT:
                    (as_weight if w == Ref(r) and len(graph.values[r].spec.shape) == 4 else elsewhere).add(r)
    return as_weight - elsewhere


def channels_last_values(graph: Graph) -> set[int]:
    """Planned 4-D buffers that no view shares and that the artifact declares contiguous (its
    strides given as contiguous ones, or left out): the ones channels_last re-strides."""
    shared = {v.alias_of for v in graph.values if v.alias_of is not None}
    return {v.id for v in graph.values if v.kind == ACTIVATION and v.alias_of is None and v.id not in shared
            and len(v.spec.shape) == 4 and not v.spec.offset
            and v.spec.is_contiguous}


# ---------------------------------------------------------------------------------- cache
def cache_key(artifact, device: torch.device, settings: Settings = DEFAULT) -> str:
    """The artifact's content hash, the GPU, the torch version and the settings (where not the defaults)."""
    members = artifact.manifest.get("members") or {}
    if members:
        digest = hashlib.sha256(json.dumps(members, sort_keys=True).encode()).hexdigest()
    else:  # an artifact built in memory (nimble.Nimble): hash what it runs
        from nimble.formats import codec

        h = hashlib.sha256()
        for doc in (codec.encode_graph(artifact.graph), codec.encode_schedule(artifact.schedule),
                    codec.encode_memory(artifact.memory)):
            h.update(json.dumps(doc, sort_keys=True).encode())
        digest = h.hexdigest()
    props = torch.cuda.get_device_properties(device)
    where = f"{digest[:32]}|{props.name}|sm{props.major}{props.minor}|torch {torch.__version__}"
    return where + (f"|settings {settings.digest()}" if settings.digest() else "")


MAX_TUNING_BYTES = 2**20


def cache_path():
    folder = cache.cache_dir()
    return None if folder is None else folder / "tuning.json"


def cached(key: str) -> Choice | None:
    """The choice stored for `key`, or None (no entry, or a cache that cannot be read or trusted)."""
    try:
        entry = cache.read_table(cache_path(), MAX_TUNING_BYTES).get(key)
        choice = Choice(**entry["choice"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    return choice if choice in every_choice() else None


def store(key: str, choice: Choice, timings: dict[str, float]) -> None:
    """Record `choice` for `key`; a cache that cannot be written is skipped silently. The older
    half of the entries goes whenever the table would pass MAX_TUNING_BYTES."""
    cache.write_entry(cache_path(), key, {"choice": asdict(choice), "gpu_ms": timings}, MAX_TUNING_BYTES)
