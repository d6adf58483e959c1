"""A whole training step as one planned graph: `TrainStep(module, loss, inputs, targets)`.

    step = nimble.TrainStep(net, torch.nn.functional.cross_entropy, x, y,
                            optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, fused=True))
    for x, y in loader:
        loss = step(x, y)  # forward, loss, backward, the all-reduce of the gradients, the optimizer

The forward, the loss and the backward come from torch's own export for training as one joint
graph (`frontend/joint.py`), which goes through nimble's passes, its schedule and its memory plan
whole: the activations the backward keeps are planned buffers like any other
(`memory_plan.arena_bytes`), but for the results of ops that cannot write into a given buffer,
which are bound as computed (`runtime/joint.loose`). On CUDA the step's 4-D maps are laid out
channels_last where the module is a convolutional net (`layout`). A call runs that graph on the module's own
parameters and buffers (`runtime/joint.py`), on CUDA captured into a CUDA graph from its second
call, sets each parameter's `.grad` to this step's gradient (as after `zero_grad()` and
`backward()`: gradients are not added up across calls; in a captured step `.grad` is the same
tensor on every call, which each replay overwrites), writes batch
norm's running statistics back into its buffers, and then calls `optimizer.step()` where an
optimizer was given. torch.optim's `fused=True` runs the update of every parameter as one kernel.

Data parallel: where `torch.distributed` is initialized with more than one process (`torchrun`),
the module's parameters and buffers are first broadcast from rank 0, as DistributedDataParallel
does, and each call averages the gradients over the processes with `torch.distributed`'s
all-reduce (NCCL on GPUs, gloo on the CPU). The gradients go in buckets of about `bucket_mb` MB
in the order the backward produces them, each all-reduced asynchronously as soon as its last
gradient exists, while the rest of the backward runs.

A module changed after it was prepared (a parameter replaced, or given new storage) is refused.
"""

from __future__ import annotations

import torch

from . import guards, passes
from .errors import ShapeError, UsageError
from .frontend import joint
from .ir import TensorSpec
from .ops import fusion, types
from .pipeline import FUSION, LAYOUT, REWRITES
from .plan.memory import plan
from .plan.schedule import assign_streams
from .plan.verify import check_plan
from .runtime.assemble.choice import viewed
from .runtime.joint import SAME_STRIDES, JointRunner, loose, placed_ops
from .runtime.kernels.cudnn_graph import Workspaces
from .specs import parse_streams
from .stages import Stages, cycles_uncollected

# A joint graph takes inference's passes, fusion's included, less those that assume frozen weights
# and eval-mode batch norm (here the parameters are inputs, and batch norm is training-mode), and
# before fusion the gradients of a tensor taken apart at every index become one stack, and those of
# one taken apart into strided slices one buffer the pieces are copied into; a stack reads
# its pieces' sources through views instead of copies of them where it can, and a copy that only
# views read becomes those views of its source where it can (attention's packed projection); after
# fusion each layer norm takes in the residual join before it and its backward the add after it,
# and a mixed-precision step's casts of its gradients go a few dozen to a kernel.
JOINT_PASSES: tuple = (tuple(p for p in REWRITES + LAYOUT
                             if p not in (passes.fold_batch_norm, passes.affine_batch_norm))
                       + (passes.stack_select_gradients, passes.scatter_slice_gradients, passes.stack_views,
                          passes.drop_view_clones) + FUSION
                       + (passes.fuse_layer_norm_adds, passes.group_casts))


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}  # compute dtype under autocast (None: the module's own)
LAYOUTS = ("auto", "contiguous", "channels_last")  # of a step's 4-D activations (`TrainStep`'s `layout`)

# A step's "auto" schedule: at most this many streams. Its kernels are large enough to fill the GPU
# one at a time, so more streams bought no time, while each held memory: the allocator keeps freed
# blocks per stream, and more overlap keeps more buffers apart in the plan. H200, torch 2.11, batch
# 32 at 224 px, 2026-11-30 (step ms and peak reserved MiB): resnet50 bf16 7.50 and 2648 with the
# schedule's own 64 streams, 7.43 and 2256 with 4, 7.95 and 1984 with 1; efficientnet_b0 fp32
# 9.74 and 3188 with 60, 9.70 and 2938 with 4 (benchmarks/results/training_224_h200_2026-11-30.md).
STEP_STREAMS = 4

