"""Where a `nimble.TrainStep`'s memory goes: the plan's share, and on CUDA what each phase of the
step holds (an instrument; `benchmarks/training.py` gives only the peak).

    python tools/train_step_memory.py [--model efficientnet_b0] [--batch 32] [--size 224]
                                      [--precision fp32|bf16] [--device cuda|cpu] [--streams auto 8 1]
                                      [--ops N]

From the plan (any device): the arena (and the exact lower bound it meets), and the results the
runtime binds as computed (`runtime/joint.loose`: ops that cannot write into a given buffer), by
the op that makes them, with how many of their bytes are live at once when each is dropped as
`base/streams.release_plan` drops it (a result read on several streams is held to the end of
the step). On CUDA, the device memory torch holds after each phase: prepare (weights, arena),
the first call (op by op), the second (captured and replayed), the third (a replay); the peak;
the generated kernels' cuDNN workspaces; the segments by memory pool (the default pool, the
captured graph's own); and the step's median time. `--streams` reports each schedule in turn; `--ops N` lists the N ops
that allocate the most beyond what they hold (how the 1894 MiB arena clone of a copy was found). Written for efficientnet_b0's step (224 px, batch 32), whose 8400 MiB peak
on an H200 (2026-11-30) its plan did not explain: with CUDA's placement an arena of 3390 MiB and
2402 MiB of computed results then, 1894 and 1651 since the filled ones went
(`passes/inline_scalar_constants`).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MIB = 2 ** 20


def model(name: str):
    from tests.models import MobileNetV2Small, ResNet18

    if name == "resnet18_small":
        return ResNet18(classes=10)
    if name == "mobilenet_v2_small":
        return MobileNetV2Small()
    import zoo

    return getattr(zoo.import_torchvision().models, name)(num_classes=10)


def loose_live_peak(step) -> tuple[int, int, int]:
    """(bytes of the results bound as computed, the most of them live at once, the sum over
    streams of each stream's own most) under the runner's release plan, in issue order. The
    allocator hands a freed block only to later allocations on the stream that allocated it, so
    the last figure is nearer what a captured step's graph pool holds."""
    graph, order, stream = step.graph, list(step.schedule.order), step.schedule.stream
    loose = step.runner.unplanned
    freed = {v: op for op, vs in step.runner.release.items() for v in vs}
    live = peak = 0
    on_stream: Counter = Counter()
    stream_peak: Counter = Counter()
    held: dict[int, int] = {}  # root -> its aliases still bound
    for v in range(len(graph.values)):
        if graph.root(v) in loose:
            held[graph.root(v)] = held.get(graph.root(v), 0) + 1
    drops: dict[int, list[int]] = {}
    for v, op in freed.items():
        if graph.root(v) in loose:
            drops.setdefault(op, []).append(graph.root(v))
    for op in order:
        for v in graph.ops[op].outputs:
            if v in loose:
                live += graph.values[v].spec.storage_nbytes
                on_stream[stream[op]] += graph.values[v].spec.storage_nbytes
                stream_peak[stream[op]] = max(stream_peak[stream[op]], on_stream[stream[op]])
        peak = max(peak, live)
        for root in drops.get(op, ()):
            held[root] -= 1
            if held[root] == 0:  # the last alias gone: the allocator has the block back
                live -= graph.values[root].spec.storage_nbytes
                on_stream[stream[graph.values[root].producer]] -= graph.values[root].spec.storage_nbytes
    return sum(graph.values[v].spec.storage_nbytes for v in loose), peak, sum(stream_peak.values())


def by_pool() -> dict[str, tuple[int, int, int]]:
    """Device memory torch has reserved, by memory pool (the default one, and each captured
    graph's own): (bytes reserved, bytes of them in live blocks, CUDA streams holding segments).
    The allocator reuses a free block only for the stream that allocated its segment, so a pool
    spread over many streams holds free bytes no other stream can take."""
    import torch

    pools: dict[str, list] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = segment.get("segment_pool_id", (0, 0))
        name = "default" if tuple(pool) == (0, 0) else f"graph pool {tuple(pool)}"
        entry = pools.setdefault(name, [0, 0, set()])
        entry[0] += segment["total_size"]
        entry[1] += segment.get("active_size", segment.get("allocated_size", 0))
        entry[2].add(segment.get("stream", 0))
    return {name: (total, live, len(streams)) for name, (total, live, streams) in pools.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="efficientnet_b0",
                    help="a torchvision classification model, or resnet18_small / mobilenet_v2_small (tests/models.py)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", nargs="+", default=["auto"],
                    help="TrainStep's streams (auto, 1, or a cap): one report each, in one process")
    ap.add_argument("--ops", type=int, default=0, metavar="N",
                    help="CUDA: then list the N ops that allocate the most beyond what they leave (an "
                         "uncaptured call on one stream)")
    args = ap.parse_args()
    if args.ops and not args.device.startswith("cuda"):
        sys.exit("train_step_memory: --ops measures CUDA's allocator; leave it out with --device cpu")
    for streams in args.streams:
        report(args, streams if streams == "auto" else int(streams))
    if args.ops:
        transients(args)


def transients(args) -> None:
    """The ops of one uncaptured, one-stream call that allocate the most beyond what they hold
    before and after: a kernel's workspace, or an op that copies more than it returns (the
    copy.out that cloned the whole arena, 1894 MiB, in efficientnet_b0's step)."""
    import torch
    import torch.nn.functional as F

    import nimble
    from nimble.runtime import joint

    torch.manual_seed(0)
    net = model(args.model).cuda()
    x = torch.randn(args.batch, 3, args.size, args.size, device="cuda")
    t = torch.randint(0, 10, (args.batch,), device="cuda")
    step = nimble.TrainStep(net, F.cross_entropy, x, t, precision=args.precision, streams=1, cuda_graphs=False)
    rows = []
    call = joint._Step.call

    def measured(run, p, op_args, kwargs):  # the allocator counts on the host: no sync needed
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        results = call(run, p, op_args, kwargs)
        rows.append((torch.cuda.max_memory_allocated() - max(before, torch.cuda.memory_allocated()), p.op))
        return results

    joint._Step.call = measured
    try:
        step(x, t)
    finally:
        joint._Step.call = call
    print("ops that allocate the most beyond what they hold before and after (one stream, uncaptured):")
    for extra, op in sorted(rows, key=lambda r: -r[0])[:args.ops]:
        shapes = ", ".join("x".join(map(str, step.graph.values[v].spec.shape)) for v in op.outputs[:2])
        print(f"  {extra / MIB:8.1f} MiB  op {op.id} {op.target} -> {shapes}")
    step.close()


def report(args, streams) -> None:
    import torch
    import torch.nn.functional as F

    import nimble

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        sys.exit("train_step_memory: no CUDA device here; --device cpu reports the plan alone")
    device = torch.device(args.device)
    torch.manual_seed(0)
    net = model(args.model).to(device)
    x = torch.randn(args.batch, 3, args.size, args.size, device=device)
    t = torch.randint(0, 10, (args.batch,), device=device)
    phases = []

    def held(phase: str) -> None:
        if cuda:
            torch.cuda.synchronize(device)
            phases.append((phase, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)))

    held("the model and a batch")
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    step = nimble.TrainStep(net, F.cross_entropy, x, t, precision=args.precision, streams=streams,
                            optimizer=torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=cuda))
    held("prepared")
    for k in range(3):
        step(x, t)
        held(("first call (op by op)", "second call (captured, replayed)", "third call (replayed)")[k]
             if cuda else f"call {k + 1}")
    where = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"{args.model}, batch {args.batch}, {args.size} px, {args.precision}, streams {streams}, {where}, "
          f"torch {torch.__version__}")
    plan = step.memory_plan
    total, peak, per_stream = loose_live_peak(step)
    print(f"plan: arena {plan.arena_bytes / MIB:.0f} MiB (lower bound {plan.lower_bound_bytes / MIB:.0f}, every buffer "
          f"apart {plan.no_reuse_bytes / MIB:.0f}); computed results {total / MIB:.0f} MiB, at most "
          f"{peak / MIB:.0f} live at once, {per_stream / MIB:.0f} as the sum of each stream's most; "
          f"{step.schedule.num_streams} streams")
    made: Counter = Counter()
    for v in step.runner.unplanned:
        made[step.graph.ops[step.graph.values[v].producer].target] += step.graph.values[v].spec.storage_nbytes
    for target, nbytes in made.most_common(5):
        print(f"  computed by {target}: {nbytes / MIB:.0f} MiB")
    if not cuda:
        return
    print("device memory after each phase (MiB allocated / reserved):")
    for phase, allocated, reserved in phases:
        print(f"  {phase}: {allocated / MIB:.0f} / {reserved / MIB:.0f}")
    print(f"peak: {torch.cuda.max_memory_allocated(device) / MIB:.0f} allocated, "
          f"{torch.cuda.max_memory_reserved(device) / MIB:.0f} reserved")
    workspaces = step.runner.workspaces
    print(f"cuDNN workspaces of the generated kernels: {(workspaces.nbytes() if workspaces else 0) / MIB:.0f} MiB")
    for pool, (nbytes, live, streams_held) in sorted(by_pool().items()):
        print(f"  reserved in the {pool}: {nbytes / MIB:.0f} MiB, {live / MIB:.0f} of it live, segments on "
              f"{streams_held} stream(s)")
    print(f"step: {median_ms(lambda: step(x, t)):.2f} ms (median of 20 replays, synchronized)")
    step.close()
    step = net = None  # rebound, not deleted: the lambda above names it
    import gc

    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def median_ms(call, n: int = 20) -> float:
    import statistics
    import time

    import torch

    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


if __name__ == "__main__":
    main()
