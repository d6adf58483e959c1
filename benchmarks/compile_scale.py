"""Compile time, peak memory, load time and `run --check` time as graphs grow (CPU).

    python benchmarks/compile_scale.py [--ops 1000 5000 12000 50000] [--shapes deep wide] [--timeout 600]
                                       [--out benchmarks/results]

Two synthetic TorchScript models, traced once per size in a process of their own (untimed):
- deep: a chain of blocks, each a three-way fork and join on a 1x32 input
  (relu(x*a + x*b + x*c) * 0.3: 7 ops), so the widest level is 3;
- wide: blocks of eight parallel branches joined by a sum (17 ops each).

Each size is then measured in a fresh process: compile (`--no-fuse`, so the op count is what the
planner sees, checked on the CPU) and write the artifact, then load it, then `run --check`.
Reported: the op count, each compile stage as `nimble compile` prints it (write included), the
compile's total and peak RSS, the streams auto chose, which lower bound the plan carries, the
load time (read, validate, preflight: `Executable` ready) and the `run --check` time. A size that
passes --timeout is reported as such.
Writes compile_scale.md and compile_scale.json to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import report

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time, warnings
import torch
warnings.simplefilter("ignore")
kind, blocks, folder, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

class Deep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Parameter(torch.randn(32) * 0.1 + 1) for _ in range(3))
    def forward(self, x):
        return torch.relu(x * self.a + x * self.b + x * self.c) * 0.3

class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(32) * 0.1 + 0.2) for _ in range(8)])
    def forward(self, x):
        total = x * self.w[0]
        for w in self.w[1:]:
            total = total + x * w
        return torch.relu(total) * 0.6

if mode == "build":
    model = torch.nn.Sequential(*[(Deep if kind == "deep" else Wide)() for _ in range(blocks)]).eval()
    with torch.no_grad():
        torch.jit.save(torch.jit.trace(model, torch.randn(1, 32)), f"{folder}/m.pt")
    sys.exit(0)

from nimble.formats import read_artifact, write_artifact
from nimble.pipeline import compile_model
from nimble.runtime.base.compare import compare
from nimble.runtime.executable import Executable
from nimble.specs import input_specs

t = time.perf_counter()
c = compile_model(f"{folder}/m.pt", input_specs(["1x32"]), device="cpu", fuse=False)
w = time.perf_counter()
write_artifact(f"{folder}/m.nimble", c.artifact())
compile_s = time.perf_counter() - t
c.seconds["write"] = time.perf_counter() - w
compile_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t = time.perf_counter()
art = read_artifact(f"{folder}/m.nimble")
exe = Executable(art, "cpu")
load_s = time.perf_counter() - t
t = time.perf_counter()
ok = compare(exe.run(*art.sample_inputs), art.sample_outputs, 1e-4, 1e-5).passed
check_s = time.perf_counter() - t
print(json.dumps({"ops": len(c.graph.ops), "stages_s": c.seconds, "compile_s": compile_s,
                  "compile_peak_rss_mb": compile_rss, "lower_bound": c.memory.lower_bound,
                  "streams": c.schedule.num_streams, "max_width": c.schedule.max_width, "load_s": load_s,
                  "run_check_s": check_s, "check_passed": ok,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

OPS_PER_BLOCK = {"deep": 7, "wide": 17}


def one(kind: str, ops: int, timeout: float) -> dict:
    blocks = max(1, round(ops / OPS_PER_BLOCK[kind]))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for mode in ("build", "measure"):  # the model is traced in a process of its own, untimed
                proc = subprocess.run([sys.executable, "-c", CHILD, kind, str(blocks), tmp, mode], capture_output=True,
                                      text=True, timeout=timeout, cwd=ROOT)
                if proc.returncode != 0:
                    break
        except subprocess.TimeoutExpired:
            return {"shape": kind, "target_ops": ops, "error": f"over the {timeout:.0f} s timeout"}
    if proc.returncode != 0:
        return {"shape": kind, "target_ops": ops, "error": proc.stderr.strip().splitlines()[-1][:200]}
    return {"shape": kind, "target_ops": ops, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, nargs="*", default=[1000, 5000, 12000, 50000])
    parser.add_argument("--shapes", nargs="*", default=["deep", "wide"], choices=sorted(OPS_PER_BLOCK))
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    import torch

    meta = {"torch": torch.__version__, "date": str(datetime.date.today()), "threads": torch.get_num_threads(),
            "command": "python benchmarks/compile_scale.py " + " ".join(sys.argv[1:])}
    rows = []
    for kind in args.shapes:
        for ops in args.ops:
            rows.append(one(kind, ops, args.timeout))
            print(json.dumps(rows[-1]), flush=True)
    lines = [f"Compile at scale on the CPU builder ({meta['threads']} threads), torch {meta['torch']}, {meta['date']}. "
             f"Command: `{meta['command']}`. Seconds; compiled with --no-fuse and checked on the CPU.", "",
             "| shape | ops | load | lower | check | schedule | memory | write | compile total | compile peak RSS MB "
             "| streams (auto) | widest level | lower bound | artifact load | run --check |", "|" + " --- |" * 15]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | ~{r['target_ops']} | {r['error']} |" + " |" * 12)
            continue
        s = r["stages_s"]
        lines.append(f"| {r['shape']} | {r['ops']} | {s['load']:.2f} | {s['lower']:.2f} | {s['check']:.2f} | "
                     f"{s['schedule']:.2f} | {s['memory']:.2f} | {s['write']:.2f} | {r['compile_s']:.2f} | "
                     f"{r['compile_peak_rss_mb']:.0f} | {r['streams']} | {r['max_width']} | {r['lower_bound']} | "
                     f"{r['load_s']:.2f} | {r['run_check_s']:.2f} |")
    report.write(args.out, "compile_scale", lines, {"meta": meta, "rows": rows})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
