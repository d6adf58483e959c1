"""Where load to first inference goes: each load in a fresh process, empty caches then warm,
with Python's profiler over the load and first call.

    python tools/load_profile.py ARTIFACT [--runs cold warm warm unkept] [--top 30] [--no-profile]
                                      [--set NAME=VALUE] [--out DIR]

A `unkept` run is a warm one without the per-call kernel choices the loads before kept
(`kernel_choices.json`, `runtime/kernels/recall.py`): it times them again, on warm kernel caches, as
every load did before they were kept.

Prints, per run, the seconds from `nimble.load` to the first result, the stage seconds the load
reports (`exe.stats.seconds`), the tuning outcome, the cuDNN graph counts where the `cudnn` extra
is installed, and the `--top` functions by cumulative time, then by time spent in each. The
caches (nimble's and Triton's) are a temporary folder shared by the runs, so a cold run empties
them and the runs after it are warm. `--no-profile` times the same runs without the profiler,
which adds to every figure: those are the seconds to quote. Each row also says whether the load
imported Triton. `--set` loads under a runtime setting in every run (`nimble/runtime/base/
settings.py`, as `peers.py --set` does), to compare a change with the load before it.
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
from peers import setting

PROBE = """
import cProfile, importlib, io, json, pstats, sys, time
import torch
from nimble.runtime.base.settings import Settings
settings = Settings(**json.loads(sys.argv[3]))
from nimble.runtime.opening import load
from nimble.runtime.kernels import cudnn_graph
torch.cuda.init()
profile = cProfile.Profile() if sys.argv[2] != "0" else None
t = time.perf_counter()
if profile is not None:
    profile.enable()
exe = load(sys.argv[1], "cuda", settings=settings)
x = [t.to("cuda") for t in exe.artifact.sample_inputs]  # token ids within the vocabulary, for the language models
exe(*x)
torch.cuda.synchronize()
seconds = time.perf_counter() - t
text = io.StringIO()
if profile is not None:
    profile.disable()
    for order in ("cumulative", "tottime"):
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(int(sys.argv[2]))
stats = {k: v for k, v in cudnn_graph.STATS.items() if k != "failed"}
print(json.dumps({"seconds": seconds, "stages": exe.stats.seconds, "choice": exe.stats.choice,
                  "tuning": exe.stats.tuning, "cudnn_graph": stats, "triton_imported": "triton" in sys.modules,
                  "profile": text.getvalue()}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--runs", nargs="+", default=["cold", "warm", "warm"], choices=["cold", "warm", "unkept"])
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--no-profile", action="store_true", help="time the runs without Python's profiler")
    parser.add_argument("--set", default=None, metavar="NAME=VALUE",
                        help="a runtime setting (nimble/runtime/base/settings.py), changed in every run")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[1]
    settings = setting(args.set).changed() if args.set else {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, NIMBLE_CACHE_DIR=f"{tmp}/nimble", TRITON_CACHE_DIR=f"{tmp}/triton",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH", "")])))
        for label in args.runs:
            if label == "cold":
                subprocess.run(["rm", "-rf", f"{tmp}/nimble", f"{tmp}/triton"], check=True)
            elif label == "unkept":
                Path(f"{tmp}/nimble/kernel_choices.json").unlink(missing_ok=True)
            done = subprocess.run([sys.executable, "-c", PROBE, str(args.artifact),
                                   "0" if args.no_profile else str(max(args.top, 1)), json.dumps(settings)],
                                  env=env,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"the {label} load failed: {done.stderr.strip().splitlines()[-1:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            row["run"] = label
            rows.append(row)
            print(f"{label}: {row['seconds']:.2f} s to the first result; stages "
                  + ", ".join(f"{k} {v:.2f}" for k, v in row["stages"].items())
                  + f"; {row['tuning']}; {row['choice']}; cuDNN graphs {row['cudnn_graph']}"
                  + f"; Triton imported: {row['triton_imported']}")
            print(row["profile"])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"load_profile_{args.artifact.stem}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
