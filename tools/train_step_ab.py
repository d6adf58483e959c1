"""What some of a training step's joint passes are worth: `nimble.TrainStep` with every pass of
`train.JOINT_PASSES` and without the ones named, timed by turns in one process (an instrument for
the training issue; the machines are shared and noisy, so only numbers of one run compare).
`step_attention` and `roll_kernel` are named as passes are: without the first, attention runs as
traced (the memory-efficient kernels), not as cuDNN's or flash's (`runtime/kernels/step_attention`);
without the second, each roll runs as PyTorch's (one kernel per rolled dim and a copy), not as the
generated kernel (`runtime/kernels/movement`).

    python tools/train_step_ab.py --without stack_views|step_attention|roll_kernel [--model vit_b_16] [--precision bf16]
                                  [--batch 32] [--size 224] [--rounds 5] [--steps 20] [--device cuda]

Both steps train torchvision's MODEL (10 classes) from the same weights on one fixed batch, with
SGD and momentum (fused), as `benchmarks/training.py` does. Printed per variant: its ops and
copies (clones and casts) in the joint graph, which kernels its attention ran, how many of its
layer-norm calls in its first step ran PyTorch's ops instead of `step_norms`' kernels (where any did), the first step's
loss against the other's, and the median ms per step over `--rounds` rounds of `--steps` steps
each, the variants taking turns (CUDA events on a GPU; the host's clock on the CPU); on a GPU also
the step's peak allocated MiB.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


# not passes: the runtime's attention by cuDNN's or flash's kernels (`runtime/kernels/step_attention`;
# without it, each pair runs as traced, the memory-efficient kernels), and its rolls by the generated
# kernel (`runtime/kernels/movement`; without it, PyTorch's roll)
LIBRARIES = ("step_attention", "roll_kernel")


def variants(without: list[str]) -> dict[str, tuple]:
    """Variant name -> (its joint passes, the LIBRARIES it runs): everything, and everything but
    `without`'s (joint passes by function name, and LIBRARIES)."""
    from nimble import train

    names = {p.__name__ for p in train.JOINT_PASSES}
    unknown = sorted(set(without) - names - set(LIBRARIES))
    if unknown:
        raise SystemExit(f"train_step_ab.py: no joint pass named {', '.join(unknown)}; the passes are "
                         f"{', '.join(p.__name__ for p in train.JOINT_PASSES)} (and {' and '.join(LIBRARIES)}, the "
                         "runtime's attention and roll kernels)")
    return {"all passes": (train.JOINT_PASSES, LIBRARIES),
            f"without {', '.join(without)}": (tuple(p for p in train.JOINT_PASSES if p.__name__ not in without),
                                              tuple(name for name in LIBRARIES if name not in without))}


def attention_pairs(step) -> list:
    """The step's attention pairs (`step_attention.Pair`), one per forward."""
    import inspect

    from nimble.runtime.kernels import step_attention

    found = {id(f.__self__): f.__self__ for f in (inspect.unwrap(p.fn) for p in step.runner.placed)
             if isinstance(getattr(f, "__self__", None), step_attention.Pair)}
    return list(found.values())


def prepared(net, x, y, precision: str, passes: tuple):
    """A TrainStep of `net` whose joint graph takes `passes`."""
    import torch

    import nimble

    return nimble.TrainStep(net, torch.nn.functional.cross_entropy, x, y, precision=precision, graph_passes=passes,
                            optimizer=torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=x.is_cuda))


def timed(torch, step, x, y, steps: int) -> float:
    """ms per step over `steps` steps."""
    if x.is_cuda:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(steps):
            step(x, y)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / steps
    start = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    return (time.perf_counter() - start) * 1000 / steps


def compare(base, x, y, precision: str, chosen: dict[str, tuple], rounds: int, steps_per_round: int) -> None:
    """Each variant of `chosen` (`variants`) as a TrainStep of a copy of `base` on (`x`, `y`), its
    graph and first loss printed, then timed by turns: `rounds` rounds of `steps_per_round` steps."""
    import torch

    from nimble.runtime.kernels import step_attention, step_norms

    steps, first = {}, {}
    for name, (passes, libraries) in chosen.items():
        step_norms.DECLINED.clear()
        net = copy.deepcopy(base)
        start = time.perf_counter()
        steps[name] = prepared(net, x, y, precision, passes)
        pairs = attention_pairs(steps[name])
        if "step_attention" not in libraries:
            for pair in pairs:
                pair.library = step_attention.TRACED
        if "roll_kernel" not in libraries:  # before the first call: the captured step keeps it
            for p in steps[name].runner.placed:
                if p.op.target == "aten::roll.default":
                    p.substitute = None
        graph = steps[name].graph
        targets = [op.target for op in graph.ops]
        first[name] = float(steps[name](x, y))
        ran = sorted({str(pair.library) for pair in pairs})
        # a layer norm's kernel that declined a call (a layout it does not take) is slow, not wrong: say so
        declined = "".join(f"; layer norm {what} by PyTorch's ops {n} times" for what, n in step_norms.DECLINED.items())
        print(f"{name}: prepared in {time.perf_counter() - start:.2f} s; {len(targets)} ops, "
              f"{targets.count('aten::clone.default')} clones, {targets.count('aten::_to_copy.default')} casts; "
              f"attention as {', '.join(ran) or 'traced (no pair)'}{declined}; first loss {first[name]:.6f}",
              flush=True)
    losses = list(first.values())
    print(f"first losses differ by {abs(losses[0] - losses[1]) / max(abs(losses[1]), 1e-12):.1e} (relative)")
    times: dict[str, list[float]] = {name: [] for name in steps}
    peaks: dict[str, int] = {}
    for name, step in steps.items():  # warm: captured where it captures
        for _ in range(3):
            step(x, y)
    for _ in range(rounds):
        for name, step in steps.items():
            if x.is_cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times[name].append(timed(torch, step, x, y, steps_per_round))
            if x.is_cuda:
                peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated())
    for name in steps:
        peak = f", peak allocated {peaks[name] / 2**20:.0f} MiB" if name in peaks else ""
        print(f"{name}: {statistics.median(times[name]):.3f} ms per step (median of {rounds}){peak}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--without", nargs="+", required=True,
                    help=f"joint passes to leave out (by function name), or {LIBRARIES}: attention as traced")
    ap.add_argument("--model", default="vit_b_16")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    chosen = variants(args.without)
    import torch
    import zoo

    torchvision = zoo.import_torchvision()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("train_step_ab.py: no CUDA device here; give --device cpu to try it on the CPU")
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    extra = {"image_size": args.size} if args.model.startswith("vit_") else {}
    base = getattr(torchvision.models, args.model)(num_classes=10, **extra).train().to(args.device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=gen).to(args.device)
    y = torch.randint(0, 10, (args.batch,), generator=gen).to(args.device)
    compare(base, x, y, args.precision, chosen, args.rounds, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
