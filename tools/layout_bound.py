"""How much could choosing the layout per convolution gain over choosing it per model? An upper
bound, measured on a GPU machine:

    python tools/layout_bound.py --models resnet50 mobilenet_v2 --batches 1 8 --out DIR

nimble chooses one layout per model at load (`tuning.LAYOUTS`). Choosing per op instead would
run each op in the layout its kernels are fastest in, and pay a conversion wherever two
neighbours differ. This script loads each model twice, forced onto the same choice but for the
layout (`--settings`: streams, algorithms, convolutions, GEMM bias, prologues), and attributes
every kernel of each to the op that launched it (`kernel_diff.attribute`, REPS inferences). Then:

- per model: kernel time per inference in each layout, and the GPU-bound time of each (50
  back-to-back replays between CUDA events, median of 15, as peers.py measures);
- per op: the better layout's kernel time. Their sum, with no conversion paid anywhere, is the
  least kernel time any per-op choice of layout could reach. `bound` is how much less that is
  than the better whole-model layout: per-op layout can gain at most that much kernel time.
- the ops where the other layout wins most.

Kernel times are sums of kernel durations (no gaps, no stream overlap). An op whose work another
op's kernel does in one layout (a fused pair) counts 0 there, so the bound is loose, never tight.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # report.py, peers.py: the benchmarks'
import report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernel_diff import REPS, attribute  # noqa: E402

SETTINGS = "planned,benchmark,cudnn-fused,epilogue,apart"


def per_op_ms(ours: list[dict], owner: list) -> tuple[dict[int, float], float]:
    """Kernel ms per inference of each op that launched kernels, and of the kernels of no known op."""
    ms: dict = defaultdict(float)
    unknown = 0.0
    for k, op in zip(ours, owner):
        if op is None:
            unknown += k["dur"] / 1000 / REPS
        else:
            ms[op] += k["dur"] / 1000 / REPS
    return dict(ms), unknown


def bound(per_layout: dict[str, dict[int, float]], unknown: dict[str, float]) -> dict:
    """The figures of one model from each layout's kernel ms per op (see the module docstring):
    totals per layout, the sum of per-op minima (the kernels of no known op count as in the better
    layout), and the fraction of the better total the per-op choice could save."""
    totals = {layout: sum(ms.values()) + unknown[layout] for layout, ms in per_layout.items()}
    best = min(totals, key=totals.get)
    ops = set().union(*per_layout.values())
    per_op = sum(min(ms.get(op, 0.0) for ms in per_layout.values()) for op in ops) + unknown[best]
    return {"kernel_ms": totals, "best_layout": best, "per_op_best_ms": per_op,
            "bound": 1 - per_op / totals[best] if totals[best] else 0.0}


def bound_one(name: str, batch: int, tmp: Path, settings: str) -> dict:
    import torch

    from nimble.formats import read_artifact, write_artifact
    from nimble.frontend import quiet_torchscript
    from nimble.pipeline import compile_model
    from nimble.runtime.executable import Executable
    from nimble.runtime.trace import op_label
    from nimble.runtime.tune.choices import LAYOUTS, choice_of
    from nimble.specs import input_specs
    from peers import gpu_bound_ms, make_inputs

    model, xs_cpu = make_inputs(name, batch)
    with quiet_torchscript():
        pt = tmp / f"{name}_{batch}.pt"
        torch.jit.save(torch.jit.trace(model.eval(), tuple(xs_cpu), check_trace=False), str(pt))
    specs = input_specs(["x".join(map(str, x.shape)) for x in xs_cpu],
                        [str(x.dtype).removeprefix("torch.") for x in xs_cpu])
    path = tmp / f"{name}_{batch}.nimble"
    write_artifact(path, compile_model(pt, specs, device="cpu").artifact())
    xs = [x.cuda() for x in xs_cpu]
    row = {"model": name, "batch": batch, "settings": settings, "gpu_bound_ms": {}, "kernels": {}}
    per_layout, unknown, labels = {}, {}, {}
    for layout in LAYOUTS:
        exe = Executable(read_artifact(path), "cuda", choice=choice_of(f"{layout},{settings}"))
        exe.run(*xs)
        row["gpu_bound_ms"][layout] = gpu_bound_ms(exe.replay)
        ours, owner = attribute(exe, tmp, f"{name}_{batch}_{layout}")
        row["kernels"][layout] = len(ours) // REPS
        per_layout[layout], unknown[layout] = per_op_ms(ours, owner)
        labels = {i: op_label(op) for i, op in enumerate(exe.graph.ops)}
        exe.close()
    row |= bound(per_layout, unknown)
    other = next(layout for layout in LAYOUTS if layout != row["best_layout"])
    wins = {op: per_layout[row["best_layout"]].get(op, 0.0) - ms for op, ms in per_layout[other].items()}
    row["other_layout_wins"] = [{"op": op, "label": labels[op],
                                 "ms": {lay: per_layout[lay].get(op, 0.0) for lay in LAYOUTS}}
                                for op, gain in sorted(wins.items(), key=lambda kv: -kv[1])[:8] if gain > 0]
    print(row, flush=True)
    return row


def table(rows: list[dict], meta: dict) -> list[str]:
    lines = [f"Layout per op against per model: an upper bound (`tools/layout_bound.py`). {meta['gpu']}, "
             f"torch {meta['torch']}, fp32 with TF32 convolutions, {meta['date']}. Both loads forced onto "
             f"the same choice but for the layout. Kernel ms = sum of kernel durations per inference; "
             f"GPU-bound = 50 back-to-back replays between CUDA events, median of 15.", ""]
    lines += report.table(
        ["model", "batch", "kernel ms NCHW", "kernel ms NHWC", "per-op best, no conversions", "bound",
         "GPU-bound NCHW", "GPU-bound NHWC"],
        [[r["model"], r["batch"], f"{r['kernel_ms']['contiguous']:.3f}", f"{r['kernel_ms']['channels_last']:.3f}",
          f"{r['per_op_best_ms']:.3f}", f"{100 * r['bound']:.1f} %", f"{r['gpu_bound_ms']['contiguous']:.3f}",
          f"{r['gpu_bound_ms']['channels_last']:.3f}"] for r in rows])
    for r in rows:
        if r["other_layout_wins"]:
            lines += ["", f"{r['model']} batch {r['batch']}: ops faster outside the model's better layout "
                          f"({r['best_layout']}), kernel ms NCHW / NHWC:"]
            lines += [f"- op {w['op']} {w['label']}: {w['ms']['contiguous']:.4f} / {w['ms']['channels_last']:.4f}"
                      for w in r["other_layout_wins"]]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1])
    parser.add_argument("--settings", default=SETTINGS,
                        help=f"the choice's fields after the layout: STREAMS,ALGORITHMS,CONVOLUTIONS,GEMM_BIAS,"
                             f"PROLOGUES (default {SETTINGS})")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tag", default="run")
    args = parser.parse_args()
    from nimble.runtime.tune.choices import LAYOUTS, choice_of

    if choice_of(f"{LAYOUTS[0]},{args.settings}") is None:
        parser.error(f"--settings {args.settings!r} are no load-time choice's fields; see --help")
    import torch

    torch.backends.cudnn.allow_tf32 = True
    meta = report.gpu_meta("layout_bound.py")
    rows = report.each_row(args.models, args.batches,
                           lambda name, batch, tmp: bound_one(name, batch, tmp, args.settings))
    lines = table(rows, meta)
    report.write(args.out, f"layout_bound_{args.tag}", lines, {"meta": meta, "rows": rows})
    print("\n".join(lines))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
