"""How long `nimble compile` takes, end to end and by stage, on this machine.

    python benchmarks/compile_time.py [--device auto|cpu|cuda] [--repeat 3] [--zoo | --zoo-only]
                                      [--out benchmarks/results] [--tag cpu]

For the sample models and torchvision's resnet50, inception_v3 and efficientnet_b0 (random
weights, traced once, untimed), each `nimble compile` runs as a user runs it: a fresh process
through the console entry point, --repeat times. Reported, as medians:
- wall: the whole command, interpreter start included;
- `python -c "import torch"` on its own, the floor of any command that uses torch;
- each stage that compile prints (load, lower, check, schedule, memory, write) and their sum, the
  pipeline;
- wall minus the pipeline: interpreter, imports and the CLI.

--zoo adds every torchvision classification model (zoo.py's list, less its skipped ones), timed
in one process by stage only (no interpreter start per model), with each model's slowest single
pass, for the "every model" targets (no pass over 0.2 s).
torchvision beside a CPU torch is imported as zoo.py does. Writes compile_time_<tag>.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "sample_models"))

NIMBLE = [sys.executable, "-c", "from nimble.cli.entry import main; main()"]
TORCHVISION = {"resnet50": 224, "inception_v3": 299, "efficientnet_b0": 224}
STAGES = ("load", "lower", "passes", "check", "schedule", "memory", "write")  # "passes": every pass's stage


def by_stage(seconds: dict[str, float]) -> dict[str, float]:
    """The STAGES columns of `nimble compile`'s stage times: each pass's time summed under "passes"."""
    return {k: v for k, v in seconds.items() if k in STAGES} | {
        "passes": sum(v for k, v in seconds.items() if k not in STAGES)}
_TIME_LINE = re.compile(r"time: (.*?); total")


def _seconds(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    return time.perf_counter() - t, proc


def import_torch_seconds(repeat: int) -> float:
    return statistics.median(_seconds([sys.executable, "-c", "import torch"])[0] for _ in range(repeat))


def models(folder: Path) -> list[tuple[str, Path, list[str]]]:
    """(name, TorchScript file, --shape values): the samples as shipped, torchvision traced here."""
    import torch

    from build import MODELS
    from zoo import import_torchvision

    out = [(name, ROOT / "sample_models" / f"{name}.pt", ["x".join(map(str, s)) for s in shapes])
           for name, (_, shapes, _) in MODELS.items()]
    tv = import_torchvision()
    for name, size in TORCHVISION.items():
        path = folder / f"{name}.pt"
        torch.manual_seed(0)
        model = getattr(tv.models, name)(weights=None).eval()
        with torch.no_grad():
            torch.jit.save(torch.jit.trace(model, torch.randn(1, 3, size, size), check_trace=False), str(path))
        out.append((name, path, [f"1x3x{size}x{size}"]))
    return out


def time_cli(name: str, path: Path, shapes: list[str], device: str, repeat: int, folder: Path) -> dict:
    runs = []
    for _ in range(repeat):
        cmd = NIMBLE + ["compile", str(path), "--device", device, "-o", str(folder / f"{name}.nimble")]
        for s in shapes:
            cmd += ["--shape", s]
        wall, proc = _seconds(cmd)
        found = _TIME_LINE.search(proc.stderr)
        if proc.returncode != 0 or not found:
            return {"model": name, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}
        stages = by_stage({k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", found.group(1))})
        runs.append({"wall": wall, **stages, "pipeline": sum(stages.get(k, 0.0) for k in STAGES)})
    median = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
    return {"model": name, "runs": len(runs), **median, "outside_pipeline": median["wall"] - median["pipeline"]}


def time_zoo(device: str) -> list[dict]:
    """Every torchvision classification model zoo.py compiles, by stage, in this one process."""
    import torch

    from nimble.pipeline import compile_model
    from nimble.specs import input_specs
    from zoo import SHAPE, SKIP, import_torchvision

    tv = import_torchvision()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(tv.models.list_models(module=tv.models)):
            if name in SKIP:
                continue
            size = SHAPE.get(name, (1, 3, 224))[-1]
            torch.manual_seed(0)
            try:
                model = tv.models.get_model(name, weights=None).eval()
                with torch.no_grad():
                    torch.jit.save(torch.jit.trace(model, torch.randn(1, 3, size, size), check_trace=False),
                                   f"{tmp}/m.pt")
            except Exception as e:  # not traceable at all: zoo.py reports these
                rows.append({"model": name, "error": f"not traced: {str(e).splitlines()[0][:120]}"})
                continue
            try:
                c = compile_model(f"{tmp}/m.pt", input_specs([f"1x3x{size}x{size}"]), device=device)
            except Exception as e:
                rows.append({"model": name, "error": str(e).splitlines()[0][:200]})
                continue
            passes = {k: v for k, v in c.seconds.items() if k not in STAGES}
            slowest = max(passes, key=passes.get, default="")
            rows.append({"model": name, "ops": len(c.graph.ops), **by_stage(c.seconds), "pipeline": sum(c.seconds.values()),
                         "slowest_pass": slowest, "slowest_pass_s": passes.get(slowest, 0.0)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--zoo", action="store_true", help="also every torchvision classification model, by stage")
    parser.add_argument("--zoo-only", action="store_true", help="only the --zoo part (another --tag keeps both files)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--tag", default=None, help="file name suffix (default: the device used)")
    args = parser.parse_args()
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    machine = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    tag = args.tag or device
    meta = {"machine": machine, "torch": torch.__version__, "date": str(datetime.date.today()), "device": device,
            "command": "python benchmarks/compile_time.py " + " ".join(sys.argv[1:])}
    floor = import_torch_seconds(args.repeat)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path, shapes in ([] if args.zoo_only else models(Path(tmp))):
            rows.append(time_cli(name, path, shapes, device, args.repeat, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    zoo = time_zoo(device) if args.zoo or args.zoo_only else []
    doc = {"meta": meta, "import_torch_s": floor, "rows": rows, "zoo": zoo}
    lines = [f"`nimble compile` on {machine}, torch {meta['torch']}, check on {device}, {meta['date']}. "
             f"Command: `{meta['command']}`. Medians of {args.repeat} runs, seconds. "
             f'`python -c "import torch"` alone: {floor:.2f} s.', "",
             "| model | wall | outside the pipeline | pipeline | " + " | ".join(STAGES) + " | wall - import torch |",
             "|" + " --- |" * (5 + len(STAGES))]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['error']} |" + " |" * (3 + len(STAGES)))
            continue
        lines.append(f"| {r['model']} | {r['wall']:.2f} | {r['outside_pipeline']:.2f} | {r['pipeline']:.2f} | "
                     + " | ".join(f"{r.get(k, 0.0):.2f}" for k in STAGES) + f" | {r['wall'] - floor:.2f} |")
    if zoo:
        ok = [r for r in zoo if "error" not in r]
        worst = max(ok, key=lambda r: r["pipeline"]) if ok else None
        worst_pass = max(ok, key=lambda r: r.get("slowest_pass_s", 0.0)) if ok else None
        lines += ["", f"Every torchvision classification model, in one process (pipeline without write): "
                      f"{len(ok)} compiled" + (f", slowest {worst['model']} at {worst['pipeline']:.2f} s "
                                               f"({worst['ops']} ops)" if worst else "")
                  + f"; {len(zoo) - len(ok)} failed."
                  + (f" The slowest single pass: {worst_pass['slowest_pass']} on {worst_pass['model']}, "
                     f"{worst_pass['slowest_pass_s']:.3f} s." if worst_pass else ""), "",
                  "| model | ops | pipeline | " + " | ".join(STAGES[:-1]) + " | slowest pass |",
                  "|" + " --- |" * (4 + len(STAGES) - 1)]
        for r in zoo:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['error']} |" + " |" * (2 + len(STAGES) - 1))
            else:
                lines.append(f"| {r['model']} | {r['ops']} | {r['pipeline']:.2f} | "
                             + " | ".join(f"{r.get(k, 0.0):.2f}" for k in STAGES[:-1])
                             + f" | {r.get('slowest_pass', '')} {r.get('slowest_pass_s', 0.0):.3f} |")
    report.write(args.out, f"compile_time_{tag}", lines, doc)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
