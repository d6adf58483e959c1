"""Where a training step's GPU time goes, by kernel: `nimble.TrainStep` in each layout beside
torch.compile(mode="reduce-overhead"), one process, one model (an instrument for the training
issue; `benchmarks/training.py` gives only the step's wall time).

    python tools/train_step_kernels.py [--model resnet50] [--batch 32] [--size 224]
                                       [--layouts channels_last contiguous] [--unfused-norms] [--no-compile]
                                       [--top 18] [--precision bf16] [--by-op]

Each variant takes three steps untimed, then five steps under torch.profiler (CUDA activity
only). Printed per variant: kernel time per step and kernels per step, the time by class
(convolutions, batch norm's kernels, GEMMs, Triton, other elementwise kernels, reductions, the
optimizer's multi-tensor kernels), and the `--top` kernels by time with their count per step. TF32
on, SGD with momentum (fused), 10 classes, random data: as `benchmarks/training.py`; `--precision
bf16` runs TrainStep with precision="bf16" and torch.compile under torch.autocast, as it does.
`--by-op` also runs each layout's step uncaptured on one stream under the profiler and prints its GPU
time by the aten op the runtime called, with input shapes: which copies are whose (it found the 48
attention copies that `joint._views_hold` now spares). First use (H200, 2026-11-30): `benchmarks/results/training_kernels_resnet50_h200_2026-11-30.txt`,
which showed the step's batch norm kernels at twice their time in NCHW (8.5 against 4.5 ms of
20.7) and cuDNN converting layouts around every convolution, before steps became channels_last.
"""

from __future__ import annotations

import argparse
import collections
import copy
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

CLASSES = [("attention|fmha|flash|attn", "attention"), ("conv|implicit_gemm|winograd|dgrad|wgrad|fprop|nchwtonhwc|nhwctonchw", "convolution"),
           ("batch_norm|batchnorm|bn_", "batch norm"), ("gemm|cublas", "gemm"), ("triton", "triton"),
           ("elementwise|vectorized|unrolled|copy|memcpy", "elementwise"), ("reduce", "reduction"),
           ("multi_tensor|foreach", "optimizer")]


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for pattern, c in CLASSES if re.search(pattern, low)), "other")


def profile_steps(torch, fn, label: str, top: int, n: int = 5) -> None:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    per, classes, count = collections.Counter(), collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(e, "device_time", None)
            us = e.cuda_time if us is None else us
            per[e.name] += us / n
            classes[kernel_class(e.name)] += us / n
            count[e.name] += 1
    print(f"== {label}: kernel time {sum(per.values()) / 1000:.2f} ms per step, {sum(count.values()) // n} kernels")
    for c, us in classes.most_common():
        print(f"   {c:12s} {us / 1000:7.2f} ms")
    for k, us in per.most_common(top):
        print(f"   {us / 1000:7.3f} ms x{count[k] // n:3d} {k[:110]}")
    sys.stdout.flush()


def profile_ops(torch, step, x, y, label: str, top: int) -> None:
    """One step of `step` (uncaptured, on one stream) under the profiler: GPU time by the aten op
    the runtime called (the outermost one: a cast's copy is its `_to_copy`'s, a clone's its
    `copy_`'s), in all and by input shapes. Generated kernels, launched without an aten op, are
    left out of it; the total says how much the aten ops hold."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step(x, y)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step(x, y)
        torch.cuda.synchronize()
    by_op, by_shapes = collections.Counter(), collections.Counter()
    calls, shaped = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::") \
                and e.device_time_total > 0:
            key = (e.name, str(e.input_shapes)[:100])
            by_op[e.name] += e.device_time_total
            calls[e.name] += 1
            by_shapes[key] += e.device_time_total
            shaped[key] += 1
    print(f"== {label}, by aten op (one uncaptured step on one stream): {sum(by_op.values()) / 1000:.2f} ms")
    for name, us in by_op.most_common(top):
        print(f"   {us / 1000:7.3f} ms x{calls[name]:4d} {name}")
    print("   by input shapes:")
    for key, us in by_shapes.most_common(2 * top):
        print(f"   {us / 1000:7.3f} ms x{shaped[key]:4d} {key[0]} {key[1]}")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--layouts", nargs="+", choices=("auto", "contiguous", "channels_last"),
                    default=["channels_last", "contiguous"])
    ap.add_argument("--no-compile", action="store_true", help="leave out torch.compile (it takes 30 to 60 s)")
    ap.add_argument("--unfused-norms", action="store_true",
                    help="also each layout with fused_norms=False (batch norm and its activation as aten's ops)")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--by-op", action="store_true",
                    help="also each layout's step uncaptured on one stream, its GPU time by aten op and input shapes")
    args = ap.parse_args()

    import torch
    import training
    import zoo

    import nimble

    if not torch.cuda.is_available():
        raise SystemExit("train_step_kernels.py times CUDA kernels; run it on a GPU machine")
    torchvision = zoo.import_torchvision()
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    base = getattr(torchvision.models, args.model)(num_classes=10).cuda().train()
    x, y = training.data(args.batch, args.size)
    for layout, fused in [(layout, fused) for layout in args.layouts
                          for fused in ((None, False) if args.unfused_norms else (None,))]:
        net = copy.deepcopy(base)
        step = nimble.TrainStep(net, torch.nn.functional.cross_entropy, x, y, layout=layout, fused_norms=fused,
                                precision=args.precision,
                                optimizer=torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=True))
        label = f"{args.model} {args.precision} TrainStep {step.layout}" + (" unfused norms" if fused is False else "")
        profile_steps(torch, lambda: step(x, y), label, args.top)
        if args.by_op:
            step.close()
            net = copy.deepcopy(base)
            step = nimble.TrainStep(net, torch.nn.functional.cross_entropy, x, y, layout=layout, fused_norms=fused,
                                    precision=args.precision, cuda_graphs=False, streams=1,
                                    optimizer=torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=True))
            profile_ops(torch, step, x, y, label, args.top)
        step = net = None
        torch.cuda.empty_cache()
    if not args.no_compile:
        net = copy.deepcopy(base)
        compiled = torch.compile(net, mode="reduce-overhead")
        run, _ = training.stepper(compiled, net.parameters(), args.batch, args.size, args.precision == "bf16",
                                  before=torch.compiler.cudagraph_mark_step_begin)
        profile_steps(torch, run, f"{args.model} {args.precision} torch.compile", args.top)


if __name__ == "__main__":
    main()
