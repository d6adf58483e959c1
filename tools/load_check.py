"""Loading real models: compile, then `nimble.load` (preflight included) and `run --check`, per
torchvision model; reports the preflight's share of load time.

    python tools/load_check.py [--device cuda] [--models resnet50 ...] [--all] [--out benchmarks/results]

Each model is traced at batch 1, fp32, eval mode, random weights (no downloads), compiled with
`compile_model` (check off), written, read back, loaded on --device and run on its stored sample;
its outputs are compared with the stored reference. Target (issue 17): the preflight (every op
checked on the meta device before data moves) costs at most 10 % of load time. A model the
compiler does not support is listed with its one-line error.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # report.py, peers.py: the benchmarks'
import report

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nimble import frontend  # noqa: E402
from nimble.errors import NimbleError  # noqa: E402
from nimble.formats import read_artifact, write_artifact  # noqa: E402
from nimble.pipeline import compile_model  # noqa: E402
from nimble.runtime.base.compare import compare, default_tolerance  # noqa: E402
from nimble.runtime.executable import Executable  # noqa: E402
from nimble.specs import input_specs  # noqa: E402

DEFAULT = ["resnet50", "inception_v3", "googlenet", "mobilenet_v2", "efficientnet_b0", "squeezenet1_1",
           "densenet121", "convnext_tiny", "regnet_y_400mf", "shufflenet_v2_x1_0", "mnasnet1_0", "vgg11"]


def check(name: str, device: str, tmp: Path) -> dict:
    import torchvision

    size = 299 if name == "inception_v3" else 224
    kwargs = {"init_weights": True} if name in ("inception_v3", "googlenet") else {}
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, weights=None, **kwargs).eval()
    path = tmp / f"{name}.pt"
    with frontend.quiet_torchscript(), torch.no_grad():
        torch.jit.save(torch.jit.trace(model, torch.randn(1, 3, size, size), check_trace=False), str(path))
    row = {"model": name}
    try:
        compiled = compile_model(path, input_specs([f"1x3x{size}x{size}"]), device=device, check=False)
        write_artifact(tmp / f"{name}.nimble", compiled.artifact())
        t = time.perf_counter()
        exe = Executable(read_artifact(tmp / f"{name}.nimble"), device)
        load = time.perf_counter() - t
        art = exe.artifact
        got = exe.run(*art.sample_inputs)
        if device == "cuda":
            torch.cuda.synchronize()
        result = compare([g.cpu() for g in got], art.sample_outputs, *default_tolerance(device))
        row.update(ops=len(compiled.graph.ops), load_s=load, preflight_s=exe.stats.seconds["preflight"],
                   share=exe.stats.seconds["preflight"] / load, check="ok" if result.passed else result.describe())
    except NimbleError as e:
        row.update(error=str(e)[:200])
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="*", default=DEFAULT)
    parser.add_argument("--all", action="store_true", help="every torchvision classification model")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models) if args.all else args.models
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else platform.machine()
    lines = [f"Load check. {gpu}, torch {torch.__version__}, {datetime.date.today()}, "
             f"`python tools/load_check.py --device {args.device}`. Batch 1, fp32.", "",
             "| model | ops | load (s) | preflight (s) | preflight share | run --check |", "| --- | --- | --- | --- | --- | --- |"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            row = check(name, args.device, Path(tmp))
            rows.append(row)
            if "error" in row:
                lines.append(f"| {name} | | | | | error: {row['error']} |")
            else:
                lines.append(f"| {name} | {row['ops']} | {row['load_s']:.3f} | {row['preflight_s']:.4f} | "
                             f"{100 * row['share']:.1f} % | {row['check']} |")
            print(lines[-1], flush=True)
    done = [r for r in rows if "share" in r]
    worst = max((r["share"] for r in done), default=0.0)
    lines += ["", f"largest preflight share of load time: {100 * worst:.1f} % (target <= 10 %); "
              f"{sum(r['check'] == 'ok' for r in done)} of {len(rows)} models load and pass their check"]
    print(lines[-1])
    report.write(args.out, f"load_check_{args.device}", lines, rows)
    return 0 if worst <= 0.10 and all(r.get("check") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
