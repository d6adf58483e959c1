"""A convolution and its epilogue as one cuDNN operation graph that writes the planned buffer.

PyTorch's fused convolutions (`cudnn_convolution_relu`, `cudnn_convolution_add_relu`) allocate
their result, so it lies outside the arena: 293 MiB of resnet50's footprint at batch 8. cuDNN's
graph API takes every tensor by pointer, the output too. Through the `nvidia-cudnn-frontend`
package (the `cudnn` extra), conv -> bias -> relu and conv -> bias -> add -> relu become one
operation graph whose plans write the buffer they are given.

The package is optional. Without it, on a convolution cuDNN has no plan for, or where the best
plan is slower than PyTorch's fused kernel by more than `SLOWER`, `FusedKernel` runs PyTorch's
kernel as before.

A plan is chosen per convolution on the warm-up's tensors, never during a capture (H100, cuDNN
9.19, `benchmarks/results/cudnn_graph.md`):
- cuDNN's heuristics rank up to about 40 plans, and the first is often not the fastest, so the
  first `PLANS` are each built, run, checked and timed;
- each result is checked against PyTorch's fused result. One of cuDNN's engines returned wrong
  values for some shapes on the H100, so a plan that disagrees is never used;
- conv -> bias -> relu has precompiled engines, which build in milliseconds. For add -> relu
  cuDNN offers only engines compiled at run time with NVRTC (0.3 to 1.7 s for the first of a
  kind in a process; a kernel cache shared by the process reuses them across shapes), so those
  are tried only where no precompiled engine runs, and only the first `COMPILED_PLANS`.

- plans are timed inside a CUDA graph of ten calls, as they will run: timed eagerly, the launch
  from Python outlasts a small convolution;
- among the plans within `SLOWER` of the fastest, the one with the smallest workspace wins.

A choice is kept for the process under the call's signature (shapes, strides, dtypes and
convolution parameters), so the same convolution in another op, another tuning candidate or
another load is not timed again. An executable's graphs share one workspace per CUDA stream
(`Workspaces`; plans that need more than `MAX_WORKSPACE` are skipped), made during the warm-up,
outside the captured graph's pool.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from ..errors import first_line

PLANS = 8  # precompiled plans tried per convolution, in cuDNN's heuristic order
COMPILED_PLANS = 3  # runtime-compiled plans tried where no precompiled one runs
MAX_WORKSPACE = 16 * 2**20
SLOWER = 1.03  # a plan is used while at most this much slower than PyTorch's fused kernel
TOLERANCE = 1e-2  # largest difference from PyTorch's result, relative to its largest magnitude

_UNTRIED = object()
_module = _UNTRIED
_handles: dict[int, object] = {}
_kernel_cache = None
_chosen: dict[tuple, Plan | None] = {}  # call signature -> the chosen plan, or None: PyTorch's kernel
STATS = {"timed": 0, "chosen": 0, "rejected": 0, "failed": []}  # convolutions timed, plans chosen, plans
# that disagreed with PyTorch, and why a convolution could not be timed (it then runs PyTorch's kernel)


def frontend():
    """The `cudnn` module of nvidia-cudnn-frontend, or None where it is missing or cannot load."""
    global _module
    if _module is _UNTRIED:
        try:
            import cudnn
            _module = cudnn if hasattr(cudnn, "pygraph") else None
        except Exception:  # not installed, or no cuDNN library it can open
            _module = None
    return _module


@dataclass
class Plan:
    """One built plan of one operation graph; the tensors are the graph's, in call order."""

    graph: object
    tensors: tuple  # x, w, bias or None, z or None, y
    index: int
    workspace_bytes: int
    name: str

    def run(self, operands: tuple, out: torch.Tensor, workspace: torch.Tensor) -> None:
        cudnn = frontend()
        handle = _handle(out.device)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(out.device).cuda_stream)
        pack = {t: a for t, a in zip(self.tensors, (*operands, out)) if t is not None}
        self.graph.execute_plan_at_index(pack, workspace, self.index, handle=handle)


class Workspaces:
    """The workspace of one executable's cuDNN graphs, one per CUDA stream: the ops on a stream
    run one after another, in the warm-up and in the captured graph, so they share it. It grows
    during the warm-up to the largest plan on its stream; the capture then finds it at full size."""

    def __init__(self):
        self._by_stream: dict[int, torch.Tensor] = {}

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        stream = torch.cuda.current_stream(device).cuda_stream
        held = self._by_stream.get(stream)
        if held is None or held.numel() < nbytes:
            held = self._by_stream[stream] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        return held

    def nbytes(self) -> int:
        return sum(t.numel() for t in self._by_stream.values())

    def release(self) -> None:
        self._by_stream = {}


class ConvGraph:
    """One fused op's cuDNN plan. `operands` are x, w, bias (or None) and z (or None, for
    conv -> relu). It keeps the workspace it last ran with, which a captured graph uses."""

    def __init__(self, plan: Plan, workspaces: Workspaces):
        self.plan, self.workspaces = plan, workspaces
        self.workspace = None

    def __call__(self, operands: tuple, out: torch.Tensor) -> torch.Tensor:
        self.workspace = self.workspaces.get(self.plan.workspace_bytes, out.device)
        self.plan.run(operands, out, self.workspace)
        return out


