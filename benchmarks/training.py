"""Training step time on a GPU: nimble against eager PyTorch and torch.compile, fp32.

    python benchmarks/training.py --out DIR [--models mobilenet_v2 ...] [--batches 32 64 128]
                                  [--compile-batches 32] [--size 224] [--precision bf16] [--no-prepared]
                                  [--step-layouts channels_last contiguous] [--channels-last]
    python benchmarks/training.py --report DIR/training_*.json --out benchmarks/results  # no GPU

Models are torchvision's MobileNetV2, EfficientNet-B0 and ResNet-50 (and any other of its
classifiers named) with 10 classes on square inputs of `--size` pixels (32, CIFAR-sized, by
default; 224 as people train ImageNet). `--precision bf16` runs eager and torch.compile under
`torch.autocast(dtype=torch.bfloat16)` and TrainStep with `precision="bf16"`; the older
`prepare(..., training=True)` path has no bf16 and is left out then (and with `--no-prepared`). A step is zero_grad, forward, cross-entropy, backward and an SGD step
with momentum (torch.optim, foreach), as a user writes it. Every variant starts from the same
weights; the figure is the median wall time of one step, synchronized, after a warm-up.

Variants: eager; nimble with the auto schedule and with one stream (`prepare(..., streams=1)`);
`nimble.TrainStep` (the joint forward-backward graph, captured into a CUDA graph from its second
call; the same SGD, fused), once per `--step-layouts` entry (its `layout` argument: "auto" by
default, which is channels_last on CUDA for these nets; the first entry's figures are `step_*`,
the others' `step_<layout>_*`; with `--unfused-norms` each again with `fused_norms=False`,
`step_<layout>_unfused_*`); with `--channels-last`, eager again with the model and images in
channels_last;
torch.compile(mode="reduce-overhead") for --compile-batches only (it compiles for minutes). For
nimble, prepare time is recorded, and its forward and backward graphs are replayed alone, with
auto and with one stream, to measure whether the backward inherits the forward's parallelism.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
import time
from pathlib import Path

import report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("mobilenet_v2", "efficientnet_b0", "resnet50")
TARGETS = {("mobilenet_v2", 32): 3.0, ("resnet50", 32): 1.8}  # speed-up over eager


median_ms = report.median_ms  # a synchronised step, timed on the wall clock


def first_losses(step, last, n: int = 3) -> list[float]:
    """The losses of the first `n` steps from the initial weights (dropout seeded alike)."""
    import torch

    out = []
    for i in range(n):
        torch.manual_seed(i)
        step()
        out.append(last["loss"].item())
    return out


def data(batch: int, size: int):
    """The fixed random batch every variant trains on."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, 3, size, size, device="cuda", generator=gen)
    return x, torch.randint(0, 10, (batch,), device="cuda", generator=gen)


def stepper(model, params, batch: int, size: int, bf16: bool, before=None, channels_last: bool = False):
    """One training step of `model` (a callable) over `params`, on fixed random data (its images
    in channels_last memory order with `channels_last`)."""
    import torch
    import torch.nn.functional as F

    x, y = data(batch, size)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    last = {}

    def step():
        if before:
            before()
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        last["loss"] = loss

    return step, last