# A step's "auto" layout: channels_last from this many 2-D convolutions in the forward. swin_t's
# one convolution, its patch embedding, laid every (B, H, W, C) map of its blocks out
# channels_last, which puts C, the dim its layer norms and linears read along, out of order: H200,
# torch 2.11, bf16, batch 32 at 224 px, 2026-12-01, 20.61 ms a step channels_last against 14.09
# contiguous (`benchmarks/training.py --step-layouts auto channels_last`; vit_b_16, one
# convolution too, 11.68 against 11.67).
CONVOLUTIONAL = 2


def _norm_ranks(fused_norms: bool | None, device: torch.device, channels_last: bool) -> frozenset[int]:
    """The ranks of the maps whose batch norms and activations become one op each way
    (`TrainStep`'s `fused_norms`): where `kernels/batch_norm` runs them by default, every rank
    where asked, none where refused."""
    if fused_norms is None:
        return frozenset(({2, 4} if channels_last else {2}) if device.type == "cuda" else ())
    return frozenset({2, 3, 4, 5} if fused_norms else ())


def _tensors(obj, what: str) -> list[torch.Tensor]:
    objs = list(obj) if isinstance(obj, (tuple, list)) else [obj]
    if not objs or not all(isinstance(t, torch.Tensor) for t in objs):
        raise UsageError(f"{what} must be a tensor or a tuple of tensors")
    return objs


