"""`nimble compile` on this machine at two commits, run by turns, so that both see the same noise.

Compile-time targets compare against an earlier day's code ("within 1.2 x of today"), but a
shared CPU builder drifts by more than that margin between sessions (`import torch` alone took
1.41 s one day and 1.74 s another). Here the earlier commit is checked out into a git worktree
and imported through a folder that names it `nimble` first on PYTHONPATH, with its `formats` and
`nimble_cli` folders linked in as `nimble.formats` and `nimble.cli` (before 2026-11-28 those two
came from the current tree, whatever the base: the editable install maps them); each round compiles
every model once with each commit, alternating which goes first, in fresh processes. Reported per
model and commit: the medians of the wall time and of the pipeline's stages as `nimble compile`
prints them (`compile_time.py`'s columns), and the ratio of the current commit's to the base's.
torchvision models are traced here as compile_time.py traces them. Writes compile_ab_<tag>.md and
.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # report.py, peers.py: the benchmarks'
import report
from compile_time import STAGES, TORCHVISION, _TIME_LINE, by_stage

ROOT = Path(__file__).resolve().parents[1]
NIMBLE = [sys.executable, "-c", "from nimble.cli.entry import main; main()"]


def traced(folder: Path, names: list[str]) -> list[tuple[str, Path, str]]:
    """(name, TorchScript file, --shape) of each torchvision model, traced into `folder`."""
    import torch

    from zoo import import_torchvision

    tv = import_torchvision()
    out = []
    for name in names:
        size = TORCHVISION.get(name, 224)
        path = folder / f"{name}.pt"
        torch.manual_seed(0)
        model = getattr(tv.models, name)(weights=None).eval()
        with torch.no_grad():
            torch.jit.save(torch.jit.trace(model, torch.randn(1, 3, size, size), check_trace=False), str(path))
        out.append((name, path, f"1x3x{size}x{size}"))
    return out


def compile_once(path: Path, shape: str, env: dict, folder: Path) -> dict:
    """One `nimble compile` in a fresh process: wall seconds and the pipeline's stage seconds."""
    cmd = NIMBLE + ["compile", str(path), "--device", "cpu", "--shape", shape, "-o", str(folder / "m.nimble")]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=folder)
    wall = time.perf_counter() - t
    found = _TIME_LINE.search(proc.stderr)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"compile failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1][:200]}")
    stages = by_stage({k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", found.group(1))})
    return {"wall": wall, **stages, "pipeline": sum(stages.get(k, 0.0) for k in STAGES)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--models", nargs="+", default=list(TORCHVISION))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                          check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = tmp / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            shim = tmp / "shim"
            shim.mkdir()
            (shim / "nimble").symlink_to(base / "core", target_is_directory=True)
            for package, folder in (("formats", "formats"), ("cli", "nimble_cli")):  # nimble.formats and
                (base / "core" / package).symlink_to(base / folder, target_is_directory=True)  # nimble.cli too
            envs = {head: dict(os.environ),
                    args.base: dict(os.environ, PYTHONPATH=os.pathsep.join(
                        [str(shim), *filter(None, [os.environ.get("PYTHONPATH")])]))}
            for rev, env in envs.items():  # which code each one imports
                where = subprocess.run([sys.executable, "-c", "import nimble.formats, nimble.cli; print(*(m.__file__ "
                                        "for m in (nimble, nimble.formats, nimble.cli)))"],
                                       capture_output=True, text=True, env=env, cwd=tmp, check=True).stdout.strip()
                print(f"{rev}: nimble, nimble.formats and nimble.cli from {where}", flush=True)
            models = traced(tmp, args.models)
            runs: dict[tuple[str, str], list[dict]] = {}
            for k in range(args.rounds):
                order = list(envs) if k % 2 == 0 else list(envs)[::-1]
                for name, path, shape in models:
                    for rev in order:
                        runs.setdefault((name, rev), []).append(compile_once(path, shape, envs[rev], tmp))
                print(f"round {k + 1} of {args.rounds} done", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    rows = []
    for name, _, _ in models:
        medians = {rev: {key: statistics.median(r.get(key, 0.0) for r in runs[name, rev])
                         for key in ("wall", "pipeline", *STAGES)} for rev in envs}
        rows.append({"model": name, "rounds": args.rounds, "base": args.base, "head": head, **{
            f"{key} {label}": round(medians[rev][key], 3) for rev, label in ((args.base, "base"), (head, "now"))
            for key in ("wall", "pipeline", *STAGES)},
            "wall ratio": round(medians[head]["wall"] / medians[args.base]["wall"], 3),
            "pipeline ratio": round(medians[head]["pipeline"] / max(medians[args.base]["pipeline"], 1e-9), 3)})
        print(json.dumps(rows[-1]), flush=True)
    columns = ["model", "wall base", "wall now", "wall ratio", "pipeline base", "pipeline now", "pipeline ratio",
               *(f"{s} {label}" for s in STAGES for label in ("base", "now"))]
    header = (f"`nimble compile` on the CPU at {args.base} (base) and {head} (now), by turns, "
              f"{datetime.date.today()}, torch {__import__('torch').__version__}. Command: "
              f"`python tools/compile_ab.py --base {args.base} --models {' '.join(args.models)} "
              f"--rounds {args.rounds}`. Medians of {args.rounds} fresh processes each, seconds.")
    report.write(args.out, f"compile_ab_{args.tag}", [header, "", *report.table(columns, [[r[c] for c in columns]
                                                                                      for r in rows])], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