def bench_one(name: str, batch: int, iters: int, compile_it: bool, size: int = 32, precision: str = "fp32",
              prepared: bool = True, channels_last: bool = False, layouts: tuple = ("auto",), unfused: bool = False) -> dict:
    import nimble
    import torch
    import torchvision

    torch.manual_seed(0)
    base = getattr(torchvision.models, name)(weights=None, num_classes=10).cuda().train()
    row: dict = {"model": name, "batch": batch, "size": size, "precision": precision}
    bf16 = precision == "bf16"

    eager_losses, row["eager_ms"], row["eager_peak_mb"] = eager_timed(base, batch, size, bf16, iters)
    # the control: eager against itself, same weights and batch
    row["eager_again_loss_rel_diff"] = rel_diffs(eager_timed(base, batch, size, bf16, 0)[0], eager_losses)
    if channels_last:  # what cuDNN's NHWC kernels give eager (torch.compile chooses this layout for convolutions)
        losses, row["eager_channels_last_ms"], row["eager_channels_last_peak_mb"] = eager_timed(
            base, batch, size, bf16, iters, channels_last=True)
        row["eager_channels_last_loss_rel_diff"] = rel_diffs(losses, eager_losses)

    for streams in (("auto", 1) if prepared and not bf16 else ()):
        net = copy.deepcopy(base)
        t = time.perf_counter()
        model = nimble.Nimble(net).prepare(torch.randn(batch, 3, size, size, device="cuda"), training=True,
                                           streams=streams)
        torch.cuda.synchronize()
        key = "nimble" if streams == "auto" else "nimble_1stream"
        row[f"{key}_prepare_s"] = time.perf_counter() - t
        runner = model._runner
        row[f"{key}_streams"] = runner.schedule.num_streams
        step, last = stepper(model, net.parameters(), batch, size, bf16)
        losses = first_losses(step, last)
        row[f"{key}_loss_rel_diff"] = rel_diffs(losses, eager_losses)
        row[f"{key}_ms"] = median_ms(step, iters)
        row[f"{key}_forward_ms"] = median_ms(runner.fwd_graph.replay, iters)
        row[f"{key}_backward_ms"] = median_ms(runner.bwd_graph.replay, iters)
        del model, runner, net
        torch.cuda.empty_cache()

    variants = [(layout, fused) for layout in layouts for fused in ((None, False) if unfused else (None,))]
    for k, (layout, fused) in enumerate(variants):
        # the first variant's row keeps the plain keys
        key = "step" if k == 0 else f"step_{layout}" + ("_unfused" if fused is False else "")
        start = footprint_start()
        net = copy.deepcopy(base)
        x, y = data(batch, size)
        t = time.perf_counter()
        train = nimble.TrainStep(net, torch.nn.functional.cross_entropy, x, y, precision=precision, layout=layout,
                                 fused_norms=fused, optimizer=torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=True))
        torch.cuda.synchronize()
        row[f"{key}_prepare_s"] = time.perf_counter() - t
        row[f"{key}_layout"] = train.layout
        losses = []
        for i in range(3):
            torch.manual_seed(i)
            losses.append(train(x, y).item())
        row[f"{key}_loss_rel_diff"] = rel_diffs(losses, eager_losses)
        row[f"{key}_ms"] = median_ms(lambda: train(x, y), iters)
        row[f"{key}_issue_ms"] = issue_ms(lambda: train(x, y))
        row[f"{key}_peak_mb"] = footprint_mb(start)
        train = net = None  # dropped before the next variant (rebound, not deleted: the lambda names it)
        torch.cuda.empty_cache()

    if compile_it:
        start = footprint_start()
        net = copy.deepcopy(base)
        compiled = torch.compile(net, mode="reduce-overhead")
        step, _ = stepper(compiled, net.parameters(), batch, size, bf16,
                          before=torch.compiler.cudagraph_mark_step_begin)
        t = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        row["compile_first_steps_s"] = time.perf_counter() - t
        row["compile_ms"] = median_ms(step, iters)
        row["compile_peak_mb"] = footprint_mb(start)
        del compiled, net
        torch._dynamo.reset()
        torch.cuda.empty_cache()

    if "nimble_ms" in row:
        row["speedup_vs_eager"] = row["eager_ms"] / row["nimble_ms"]
    return row


def eager_timed(base, batch: int, size: int, bf16: bool, iters: int, channels_last: bool = False):
    """Eager training of a copy of `base` (in channels_last memory order with `channels_last`): its
    first losses, median ms per step (None with `iters` 0) and peak MiB."""
    import torch

    start = footprint_start()
    net = copy.deepcopy(base)
    if channels_last:
        net = net.to(memory_format=torch.channels_last)
    step, last = stepper(net, net.parameters(), batch, size, bf16, channels_last=channels_last)
    losses = first_losses(step, last)
    return losses, median_ms(step, iters) if iters else None, footprint_mb(start)


def rel_diffs(losses: list[float], reference: list[float]) -> list[float]:
    return [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference)]