def choose(p: dict, operands: tuple, out: torch.Tensor, fused, workspaces: Workspaces) -> ConvGraph | None:
    """The fastest correct plan for this call (see the module docstring), or None. `fused()`
    computes the same result with PyTorch's fused kernel. Never called while capturing."""
    if frontend() is None or _overlaps(out, operands):
        return None
    key = _signature(p, operands, out)
    if key not in _chosen:
        try:
            _chosen[key] = _time_plans(p, operands, out, fused)
        except Exception as e:  # the package is there but cuDNN refuses it: PyTorch's kernel runs
            STATS["failed"].append(f"{type(e).__name__}: {first_line(e)}")
            _chosen[key] = None
    plan = _chosen[key]
    return ConvGraph(plan, workspaces) if plan is not None else None


def _time_plans(p: dict, operands: tuple, out: torch.Tensor, fused) -> Plan | None:
    """Among the plans that agree with PyTorch and are at most SLOWER than its fused kernel, the
    one with the smallest workspace of those within SLOWER of the fastest."""
    STATS["timed"] += 1
    ref = fused()
    scale = float(ref.abs().max())
    if not torch.isfinite(ref).all():
        return None
    limit = SLOWER * _gpu_us(fused)
    timed = []
    plans = _plans(p, operands, out, compiled=False) or \
        (_plans(p, operands, out, compiled=True) if operands[3] is not None else [])
    for plan in plans:
        workspace = torch.empty(max(plan.workspace_bytes, 1), dtype=torch.uint8, device=out.device)
        try:
            plan.run(operands, out, workspace)
        except Exception:
            continue
        if float((out - ref).abs().max()) > TOLERANCE * max(scale, 1e-6):
            STATS["rejected"] += 1
            continue
        us = _gpu_us(lambda: plan.run(operands, out, workspace))
        if us <= limit:
            timed.append((us, plan))
    if not timed:
        return None
    fastest = min(us for us, _ in timed)
    STATS["chosen"] += 1
    return min((plan for us, plan in timed if us <= SLOWER * fastest), key=lambda plan: plan.workspace_bytes)


def _plans(p: dict, operands: tuple, out: torch.Tensor, compiled: bool) -> list[Plan]:
    """The first plans cuDNN ranks for this graph, built: precompiled engines only, or (compiled)
    runtime-compiled ones through the process's kernel cache. Empty where cuDNN has none."""
    cudnn = frontend()
    global _kernel_cache
    if compiled and _kernel_cache is None:
        _kernel_cache = cudnn.create_kernel_cache()
    x, w, bias, z = operands
    kind = _data_type(cudnn, x.dtype)
    try:
        g = cudnn.pygraph(io_data_type=kind, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=_handle(x.device),
                          **({"kernel_cache": _kernel_cache} if compiled else {}))
        tx, tw = (g.tensor(name=n, dim=list(t.shape), stride=list(t.stride()), data_type=kind)
                  for n, t in (("x", x), ("w", w)))
        y = g.conv_fprop(image=tx, weight=tw, padding=list(p["padding"]), stride=list(p["stride"]),
                         dilation=list(p["dilation"]), compute_data_type=cudnn.data_type.FLOAT)
        tb = tz = None
        if bias is not None:
            tb = g.tensor(name="b", dim=[1, bias.numel(), 1, 1], stride=[bias.numel(), 1, 1, 1], data_type=kind)
            y = g.bias(input=y, bias=tb)
        if z is not None:
            tz = g.tensor(name="z", dim=list(z.shape), stride=list(z.stride()), data_type=kind)
            y = g.add(a=y, b=tz)
        y = g.relu(input=y)
        y.set_output(True).set_dim(list(out.shape)).set_stride(list(out.stride())).set_data_type(kind)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        if not compiled:
            g.deselect_behavior_notes([cudnn.behavior_note.RUNTIME_COMPILATION])
        g.check_support()
        count = g.get_execution_plan_count()
    except Exception:  # no engine supports this graph
        return []
    plans = []
    for i in range(min(count, COMPILED_PLANS if compiled else PLANS)):
        try:
            g.build_plan_at_index(i)
            size = g.get_workspace_size_plan_at_index(i)
        except Exception:
            continue
        if size <= MAX_WORKSPACE:
            plans.append(Plan(g, (tx, tw, tb, tz, y), i, size, g.get_plan_name_at_index(i)))
    return plans


def _gpu_us(fn, runs: int = 10) -> float:
    """Median microseconds of one call of `fn`, from three replays of a CUDA graph of `runs` calls:
    the GPU's time alone, as in the artifact's own graph (timed eagerly, a launch from Python
    takes longer than a small convolution)."""
    device = torch.cuda.current_device()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(runs):
            fn()
    graph.replay()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / runs)
    return statistics.median(times)


def _handle(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _handles:
        with torch.cuda.device(index):
            _handles[index] = frontend().create_handle()
    return _handles[index]


def _data_type(cudnn, dtype: torch.dtype):
    return {torch.float32: cudnn.data_type.FLOAT, torch.float16: cudnn.data_type.HALF,
            torch.bfloat16: cudnn.data_type.BFLOAT16}[dtype]


def _signature(p: dict, operands: tuple, out: torch.Tensor) -> tuple:
    def spec(t):
        return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype)
    return (out.device.index, spec(out), *(spec(t) for t in operands),
            tuple(p["stride"]), tuple(p["padding"]), tuple(p["dilation"]), p["groups"])


def _overlaps(out: torch.Tensor, operands: tuple) -> bool:
    """Whether the output's bytes meet an input's: a graph reads and writes them in one kernel."""
    def span(t):
        lo = t.data_ptr()
        return lo, lo + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) * t.element_size() + t.element_size()
    a, b = span(out)
    return any(t is not None and span(t)[0] < b and a < span(t)[1] for t in operands)