class TrainStep:
    # the collector paused while the trace and the passes make their objects: prepare on the 2-core
    # builder, bf16 at batch 2, by turns in one process (2026-12-01): swin_t 3.43 against 4.22 s,
    # vit_b_16 1.99 against 2.49 s (medians of 3; `stages.cycles_uncollected`)
    @cycles_uncollected
    def __init__(self, module: torch.nn.Module, loss, example_inputs, example_targets,
                 optimizer: torch.optim.Optimizer | None = None, streams: str | int = "auto", bucket_mb: float = 25.0,
                 broadcast_buffers: bool = True, precision: str = "fp32", outputs: bool = False,
                 cuda_graphs: bool = True, layout: str = "auto", fused_norms: bool | None = None,
                 graph_passes: tuple | None = None):
        """Prepare the step of `module` trained with `loss(module(*inputs), *targets)` (a scalar
        tensor) for inputs and targets shaped like the examples, on their device. `streams` ("auto":
        at most STEP_STREAMS; 1; or a cap) is the schedule: on CUDA each op runs on its planned
        stream, and the memory plan is proved safe under it. `cuda_graphs` (CUDA only): the first
        call runs the ops one by one, the second captures the step (the graph, the gradients' all-reduce and the copies
        after it) into a CUDA graph, and every later call replays it; the inputs are then copied
        into the step's own buffers. Data parallel
        (see the module): `bucket_mb` sizes the all-reduced buckets of gradients, and
        `broadcast_buffers` sends rank 0's buffers (batch norm's running statistics) to every
        process before each step, as DistributedDataParallel does by default. `precision` "bf16"
        trains with bfloat16 compute and float32 weights, gradients and optimizer: the forward and
        the loss run under `torch.autocast(dtype=torch.bfloat16)`, with its float32 list.
        `outputs=True`: a call returns `(loss, outputs)`, the module's outputs beside the loss (for
        accuracy, say): one tensor, or a tuple of them in the order of the module's output
        structure, detached copies. `layout` of the 4-D activations: "contiguous" (NCHW),
        "channels_last" (NHWC: the step's 4-D inputs and planned maps, so cuDNN's convolutions
        and batch norms run in the layout they are fastest in, as torch.compile lays them out),
        or "auto": channels_last on CUDA for a module with two 2-D convolutions or more, else
        contiguous (a transformer's patch embedding alone is not worth it: see `CONVOLUTIONAL`). The
        module's own tensors keep their layout either way. `fused_norms`: each training-mode
        batch norm, with the relu, relu6 or silu after it, runs as one op each way (`ops/norm_act.py`:
        kernels that pass over the map 8 times a step where aten's pass 13 times with a relu,
        and the map before the activation is not kept; a residual add alone after it, relu or not,
        is the forward's too). None: on CUDA, where its kernels take the step's maps (2-D ones, and 4-D ones
        channels_last); True: everywhere, aten's ops where they do not (for tests); False: never
        (for comparisons). `graph_passes`: the graph passes the joint graph takes, in order (default
        `JOINT_PASSES`; for comparisons, `tools/train_step_ab.py`)."""
        xs, ys = _tensors(example_inputs, "example_inputs"), _tensors(example_targets, "example_targets")
        if graph_passes is not None and not all(callable(p) for p in graph_passes):
            raise UsageError("graph_passes must be graph passes (functions), as train.JOINT_PASSES holds")
        device = xs[0].device
        if any(t.device != device for t in xs + ys):
            raise UsageError("example_inputs and example_targets are on different devices; put them on one device")
        state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        if any(t.device != device for t in state.values()):
            raise UsageError(f"the module's tensors are not all on {device}, where the examples are; move both to one "
                             "device")
        if precision not in PRECISIONS:
            raise UsageError(f"precision {precision!r}: use one of {', '.join(PRECISIONS)} (bf16 computes in bfloat16 "
                             "under torch.autocast, with float32 weights)")
        if layout not in LAYOUTS:
            raise UsageError(f"layout {layout!r}: use one of {', '.join(LAYOUTS)}")
        if bucket_mb <= 0:
            raise UsageError(f"bucket_mb is {bucket_mb}; give a positive size in MB")
        self.module, self.optimizer, self.device = module, optimizer, device
        self.name = type(module).__name__
        self.specs = [TensorSpec(tuple(t.shape), types.dtype_name(t.dtype)) for t in xs + ys]
        self._count = len(xs)
        module.train()
        self.precision = precision
        self.outputs = bool(outputs)
        program = joint.export_joint(module, loss, xs, ys, self.name, PRECISIONS[precision], self.outputs)
        lowered = joint.lower_joint(program, self.specs, self.name)
        graph, weights = Stages().run_passes(lowered.lowered.graph, lowered.lowered.weights,
                                             JOINT_PASSES if graph_passes is None else tuple(graph_passes),
                                             passes.REWRITES_WEIGHTS, "lowered")
        if layout == "auto":
            layout = "channels_last" if device.type == "cuda" and _convolutions(graph) >= CONVOLUTIONAL \
                else "contiguous"
        self.layout = layout
        channels_last = layout == "channels_last"
        ranks = _norm_ranks(fused_norms, device, channels_last)
        if ranks:
            graph = passes.fuse_batch_norm_activation(graph, ranks)
        streams = parse_streams(streams)
        self.graph, self.schedule = graph, assign_streams(graph, STEP_STREAMS if streams == "auto" else streams)
        workspaces = Workspaces() if device.type == "cuda" else None  # the generated kernels' cuDNN workspaces
        placed = placed_ops(graph, device, workspaces)
        unplanned = loose(graph, placed)  # bound as computed: copying them into buffers would cost a pass each
        self.memory_plan = plan(graph, self.schedule, unplanned)
        check_plan(graph, self.schedule, self.memory_plan, unplanned=unplanned)
        prefix = "module."
        names = [r.target.removeprefix(prefix) for r in lowered.inputs]
        missing = [n for r, n in zip(lowered.inputs, names) if r.kind != joint.DATA and n not in state]
        if missing:
            raise UsageError(f"{self.name}: the exported step reads '{missing[0]}', which the module does not have")
        self._bound = [state[n] if r.kind != joint.DATA else None for r, n in zip(lowered.inputs, names)]
        self._outputs = [(r.kind, state.get(r.target.removeprefix(prefix))) for r in lowered.outputs]
        kinds = [kind for kind, _ in self._outputs]
        self._loss_at, self._outputs_at = kinds.index(joint.LOSS), [k for k, kind in enumerate(kinds)
                                                                    if kind == joint.OUTPUT]
        self.runner = JointRunner(graph, self.schedule, self.memory_plan, weights, device, placed, unplanned,
                                  workspaces, channels_last)
        self._guard = guards.EveryTensor(module, versions=False)
        self._data = _DataParallel(self, bucket_mb, broadcast_buffers)
        self.cuda_graphs = bool(cuda_graphs) and device.type == "cuda"
        # the inputs' own buffers where the step is captured (a graph reads fixed addresses)
        # each input's memory format: channels_last for a 4-D one in such a step, unless a view reshapes it
        shared = viewed(graph, SAME_STRIDES)
        data = [v for v, t in zip(graph.inputs, self._bound) if t is None]
        self._formats = [torch.channels_last if channels_last and len(s.shape) == 4 and v not in shared
                         else torch.contiguous_format for s, v in zip(self.specs, data)]
        self._slots = [torch.empty(s.shape, dtype=types.DTYPES[s.dtype], device=device, memory_format=f)
                       for s, f in zip(self.specs, self._formats)] if self.cuda_graphs else None
        self._calls = 0
        self._results: list[torch.Tensor] | None = None  # the captured step's outputs, which each replay writes
        self._grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # each parameter's gradient of the step

    def __call__(self, inputs, targets):
        """One step on these inputs and targets; returns the loss (a scalar tensor), or with
        `outputs=True` the loss and the module's outputs."""
        self._guard.check()
        given = _tensors(inputs, "inputs") + _tensors(targets, "targets")
        if len(given) != len(self.specs):
            raise UsageError(f"the step takes {self._count} input(s) and {len(self.specs) - self._count} target(s), "
                             f"as prepared; got {len(given)} tensors in all")
        for k, (t, spec) in enumerate(zip(given, self.specs)):
            if tuple(t.shape) != spec.shape or types.dtype_name(t.dtype) != spec.dtype or t.device != self.device:
                raise ShapeError(f"tensor {k} of the step is {'x'.join(map(str, t.shape))} {types.dtype_name(t.dtype)} "
                                 f"on {t.device}, but the step was prepared for {'x'.join(map(str, spec.shape))} "
                                 f"{spec.dtype} on {self.device}; prepare another TrainStep for it")
        self._data.before()
        if self._slots is not None:
            with torch.no_grad():
                for slot, t in zip(self._slots, given):
                    slot.copy_(t)
            given = self._slots
        if self._results is not None:  # captured: the graph reads the slots
            self.runner.replay()
            results = self._results
        else:
            data = iter(t.contiguous(memory_format=f) for t, f in zip(given, self._formats))  # dense, in the layout
            bound = [t if t is not None else next(data) for t in self._bound]
            if self.cuda_graphs and self._calls > 0:  # the first call ran eagerly: it created the streams' handles
                self._release_eager()
                results = self._results = self.runner.capture(bound, self._data.ready, self._after)
                self.runner.replay()
            else:
                results = self.runner(bound, self._data.ready, self._after)
            self._calls += 1
        with torch.no_grad():
            outputs = [results[k].clone() for k in self._outputs_at]  # the arena's copies are the next step's
            for p, g in self._grads:
                if p.grad is not g:
                    p.grad = g
        if self.optimizer is not None:
            self.optimizer.step()
        loss = results[self._loss_at].clone()  # the arena's copy is the next step's
        if not self.outputs:
            return loss
        return loss, outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _after(self, results: list[torch.Tensor]) -> None:
        """After the step's ops (and in its CUDA graph, where captured): the gradients averaged
        over the processes, each in its parameter's own layout (as autograd gives it: fused
        optimizers assume it), and batch norm's new running statistics in the module's buffers."""
        grads = []
        for p, g in self._data.finish(results):
            if g.stride() != p.stride():
                g = torch.empty_like(p).copy_(g)
            grads.append((p, g))
        self._grads = grads
        updates = [(target, value) for (kind, target), value in zip(self._outputs, results)
                   if kind == joint.BUFFER_UPDATE]
        if updates:
            torch._foreach_copy_([t for t, _ in updates], [v for _, v in updates])

    def _release_eager(self) -> None:
        """Before the capture: the first call's gradients dropped and torch's cached blocks given
        back, so that the memory of the eager call's results (bound as computed: `joint.loose`)
        is not held twice, in the allocator's cache and in the graph's pool."""
        self._drop_grads()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def close(self) -> None:
        """Drop the captured CUDA graph (the next call runs eagerly and captures again). Call it
        before `torch.distributed.destroy_process_group()`: a graph that holds NCCL's all-reduce
        keeps that from returning (pytorch/pytorch#115388)."""
        if self.runner.captured is not None:
            torch.cuda.synchronize(self.device)
        self.runner.captured, self._results, self._calls = None, None, 0
        self._drop_grads()

    def _drop_grads(self) -> None:
        for p, _ in self._grads:
            p.grad = None
        self._grads = []


