"""Training step time on a GPU: nimble against eager PyTorch and torch.compile, fp32.

    python benchmarks/training.py --out DIR [--models mobilenet_v2 ...] [--batches 32 64 128]
                                  [--compile-batches 32]
    python benchmarks/training.py --report DIR/training_*.json --out benchmarks/results  # no GPU

Models are torchvision's MobileNetV2, EfficientNet-B0 and ResNet-50 with 10 classes on
CIFAR-sized 32x32 inputs. A step is zero_grad, forward, cross-entropy, backward and an SGD step
with momentum (torch.optim, foreach), as a user writes it. Every variant starts from the same
weights; the figure is the median wall time of one step, synchronized, after a warm-up.

Variants: eager; nimble with the auto schedule and with one stream (`prepare(..., streams=1)`);
`nimble.TrainStep` (the joint forward-backward graph, its ops run one after another on the GPU,
not yet captured; the same SGD, fused);
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


def stepper(model, params, batch: int, before=None):
    """One training step of `model` (a callable) over `params`, on fixed random data."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, device="cuda", generator=gen)
    y = torch.randint(0, 10, (batch,), device="cuda", generator=gen)
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    last = {}

    def step():
        if before:
            before()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        last["loss"] = loss

    return step, last


def bench_one(name: str, batch: int, iters: int, compile_it: bool) -> dict:
    import nimble
    import torch
    import torchvision

    torch.manual_seed(0)
    base = getattr(torchvision.models, name)(weights=None, num_classes=10).cuda().train()
    row: dict = {"model": name, "batch": batch}

    eager = copy.deepcopy(base)
    step, last = stepper(eager, eager.parameters(), batch)
    eager_losses = first_losses(step, last)
    row["eager_ms"] = median_ms(step, iters)
    again = copy.deepcopy(base)  # the control: eager against itself, same weights and batch
    step, last = stepper(again, again.parameters(), batch)
    row["eager_again_loss_rel_diff"] = [abs(a - b) / max(abs(b), 1e-12)
                                        for a, b in zip(first_losses(step, last), eager_losses)]
    del again

    for streams in ("auto", 1):
        net = copy.deepcopy(base)
        t = time.perf_counter()
        model = nimble.Nimble(net).prepare(torch.randn(batch, 3, 32, 32, device="cuda"), training=True,
                                           streams=streams)
        torch.cuda.synchronize()
        key = "nimble" if streams == "auto" else "nimble_1stream"
        row[f"{key}_prepare_s"] = time.perf_counter() - t
        runner = model._runner
        row[f"{key}_streams"] = runner.schedule.num_streams
        step, last = stepper(model, net.parameters(), batch)
        losses = first_losses(step, last)
        row[f"{key}_loss_rel_diff"] = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, eager_losses)]
        row[f"{key}_ms"] = median_ms(step, iters)
        row[f"{key}_forward_ms"] = median_ms(runner.fwd_graph.replay, iters)
        row[f"{key}_backward_ms"] = median_ms(runner.bwd_graph.replay, iters)
        del model, runner, net
        torch.cuda.empty_cache()

    net = copy.deepcopy(base)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, device="cuda", generator=gen)
    y = torch.randint(0, 10, (batch,), device="cuda", generator=gen)
    t = time.perf_counter()
    train = nimble.TrainStep(net, torch.nn.functional.cross_entropy, x, y,
                             optimizer=torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=True))
    torch.cuda.synchronize()
    row["step_prepare_s"] = time.perf_counter() - t
    losses = []
    for i in range(3):
        torch.manual_seed(i)
        losses.append(train(x, y).item())
    row["step_loss_rel_diff"] = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, eager_losses)]
    row["step_ms"] = median_ms(lambda: train(x, y), iters)
    train = net = None  # dropped before the next variant (rebound, not deleted: the lambda names it)
    torch.cuda.empty_cache()

    if compile_it:
        net = copy.deepcopy(base)
        compiled = torch.compile(net, mode="reduce-overhead")
        step, _ = stepper(compiled, net.parameters(), batch, before=torch.compiler.cudagraph_mark_step_begin)
        t = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        row["compile_first_steps_s"] = time.perf_counter() - t
        row["compile_ms"] = median_ms(step, iters)
        del compiled, net
        torch._dynamo.reset()
        torch.cuda.empty_cache()

    row["speedup_vs_eager"] = row["eager_ms"] / row["nimble_ms"]
    return row


