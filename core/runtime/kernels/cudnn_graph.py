"""A convolution and its epilogue as one cuDNN operation graph that writes the planned buffer.

Without it a fused op that leads with a convolution runs as one of two things. conv -> relu and
conv -> add -> relu run as PyTorch's fused cuDNN kernels, which allocate their result, so it
lies outside the arena (293 MiB of resnet50's footprint at batch 8). Any other body runs as two
kernels: cuDNN's convolution into the buffer, then a generated epilogue that reads it back.
cuDNN's graph API takes every tensor by pointer, the output too. Through the
`nvidia-cudnn-frontend` package (the `cudnn` extra), the convolution, its bias and a chain of
pointwise steps (`epilogue`: relu and its clipped forms, SiLU, sigmoid, tanh, GELU, and adding or
multiplying a tensor that broadcasts) become one operation graph. Its plans write the buffer
they are given.

The package is optional. Nimble's own way runs instead without it, on a body cuDNN has no plan
for, and where the best plan is slower than nimble's own way by more than the `cudnn_slower`
setting (`base/settings.py`).

A plan is chosen per convolution on the warm-up's tensors, never during a capture. The figures
are from the H100 with cuDNN 9.19; `benchmarks/results/cudnn_graph.md` has the measurements.
- cuDNN's heuristics rank up to about 40 plans, and the first is often not the fastest (up to
  300 times slower than the best), so the first `cudnn_plans` are each built, run, checked and timed.
  A plan whose checked run alone took more than `cudnn_too_slow_s` and `cudnn_too_slow` times the limit is
  not timed: timing runs it 41 more times, and some plans (for depthwise convolutions) take
  seconds each.
- Each result is checked against the reference, the result nimble computes without a graph.
  One of cuDNN's engines returned wrong values for some shapes on the H100, so a plan that
  disagrees is never used.
- Precompiled engines build in milliseconds. conv -> bias -> relu has them, and cuDNN ranks
  them for other chains where it has them. conv -> bias -> add -> relu has only engines compiled
  at run time with NVRTC, so for that chain alone the first `cudnn_compiled_plans` of those are tried.
  They take 0.3 to 1.7 s for the first of a kind in a process, and a kernel cache shared by the
  process reuses them across shapes. With them resnet50 at batch 8 ran 14 % faster and loaded as
  fast. They stay out of other chains: efficientnet_b0's SiLU and sigmoid chains took its load
  from 11 s to 23 s, and 41 of the plans tried there disagreed with the reference.
- Plans are timed inside a CUDA graph of ten calls, as they will run. Timed eagerly, the launch
  from Python outlasts a small convolution.
- Among the plans within `cudnn_slower` of the fastest, the one with the smallest workspace wins.
- Where nimble's own way is PyTorch's fused kernel (conv -> relu, conv -> add -> relu), its result
  lies outside the arena, in the captured graph's pool, and keeps a pool segment of 20 MiB or more
  reserved for as long as the graph lives (a result of 1 MiB or more gets one). There a plan may
  be up to `cudnn_slower_outside` slower: it writes the buffer the arena already holds for that result.
  At batch 8 in channels_last that takes in the first convolution of resnet50, googlenet and
  squeezenet1_1 (3 input channels: the plans are 10 to 20 % slower, 6 to 7 us, and the result is
  24 MiB), and leaves out resnet50's two slowest residual convolutions (1.55 and 1.95 times).
  Where that result is 1 MiB or more (`cudnn_large_block`) a plan may be `cudnn_slower_large_outside` slower:
  on the H200 squeezenet1_1's first convolution at batch 8 came out past 1.25 in one load of two,
  and its 24 MiB result then took the footprint from 50 to 104 MiB (2026-11-27).

A choice is kept for the process under the call's signature: shapes, strides, dtypes,
convolution parameters, steps and whether TF32 is allowed. With `torch.backends.cudnn.allow_tf32`
off, float32 graphs get no plan that uses TF32 tensor cores, as PyTorch's convolutions then do
not. The same convolution in another op, another tuning candidate
or another load is not timed again. It is also kept in `cudnn_plans.json` in the cache folder,
under that signature, the GPU and the cuDNN and torch versions: the plan's name, or none. A later
process builds only that plan and checks its result against the reference once. A plan the
cache names that cuDNN no longer ranks, or whose result disagrees, is timed again; the cache can
only pick among the plans nimble would try itself. An executable's graphs share one workspace per CUDA stream
(`Workspaces`; plans that need more than `cudnn_max_workspace` are skipped). It is made during the
warm-up, outside the captured graph's pool.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import time
import torch

from ...errors import first_line
from ..base import cache, regions
from .codegen import overlaps
from ..base.claimed import walking
from ..base.timing import graph_us as _gpu_us  # a plan timed as it will run: inside a CUDA graph
from ..base import settings
from . import cudnn_plans
from .cudnn_plans import RESIDUAL, Plan, epilogue, frontend  # noqa: F401  (RESIDUAL, epilogue: the kernels')

MAX_PLAN_TABLE_BYTES = 2**20  # cudnn_plans.json in the cache folder

_chosen: dict[tuple, Plan | None] = {}  # call signature -> the chosen plan, or None: nimble's own way
_provisional = contextvars.ContextVar("nimble_cudnn_provisional", default=False)
STATS = {"timed": 0, "chosen": 0, "recalled": 0, "rejected": 0, "too_slow": 0, "failed": []}  # convolutions timed, plans
# chosen, choices read from the cache folder, plans that disagreed with the reference, plans too
# slow to time, and why a convolution could not be timed (nimble's own way then runs)


class Workspaces:
    """The workspace of cuDNN graphs, one per CUDA stream: the ops on a stream run one after
    another, in the warm-up and in the captured graph, so they share it. It grows during the
    warm-up to the largest plan on its stream; `settle` then moves them all into one allocation of
    their own, which the capture finds at full size. The executables of one multi-batch artifact
    share one `Workspaces` and their CUDA streams (their graphs replay one at a time, as they share
    the arena), so a settled allocation stays while any of their graphs may use it. Its holders
    are the executables that use it: each drops it at `close`, and the last gives it back."""

    def __init__(self):
        self._by_stream: dict[int, torch.Tensor] = {}
        self._regions: list[dict[int, torch.Tensor]] = []  # every settled allocation: a graph may use any

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        stream = torch.cuda.current_stream(device).cuda_stream
        held = self._by_stream.get(stream)
        if held is None or held.numel() < nbytes:
            held = self._by_stream[stream] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        return held

    def nbytes(self) -> int:
        return sum(t.numel() for t in self._by_stream.values())

    def settle(self, device: torch.device) -> None:
        """After the warm-up, before the capture: the workspaces at their final sizes, packed into
        one allocation (`regions.pack`). Grown one by one, a workspace of 1 to 10 MiB sat in a 20
        MiB segment of the caching allocator, often beside the freed workspaces of the plans timed,
        and kept the rest of it reserved (up to 39 MiB of a conv net's footprint). Nothing happens
        where the warm-up found every workspace it needed settled already."""
        last = self._regions[-1] if self._regions else {}
        if all(last.get(stream) is t for stream, t in self._by_stream.items()):
            return
        sizes = {stream: t.numel() for stream, t in self._by_stream.items()}
        self._by_stream = {}
        torch.cuda.synchronize(device)  # the warm-up's kernels are done with the ones it grew
        torch.cuda.empty_cache()  # whole free segments go, so the packed one is a segment of its own
        self._regions.append(regions.pack({}, device, blank=sizes))
        self._by_stream = dict(self._regions[-1])


class ConvGraph:
    """One fused op's cuDNN plan. `operands` are x, w, bias (or None) and the tensors its
    epilogue reads. Its workspace is its stream's, which `workspaces` holds until the executable
    closes."""

    def __init__(self, plan: Plan, workspaces: Workspaces):
        self.plan, self.workspaces = plan, workspaces

    def __call__(self, operands: tuple, out: torch.Tensor) -> torch.Tensor:
        self.plan.run(operands, out, self.workspaces.get(self.plan.workspace_bytes, out.device))
        return out


def choose(p: dict, steps: tuple, operands: tuple, out: torch.Tensor, reference,
           workspaces: Workspaces, outside: bool = False) -> ConvGraph | None:
    """The fastest correct plan for the convolution `p` and its epilogue `steps` (`epilogue`),
    or None. `operands` are x, w, bias (or None) and the tensors the steps read; `reference()`
    computes the same result the way nimble would without cuDNN graphs, into a buffer of its own
    (None where it cannot); `outside`: nimble's own way leaves that buffer outside the arena (a
    plan may then be `cudnn_slower_outside` slower, `cudnn_slower_large_outside` for a large one). Plans are
    timed only outside a capture; the same call later gets the same choice."""
    if walking():  # a prebuild's walk: no plan, but the reference's kernels noted, as a load with the
        if not overlaps(out, operands):  # cuDNN frontend times plans against them (a builder may lack it)
            reference()
        return None
    if frontend() is None or overlaps(out, operands):
        return None
    key = (_signature(p, operands, out), steps, _tf32(out), settings.current().digest(),  # timed under these
           _limit(outside, out.numel() * out.element_size()))  # the limit last: `_decide` reads it
    if key not in _chosen:
        if torch.cuda.is_current_stream_capturing() or _provisional.get():
            return None  # chosen in the warm-up: a call first seen in a capture, or in a provisional
            # build (`provisional`), runs nimble's own way
        try:
            _chosen[key] = _decide(key, p, steps, operands, out, reference)
        except Exception as e:  # the package is there but cuDNN refuses it: nimble's own way runs
            STATS["failed"].append(f"{type(e).__name__}: {first_line(e)}")
            _chosen[key] = None
    plan = _chosen[key]
    return ConvGraph(plan, workspaces) if plan is not None else None


@contextlib.contextmanager
def provisional():
    """Within it, a call whose plan is not chosen yet runs nimble's own way, and nothing is timed
    or recorded for it: a tuning candidate built only to be compared (`tune/search.py`)."""
    token = _provisional.set(True)
    try:
        yield
    finally:
        _provisional.reset(token)


def _tf32(out: torch.Tensor) -> bool:
    """Whether a float32 plan may use TF32 tensor cores: as PyTorch's own convolutions may
    (`torch.backends.cudnn.allow_tf32`). Part of a choice's key, so a process that turns TF32
    off never reuses a plan chosen with it."""
    return out.dtype == torch.float32 and torch.backends.cudnn.allow_tf32


def _limit(outside: bool, nbytes: int) -> float:
    """How much slower than the reference a plan may be: never less where the reference's result
    of `nbytes` lies outside the arena than where it does not, nor where it is a large block than
    where it is a small one."""
    s = settings.current()
    if not outside:
        return s.cudnn_slower
    large = s.cudnn_slower_large_outside if nbytes >= s.cudnn_large_block else 0.0
    return max(s.cudnn_slower, s.cudnn_slower_outside, large)


def _decide(key: tuple, p: dict, steps: tuple, operands: tuple, out: torch.Tensor, reference) -> Plan | None:
    """The plan stored for this call in the cache folder, rebuilt and checked; else the plans
    timed, and the choice stored."""
    disk_key = _disk_key(key, out.device)
    stored = cache.read_table(_table_path(), MAX_PLAN_TABLE_BYTES).get(disk_key)
    if isinstance(stored, dict) and stored.get("plan") is None and "plan" in stored:
        STATS["recalled"] += 1
        return None  # nimble's own way was faster
    if isinstance(stored, dict) and isinstance(stored.get("plan"), str) and len(stored["plan"]) <= 256:
        plan = _recall(p, steps, operands, out, reference, stored["plan"])
        if plan is not None:
            STATS["recalled"] += 1
            return plan
    plan = _time_plans(p, steps, operands, out, reference, key[-1])
    cache.write_entry(_table_path(), disk_key, {"plan": plan.name if plan else None}, MAX_PLAN_TABLE_BYTES)
    return plan


def _recall(p: dict, steps: tuple, operands: tuple, out: torch.Tensor, reference, name: str) -> Plan | None:
    """The plan called `name`, if cuDNN still ranks it for this call and its result agrees with
    the reference (a crafted cache names a plan, it cannot make nimble trust one)."""
    plans = cudnn_plans.ranked(p, steps, operands, out, name)
    ref = _reference(reference, heuristic=True) if plans else None
    if ref is None or not _agrees(plans[0], operands, out, ref, _workspace(plans[0], out.device)):
        return None
    return plans[0]


def _reference(reference, heuristic: bool = False) -> torch.Tensor | None:
    """The reference's result, or None where it has none or it is not finite (nothing to check
    a plan against). `heuristic`: PyTorch's convolutions take the algorithm cuDNN's heuristics
    rank first rather than timing every one (in benchmark mode 9 ms for each new shape: 0.4 s of
    inception_v3's warm load), which is enough where a recalled plan is only checked, not timed."""
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = benchmark and not heuristic
    try:
        ref = reference()
    finally:
        torch.backends.cudnn.benchmark = benchmark
    return ref if ref is not None and bool(torch.isfinite(ref).all()) else None


def _agrees(plan: Plan, operands: tuple, out: torch.Tensor, ref: torch.Tensor, workspace: torch.Tensor) -> bool:
    """Run `plan` into `out`; whether it agrees with `ref` within the `cudnn_tolerance` setting (counted in STATS
    where it does not)."""
    plan.run(operands, out, workspace)
    if float((out - ref).abs().max()) > settings.current().cudnn_tolerance * max(float(ref.abs().max()), 1e-6):
        STATS["rejected"] += 1
        return False
    return True


def _workspace(plan: Plan, device: torch.device) -> torch.Tensor:
    return torch.empty(max(plan.workspace_bytes, 1), dtype=torch.uint8, device=device)


def _time_plans(p: dict, steps: tuple, operands: tuple, out: torch.Tensor, reference, limit: float) -> Plan | None:
    """Among the plans that agree with the reference and are at most `limit` times slower than
    it, the one with the smallest workspace of those within `cudnn_slower` of the fastest."""
    STATS["timed"] += 1
    ref = _reference(reference)
    if ref is None:
        return None
    limit_us = limit * _gpu_us(reference, out.device)
    timed = []
    for plan in cudnn_plans.ranked(p, steps, operands, out):
        workspace = _workspace(plan, out.device)
        started = time.perf_counter()
        try:
            if not _agrees(plan, operands, out, ref, workspace):
                continue
        except Exception:  # a plan that fails to run is passed over
            continue
        now = settings.current()
        if time.perf_counter() - started > max(now.cudnn_too_slow_s, now.cudnn_too_slow * limit_us / 1e6):
            STATS["too_slow"] += 1  # timing would run it 41 more times (some plans take seconds each)
            continue
        us = _gpu_us(lambda: plan.run(operands, out, workspace), out.device)
        if us <= limit_us:
            timed.append((us, plan))
    if not timed:
        return None
    fastest = min(us for us, _ in timed)
    STATS["chosen"] += 1
    return min((plan for us, plan in timed if us == fastest or us <= settings.current().cudnn_slower * fastest),
               key=lambda plan: plan.workspace_bytes)


def _table_path():
    folder = cache.cache_dir()
    return None if folder is None else folder / "cudnn_plans.json"


def _disk_key(key: tuple, device: torch.device) -> str:
    """The call's signature and steps, the GPU, and the cuDNN, frontend and torch versions, hashed."""
    cudnn = frontend()
    props = torch.cuda.get_device_properties(device)
    where = (props.name, props.major, props.minor, cudnn.backend_version(), getattr(cudnn, "__version__", ""),
             torch.__version__)
    return hashlib.sha256(repr((where, key)).encode()).hexdigest()


def _signature(p: dict, operands: tuple, out: torch.Tensor) -> tuple:
    def spec(t):
        return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype)
    return (out.device.index, spec(out), *(spec(t) for t in operands),
            tuple(p["stride"]), tuple(p["padding"]), tuple(p["dilation"]), p["groups"])