def issue_ms(call, n: int = 20) -> float:
    """The host's median ms to issue one call, not waiting for the GPU (a step whose issue time
    is near its wall time is bound by the host, not the GPU)."""
    import statistics

    import torch

    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        call()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def footprint_start() -> int:
    """Where a variant's footprint starts: the bytes allocated before it is built (the peak
    counter starts again there)."""
    import gc

    import torch

    gc.collect()  # the variant before may sit in a reference cycle: its graph pool would still be reserved,
    # and the next variant's allocations would land in it once collected, unseen (torch.compile's
    # peak read 78 MiB for efficientnet_b0 at batch 32 after TrainStep's row, 2026-11-30)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_reserved()


def footprint_mb(start: int) -> float:
    """A variant's peak GPU memory since `footprint_start`, in MiB, less what was reserved before
    it: its copy of the weights, gradients, optimizer state, activations, arena and graph pools.
    Reserved, not allocated, memory: torch.compile's CUDA graph trees keep their tensors in a pool
    that `max_memory_allocated` does not count (it gave 9 MiB for mobilenet_v2's whole step)."""
    import torch

    torch.cuda.synchronize()
    return (torch.cuda.max_memory_reserved() - start) / 2**20


def _ms(r: dict, key: str, fmt: str = "{:.2f}") -> str:
    return fmt.format(r[key]) if r.get(key) is not None else "n/a"


def summary(rows: list[dict], meta: dict) -> str:
    lines = [f"# Training step time ({meta['gpu']}, torch {meta['torch']}, {meta['date']})", "",
             "Median wall ms per full step (zero_grad, forward, cross-entropy, backward, SGD with momentum),",
             "10 classes, synchronized. `python benchmarks/training.py --size S --precision P`. bf16 = eager and",
             "torch.compile under torch.autocast(bfloat16), TrainStep with precision=\"bf16\". nimble =",
             "`prepare(..., training=True)` (fp32 only); TrainStep = `nimble.TrainStep` (one joint graph);",
             "issue = the host's ms to issue one TrainStep call without waiting for the GPU. Peak = a variant's",
             "peak GPU MiB from before it was built to after its timing (its weights, gradients, optimizer",
             f"state, activations, graph pools), less what the process held before it; {meta.get('peak', 'allocated')}",
             "memory (allocated memory misses torch.compile's graph pool: its column is n/a then).", ""]
    order = {m: k for k, m in enumerate(MODELS)}
    rows = sorted(rows, key=lambda r: (r.get("precision", "fp32"), r.get("size", 32), order.get(r["model"], 99),
                                       r["model"], r["batch"]))
    cells = []
    for r in rows:
        ratio = f"{r['step_ms'] / r['compile_ms']:.2f}" if r.get("step_ms") and r.get("compile_ms") else "n/a"
        peaks = " / ".join(_ms(r, k, "{:.0f}") for k in ("eager_peak_mb", "compile_peak_mb", "step_peak_mb"))
        cells.append([r["model"], r.get("size", 32), r["batch"], r.get("precision", "fp32"), _ms(r, "eager_ms"),
                      _ms(r, "compile_ms"), _ms(r, "nimble_ms"),
                      _ms(r, "step_ms") + (f" ({r['step_layout']})" if r.get("step_layout") else ""), ratio,
                      _ms(r, "step_issue_ms"),
                      peaks, _ms(r, "step_prepare_s", "{:.1f}")])
    lines += report.table(["model", "px", "batch", "precision", "eager", "torch.compile", "nimble", "TrainStep",
                           "TrainStep / compile", "TrainStep issue", "peak MiB eager / compile / TrainStep",
                           "TrainStep prepare s"], cells)
    laid = [r for r in rows if "eager_channels_last_ms" in r]
    if laid:
        lines += ["", "Eager with the model and images in channels_last memory order (`--channels-last`; torch.compile "
                  "lays convolutions out so): " + ", ".join(
                      f"{r['model']} b{r['batch']} {r.get('precision', 'fp32')} {r['eager_channels_last_ms']:.2f} ms "
                      f"against {r['eager_ms']:.2f}, peak {r['eager_channels_last_peak_mb']:.0f} MiB" for r in laid) + "."]
    other = [(r, k.removesuffix("_ms")) for r in rows for k in sorted(r)
             if k.startswith("step_") and k.endswith("_ms")
             and k[5:-3].removesuffix("_unfused") in ("auto", "contiguous", "channels_last")]
    if other:
        lines += ["", "TrainStep in another layout (`--step-layouts`), or with aten's batch norms (`--unfused-norms`): "
                  + ", ".join(
            f"{r['model']} b{r['batch']} {r.get('precision', 'fp32')} {r[k + '_layout']}"
            f"{' unfused' if k.endswith('_unfused') else ''} {r[k + '_ms']:.2f} ms, "
            f"peak {r[k + '_peak_mb']:.0f} MiB" for r, k in other) + "."]
    compiled = [r for r in rows if "compile_first_steps_s" in r]
    if compiled:
        lines += ["", "torch.compile time to the first three steps: " + ", ".join(
            f"{r['model']} b{r['batch']} {r['compile_first_steps_s']:.0f} s" for r in compiled) + "."]
    diffs = [r["step_loss_rel_diff"] for r in rows if "step_loss_rel_diff" in r]
    if diffs:
        lines += ["", "Losses of the first three steps from the same weights and batch, TrainStep against eager, "
                  "largest relative difference per step: " +
                  ", ".join(f"{max(d[i] for d in diffs):.1e}" for i in range(len(diffs[0]))) +
                  "; eager against a second eager run: " +
                  ", ".join(f"{max(r['eager_again_loss_rel_diff'][i] for r in rows):.1e}" for i in range(len(diffs[0])))
                  + "."]
    return "\n".join(lines) + "\n"


