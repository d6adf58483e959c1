"""nimble alone under settings of its runtime, side by side in one process: an A/B check of a
runtime setting on models where torch.compile's minutes of compiling are not needed.

    python tools/setting_ab.py --set mean_pairs=False [...] [--models mobilenet_v2 densenet121]
                                    [--batches 8 1] [--rounds 2] [--out DIR]

Per model and batch, one artifact (compiled from TorchScript on the CPU, as `memory_footprint.py`
does) is loaded once as it is and once under each `--set NAME=VALUE` (a runtime setting,
`nimble/runtime/base/settings.py`, as in `peers.py`; each with a tuning and plan cache of its own,
full tuning). The variants are then timed in turn, `--rounds` times, as `peers.py` times them:
GPU-bound (50 back-to-back replays between CUDA events, median of 15) and latency (copy in, run,
synchronize; median of 200); kernels per inference from the captured graph. Every output is
checked against eager PyTorch.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # report.py, peers.py: the benchmarks'
import report
from memory_footprint import compile_artifact
from peers import gpu_bound_ms, kernels_per_inference, make_inputs, setting

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def bench(name: str, batch: int, settings: list, rounds: int, tmp: Path) -> dict:
    import torch

    from nimble.formats import read_artifact
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable

    path = compile_artifact(name, batch, tmp)
    art = read_artifact(path)
    model, xs = make_inputs(name, batch)
    xs = [x.cuda() for x in xs]
    with torch.no_grad():
        want = model.cuda()(*xs)
    wants = list(want) if isinstance(want, (tuple, list)) else [want]  # a Hugging Face model's outputs
    row = {"model": name, "batch": batch, "gpu_bound_ms": {}, "latency_ms": {}, "kernels": {}, "choice": {},
           "check": {}}
    loaded = {}
    for label, chosen in [("as is", None), *((s.describe(), s) for s in settings)]:
        cache = tmp / f"cache_{len(loaded)}"
        with mock.patch.dict(os.environ, {"NIMBLE_CACHE_DIR": str(cache)}):
            exe = Executable(art, "cuda", tune="full", settings=chosen)
            row["kernels"][label] = kernels_per_inference(art, exe.choice, tmp, settings=chosen)
        row["choice"][label] = exe.choice.describe()
        row["check"][label] = compare(exe.run(*xs), wants, 1e-2, 1e-3).max_rel
        loaded[label] = exe
    for _ in range(rounds):  # in turn, so that a drift of the machine touches every variant
        for label, exe in loaded.items():
            row["gpu_bound_ms"].setdefault(label, []).append(gpu_bound_ms(exe.replay))
            row["latency_ms"].setdefault(label, []).append(report.median_ms(lambda: exe(*xs, copy=False)))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", nargs="+", required=True, metavar="NAME=VALUE")
    parser.add_argument("--models", nargs="*", default=["mobilenet_v2", "densenet121"])
    parser.add_argument("--batches", type=int, nargs="*", default=[8, 1])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tag", default="run")
    args = parser.parse_args()
    settings = [setting(t) for t in args.set]
    meta = report.gpu_meta("setting_ab.py")
    rows, lines = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            for batch in args.batches:
                row = bench(name, batch, settings, args.rounds, Path(tmp))
                rows.append(row)
                for label in row["gpu_bound_ms"]:
                    lines.append([name, batch, label, " / ".join(f"{t:.4f}" for t in row["gpu_bound_ms"][label]),
                                  " / ".join(f"{t:.4f}" for t in row["latency_ms"][label]), row["kernels"][label],
                                  row["choice"][label], f"{row['check'][label]:.1e}"])
                print(f"{name} batch {batch}: {row['gpu_bound_ms']}", flush=True)
    text = [f"nimble under runtime settings, one process per run, {meta['gpu']}, torch {meta['torch']}, "
            f"{meta['date']}, fp32 (TF32 convolutions). Command: `{meta['command']}`. GPU-bound ms (50 back-to-back "
            "replays between CUDA events, median of 15) and latency ms (copy in, run, synchronize; median of 200), "
            "one figure per round, the variants timed in turn; check: largest relative error against eager.", "",
            *report.table(["model", "batch", "variant", "GPU-bound ms", "latency ms", "kernels", "choice", "check"],
                          lines)]
    report.write(args.out, f"setting_ab_{args.tag}", text, {"meta": meta, "rows": rows})
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