def _convolutions(graph) -> int:
    """The 2-D convolutions among `graph`'s ops (and fused ops' bodies; their backwards are ops of
    another kind)."""
    return sum(target in fusion.CONVOLUTIONS for op in graph.ops for target, _, _ in fusion.nodes_of(op))


class _DataParallel:
    """The gradients of a step: as they are, or averaged over the processes of
    `torch.distributed` in buckets all-reduced while the backward runs (see the module)."""

    def __init__(self, step: TrainStep, bucket_mb: float, broadcast_buffers: bool):
        import torch.distributed as dist

        self.dist = dist
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        graph = step.graph
        self.gradients = [(k, p) for k, (kind, p) in enumerate(step._outputs) if kind == joint.GRADIENT]
        self.ready, self.graph, self.buffers = None, graph, []
        self._pending: list = []  # (bucket, its flat gradients, the all-reduce's work) of the step running
        self._have: dict[int, torch.Tensor] = {}  # output index -> gradient, as they come
        if self.world == 1:
            return
        self._broadcast([*step.module.parameters(), *step.module.buffers()])  # rank 0's module, as DDP does
        self.buffers = list(step.module.buffers()) if broadcast_buffers else []
        # buckets in the order the backward makes the gradients (the schedule's order of their producers)
        position = {i: k for k, i in enumerate(step.schedule.order)}
        outputs = graph.outputs
        made = sorted(self.gradients, key=lambda kp: position.get(graph.values[outputs[kp[0]]].producer, -1))
        limit = bucket_mb * 2**20
        self.buckets: list[list[int]] = [[]]
        size = 0
        for k, p in made:
            if self.buckets[-1] and size + p.numel() * p.element_size() > limit:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(k)
            size += p.numel() * p.element_size()
        self._value_of = {outputs[k]: k for k, _ in made}
        self._bucket_of = {k: b for b, ks in enumerate(self.buckets) for k in ks}
        self.ready = self._ready

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Rank 0's values of `tensors` in every process: one broadcast per dtype."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        kinds: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            kinds.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for group in kinds.values():
                flat = _flatten_dense_tensors([t.detach() for t in group])
                self.dist.broadcast(flat, src=0)
                for t, value in zip(group, _unflatten_dense_tensors(flat, group)):
                    t.copy_(value)

    def before(self) -> None:
        """Before a step: rank 0's buffers everywhere, where asked."""
        if self.world > 1 and self.buffers:
            self._broadcast(self.buffers)

    def _ready(self, op: int, results: list[torch.Tensor]) -> None:
        graph = self.graph
        for vid, t in zip(graph.ops[op].outputs, results):
            k = self._value_of.get(vid)
            if k is None:
                continue
            self._have[k] = t
            b = self._bucket_of[k]
            if all(j in self._have for j in self.buckets[b]):
                flat = torch.cat([self._have[j].reshape(-1) for j in self.buckets[b]])
                self._pending.append((b, flat, self.dist.all_reduce(flat, async_op=True)))

    def finish(self, results: list[torch.Tensor]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """(parameter, gradient) pairs of this step, averaged over the processes where there are several."""
        if self.world == 1:
            return [(p, results[k]) for k, p in self.gradients]
        grads = {}
        for b, flat, work in self._pending:
            work.wait()
            flat.div_(self.world)
            offset = 0
            for k in self.buckets[b]:
                n = results[k].numel()
                grads[k] = flat[offset:offset + n].view_as(results[k])
                offset += n
        self._pending, self._have = [], {}
        return [(p, grads[k]) for k, p in self.gradients]