def _key(r: dict) -> tuple:
    return r["model"], r["batch"], r.get("size", 32), r.get("precision", "fp32")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 64, 128])
    ap.add_argument("--compile-batches", nargs="*", type=int, default=[32])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--size", type=int, default=32, help="input height and width (224: ImageNet-sized)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--no-prepared", action="store_true",
                    help="leave out the older prepare(..., training=True) variants (they take device time)")
    ap.add_argument("--channels-last", action="store_true",
                    help="also time eager with the model and images in channels_last memory order")
    ap.add_argument("--step-layouts", nargs="+", choices=("auto", "contiguous", "channels_last"), default=["auto"],
                    help="TrainStep's layout argument, one row each (the first keeps the keys step_*, the "
                         "others step_<layout>_*)")
    ap.add_argument("--unfused-norms", action="store_true",
                    help="also time each layout with fused_norms=False (batch norm and its activation as aten's "
                         "ops): keys step_<layout>_unfused_*")
    ap.add_argument("--tag", default="")
    ap.add_argument("--report", nargs="+", type=Path, help="merge these JSON files into training.md")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        parts = [json.loads(p.read_text()) for p in args.report]
        merged: dict = {}  # later files add to (and override) earlier rows of the same model, batch, size, precision
        for part in parts:
            for r in part["rows"]:
                if part["meta"].get("peak") != "reserved":  # allocated peaks: torch.compile's graph pool uncounted
                    r = {**r, "compile_peak_mb": None}
                merged.setdefault(_key(r), {}).update(r)
        rows = list(merged.values())
        text = summary(rows, parts[0]["meta"])
        report.write(args.out, "training", text, {"meta": parts[0]["meta"], "rows": rows})
        print(text)
        return

    import torch

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.date.today().isoformat(), "peak": "reserved"}
    rows = []
    for name in args.models:
        for batch in args.batches:
            row = bench_one(name, batch, args.iters, batch in args.compile_batches, args.size, args.precision,
                            not args.no_prepared, args.channels_last, tuple(args.step_layouts), args.unfused_norms)
            print(json.dumps(row), flush=True)
            rows.append(row)
            out = {"meta": meta, "rows": rows}
            report.write(args.out, f"training{args.tag}", doc=out)
    print(summary(rows, meta))


if __name__ == "__main__":
    main()
