"""Fused convolutions as cuDNN graphs that write the arena (`runtime/kernels/cudnn_graph.py`) against
PyTorch's fused kernels, which allocate their results outside it.

    python tools/cudnn_graph.py --out DIR [--models resnet50 inception_v3] [--batches 1 8]

Needs the `cudnn` extra (nvidia-cudnn-frontend). Per model and batch, one fresh process loads the
artifact (default tuning, an empty tuning cache for each) twice: first with the cuDNN graphs turned off
(PyTorch's fused kernels, as without the extra), then on. Each load reports its load seconds, its
GPU footprint by kind (`runtime/base/footprint.py`: growth, results outside the arena) and its tuning
choice; then GPU-bound ms (50 back-to-back replays between CUDA events, median of 15) and latency
ms (copy in, run, synchronize; median of 200) are taken for both loads, alternating, in the same
process. The graphs' counts: convolutions timed, plans chosen, plans that disagreed with PyTorch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # report.py, peers.py: the benchmarks'
import report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CHILD = """
import json, os, sys, time, torch
import nimble
from nimble.formats import read_artifact
from nimble.runtime.base.timing import gpu_ms
from nimble.runtime.kernels import cudnn_graph
sys.path.insert(0, sys.argv[2])
import report
torch.cuda.init()
x = [t.cuda() for t in read_artifact(sys.argv[1]).sample_inputs]
module = cudnn_graph.frontend()
doc, exes = {}, {}
for variant in ("pytorch", "graph"):
    cudnn_graph.cudnn_plans._module = module if variant == "graph" else None
    os.environ["NIMBLE_CACHE_DIR"] = sys.argv[3] + "_" + variant  # each variant times its own tuning choice
    torch.cuda.empty_cache()
    t = time.perf_counter()
    exe = nimble.load(sys.argv[1], device="cuda")
    seconds = time.perf_counter() - t
    f = exe.stats.footprint
    doc[variant] = {"load_s": seconds, "growth": f.growth, "outside_arena": f.outside_arena,
                    "other_allocated": f.other_allocated, "pool_free": f.pool_free, "choice": exe.stats.choice,
                    "outside_values": len(exe.outside_arena()), "gpu_ms": [], "latency_ms": []}
    exes[variant] = exe
doc["graph"]["stats"] = {k: v if k != "failed" else v[:3] for k, v in cudnn_graph.STATS.items()}
for _ in range(2):
    for variant, exe in exes.items():
        doc[variant]["gpu_ms"].append(gpu_ms(exe.replay, torch.device("cuda"), 50, 15, warmup=10))
        doc[variant]["latency_ms"].append(report.median_ms(lambda: exe(*x, copy=True)))
for v in exes:
    doc[v]["gpu_ms"], doc[v]["latency_ms"] = min(doc[v]["gpu_ms"]), min(doc[v]["latency_ms"])
print(json.dumps(doc))
"""


def main() -> int:

    from memory_footprint import compile_artifact

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "inception_v3"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    meta = report.gpu_meta("cudnn_graph.py")
    rows, body = [], []
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            for batch in args.batches:
                path = compile_artifact(name, batch, Path(tmp))
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
                proc = subprocess.run([sys.executable, "-c", CHILD, str(path), str(ROOT / "benchmarks"),
                                       str(Path(tmp) / f"cache_{name}_{batch}")],
                                      capture_output=True, text=True, check=False, env=env)
                if proc.returncode != 0:
                    print(f"{name} {batch}: {(proc.stderr.strip().splitlines() or ['?'])[-1][:300]}", flush=True)
                    continue
                doc = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append({"model": name, "batch": batch, **doc})
                print(json.dumps(rows[-1]), flush=True)
                for v in ("pytorch", "graph"):
                    d = doc[v]
                    body.append([name, batch, v, d["choice"], f"{d['load_s']:.2f}", f"{d['growth'] / mib:.1f}",
                                 f"{d['outside_arena'] / mib:.1f}", d["outside_values"], f"{d['gpu_ms']:.4f}",
                                 f"{d['latency_ms']:.4f}",
                                 "" if v == "pytorch" else "{timed}/{chosen}/{rejected}".format(**d["stats"])])
    lines = [f"{meta['gpu']}, torch {meta['torch']}, fp32 (TF32 convolutions), {meta['date']}. Command: "
             f"`{meta['command']}`. One process per row pair; `pytorch` = PyTorch's fused convolutions "
             "(the graphs off), `graph` = cuDNN graphs where chosen. MiB; ms.", "",
             *report.table(["model", "batch", "fused convolutions", "tuning choice", "load s", "growth MiB",
                            "outside arena MiB", "values outside", "GPU-bound ms", "latency ms",
                            "timed/chosen/rejected"], body)]
    print("\n".join(lines))
    report.write(args.out, "cudnn_graph", lines, {**meta, "rows": rows})
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