def summary(rows: list[dict], meta: dict) -> str:
    lines = [f"# Training step time ({meta['gpu']}, torch {meta['torch']}, {meta['date']})", "",
             "Median ms per full step (zero_grad, forward, cross-entropy, backward, SGD with momentum), fp32,",
             "32x32 inputs, 10 classes. `python benchmarks/training.py`. nimble = `prepare(..., training=True)`",
             "with the auto schedule; 1-stream = `streams=1`. fwd/bwd = the captured graphs replayed alone.", "",
             "TrainStep = `nimble.TrainStep` (one joint graph, its ops issued one by one, not captured).", "",
             "| model | batch | eager | torch.compile | nimble | nimble 1-stream | TrainStep | × eager | target | "
             "fwd auto / 1 | bwd auto / 1 | streams | prepare s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = sorted(rows, key=lambda r: (MODELS.index(r["model"]) if r["model"] in MODELS else len(MODELS), r["batch"]))
    for r in rows:
        target = TARGETS.get((r["model"], r["batch"]))
        met = "" if target is None else f"≥ {target} ({'met' if r['speedup_vs_eager'] >= target else 'missed'})"
        comp = f"{r['compile_ms']:.2f}" if "compile_ms" in r else "n/a"
        step = f"{r['step_ms']:.2f}" if "step_ms" in r else "n/a"  # rows from before TrainStep have none
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['eager_ms']:.2f} | {comp} | {r['nimble_ms']:.2f} | "
            f"{r['nimble_1stream_ms']:.2f} | {step} | {r['speedup_vs_eager']:.2f} | {met} | "
            f"{r['nimble_forward_ms']:.2f} / {r['nimble_1stream_forward_ms']:.2f} | "
            f"{r['nimble_backward_ms']:.2f} / {r['nimble_1stream_backward_ms']:.2f} | {r['nimble_streams']} | "
            f"{r['nimble_prepare_s']:.1f} |")
    compiled = [r for r in rows if "compile_first_steps_s" in r]
    if compiled:
        lines += ["", "torch.compile time to the first three steps: " + ", ".join(
            f"{r['model']} b{r['batch']} {r['compile_first_steps_s']:.0f} s" for r in compiled) + "."]
    diffs = [r[k] for r in rows for k in ("nimble_loss_rel_diff", "nimble_1stream_loss_rel_diff")]
    lines += ["", "Losses of the first three steps from the same weights and batch, nimble against eager, "
              "largest relative difference per step: " + ", ".join(f"{max(d[i] for d in diffs):.1e}"
                                                                   for i in range(len(diffs[0]))) +
              ". The first is the forward alone; later steps add the updates' rounding (TF32 "
              "convolutions, as PyTorch defaults). Eager against a second eager run: " +
              ", ".join(f"{max(r['eager_again_loss_rel_diff'][i] for r in rows):.1e}" for i in range(len(diffs[0]))) +
              "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 64, 128])
    ap.add_argument("--compile-batches", nargs="*", type=int, default=[32])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--tag", default="")
    ap.add_argument("--report", nargs="+", type=Path, help="merge these JSON files into training.md")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        parts = [json.loads(p.read_text()) for p in args.report]
        merged: dict = {}  # later files add to (and override) earlier rows of the same model and batch
        for part in parts:
            for r in part["rows"]:
                merged.setdefault((r["model"], r["batch"]), {}).update(r)
        rows = list(merged.values())
        text = summary(rows, parts[0]["meta"])
        report.write(args.out, "training", text, {"meta": parts[0]["meta"], "rows": rows})
        print(text)
        return

    import torch

    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.date.today().isoformat()}
    rows = []
    for name in args.models:
        for batch in args.batches:
            row = bench_one(name, batch, args.iters, batch in args.compile_batches)
            print(json.dumps(row), flush=True)
            rows.append(row)
            out = {"meta": meta, "rows": rows}
            report.write(args.out, f"training{args.tag}", doc=out)
    print(summary(rows, meta))


if __name__ == "__main__":
    main()
