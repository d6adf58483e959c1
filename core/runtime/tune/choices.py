"""Load-time choices, made by timing them on this GPU, and the cache that keeps them.

An artifact fixes what is computed and where every activation lives. How it runs on one GPU is
left to load time, where `Executable` times the candidates that `candidates` lists and keeps the
fastest:

- layout: 4-D activations contiguous (NCHW), or channels_last (NHWC) with the convolution
  weights to match. Only the strides of buffers change: a channels_last tensor spans exactly the
  bytes of its planned buffer. Buffers that a view other than a permute shares keep the strides
  the artifact declares, and so do the (N, H, W, C) maps a linear or layer norm reads along its
  last dim (`assemble/choice.channels_last_values`, `by_use`).
  One layout for the whole model: a per-op choice could save at most 0 to 2.2 % of kernel time on
  the conv nets before paying a single conversion (H200, batch 8, `tools/layout_bound.py`);
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
  then an in-place add (`placed/substitutes.BiasedGemm`). The second wins with few rows, the first with
  many (`benchmarks/results/gemm_bias.md`);
- depthwise prologues (channels_last only, where `pairs.prologue_pairs` finds a pair): a
  convolution's epilogue run in its own kernel, or applied by the depthwise convolution that
  reads its result, as it loads each tap. The second saves a kernel and a pass of the map
  through memory, but applies the epilogue nine times per element: on the H200 it made
  mobilenet_v2 3.2 % faster at batch 8 and 3.2 % slower at batch 1
  (`benchmarks/results/setting_ab_prologue_2026-11-27.md`).

Timing is greedy: every layout on the planned streams with cuDNN's fused convolutions and
heuristic algorithms (with cuDNN graphs: channels_last first, then contiguous without cuDNN's
plan search, and with it only where it came close: `search.py`), then the best of those with
benchmarked algorithms, then that split, then the best so far on at most `CAP` streams and on
one, then that with its GEMM biases separate, then that with depthwise prologues. Where cuDNN graphs can run (the `cudnn` extra), the split
candidate is not timed: each conv-led body has then already been timed against its
alternative, a graph against the split way or PyTorch's fused kernel (`cudnn_graph`). On the H100, with graphs, split was 1.14 to 1.33 times the best
candidate's time on every peers row that had it (googlenet, inception_v3, resnet50,
squeezenet1_1, batch 1 and 8: `peers_final_*.json`), and timing it was half of inception_v3's
cold load (5 s: with benchmark algorithms, each plain convolution first runs cuDNN's search of
its algorithms). A forced choice can still split.

The best of a stage is the fastest, unless a candidate at most `memory_slack` (a setting) slower holds at
least `memory_worth` less in its graph pool (the workspaces and temporaries of its capture): then
the one that holds least (`pick`). Benchmarked algorithms count as fastest only where they take at
most `benchmark_slower` (a setting, 0.98) times the time of the best other candidate. Every other
choice costs nothing once it is cached, but torch keeps no record of cuDNN's search across
processes: each process that loads searches every convolution's algorithms again (on the H200,
resnet50's warm load took 2.6 s with them and 1.2 s without, efficientnet_b0's 5.2 and 3.6 s:
`benchmarks/results/cold_start_2026-11-29.md`). On the peers suite they gained 0 to 0.9 %
(`peers_final_*.json`, H100), within the timing's noise.

The choice is kept in `tuning.json` in nimble's cache folder, keyed by the artifact's hash, the
GPU, the torch version and the search's version, like TensorRT's timing cache. `--tune off`
takes the defaults without timing, `cached` (the default) times only on a cache miss, and `full`
always times and rewrites the entry.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, replace

import torch

from ...ir import Graph
from ...ops import fusion
from ..base import cache
from ..base.settings import DEFAULT, Settings
# the choice's settings and values, named here too: `tuning.Choice`, `tuning.LAYOUTS` (assemble/choice.py)
from ..assemble.choice import (ALGORITHMS, CAP, CONVOLUTIONS, GEMM_BIAS, LAYOUTS, PROLOGUES, STREAMS,  # noqa: F401
                            Choice, channels_last_values, choice_of, conv_weights, every_choice, stream_cap)
from ..placed.substitutes import BiasedGemm, small_product


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


def stages(options: list[Choice], graphs: bool = False):
    """The greedy order of timing: a list of candidates, then functions from the best so far to
    the next candidates. With `graphs` (cuDNN graphs can run: `cudnn_graph.frontend()`), split
    convolutions are not timed (see the module docstring)."""
    yield [c for c in options if c.streams == "planned" and c.algorithms == ALGORITHMS[0]
           and c.convolutions == CONVOLUTIONS[0] and c.gemm_bias == GEMM_BIAS[0] and c.prologues == PROLOGUES[0]]
    yield lambda best: [c for c in options if c == replace(best, algorithms=ALGORITHMS[1])]
    yield lambda best: [] if graphs else [c for c in options if c == replace(best, convolutions="split")]
    yield lambda best: [c for c in options if c in [replace(best, streams=s) for s in STREAMS[1:]]]
    yield lambda best: [c for c in options if c == replace(best, gemm_bias="separate")]
    yield lambda best: [c for c in options if c == replace(best, prologues=PROLOGUES[1])]




def pick(options: list[Choice], ms: dict[str, float], held: dict[str, int], settings: Settings = DEFAULT) -> Choice:
    """The best of timed `options`: the fastest by `ms` (GPU-bound ms by `describe()`), or, among
    those within the `memory_slack` setting of it whose graph pool (`held`, bytes) is at least `memory_worth`
    smaller than the fastest's, the one that holds least (the faster of equals). A candidate with
    benchmarked algorithms counts as taking its time over the `benchmark_slower` setting: the
    search it needs is paid again at every load."""
    def cost(c: Choice) -> float:
        if c.algorithms != ALGORITHMS[1]:
            return ms[c.describe()]
        return ms[c.describe()] / settings.benchmark_slower if settings.benchmark_slower > 0 else math.inf

    fastest = min(options, key=cost)
    limit_ms = cost(fastest) * (1 + settings.memory_slack)
    limit_bytes = held.get(fastest.describe(), 0) - settings.memory_worth
    leaner = [c for c in options if cost(c) <= limit_ms and held.get(c.describe(), 0) <= limit_bytes]
    return min(leaner, key=lambda c: (held.get(c.describe(), 0), cost(c))) if leaner else fastest


# ---------------------------------------------------------------------------------- cache
# the search's version, in every key: an entry from an older search is a miss (2: benchmark_slower;
# 3: channels_last by use, `assemble/choice.channels_last_values`; 4: wide depthwise filters on
# cuDNN where faster, `depthwise_conv.Wide`)
SEARCH = 4


def cache_key(artifact, device: torch.device, settings: Settings = DEFAULT) -> str:
    """The artifact's content hash, the GPU, the torch version, the search's version (`SEARCH`) and
    the settings (where not the defaults)."""
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
    where = f"{digest[:32]}|{props.name}|sm{props.major}{props.minor}|torch {torch.__version__}|search {SEARCH}"
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
