"""Arena size against the lower bound, per model, with one stream and with `auto` streams.

    python benchmarks/memory_quality.py [--out benchmarks/results]

Models: the sample models, plus torchvision's resnet50, inception_v3, googlenet, mobilenet_v2,
efficientnet_b0, squeezenet1_1 and densenet121 where torchvision is installed (batch 1, fp32).
Target (issue 4): arena <= 1.10 x lower bound everywhere.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from nimble import frontend  # noqa: E402
from nimble.ir import TensorSpec  # noqa: E402
from nimble.plan.memory import plan  # noqa: E402
from nimble.plan.schedule import assign_streams  # noqa: E402
from sample_models.build import MODELS as SAMPLES  # noqa: E402


def graphs(tmp: Path):
    for name, (_, shapes, _) in SAMPLES.items():
        specs = [TensorSpec(tuple(s), "float32") for s in shapes]
        yield name, frontend.lower(frontend.load_module(ROOT / "sample_models" / f"{name}.pt"), specs, name).graph
    try:
        import torchvision
    except ImportError:
        print("torchvision is not installed: sample models only", file=sys.stderr)
        return
    from frontend_parity import MODELS

    for name, (size, kwargs) in MODELS.items():
        torch.manual_seed(0)
        model = getattr(torchvision.models, name)(weights=None, **kwargs).eval()
        path = tmp / f"{name}.pt"
        with frontend.quiet_torchscript(), torch.no_grad():
            torch.jit.save(torch.jit.trace(model, torch.randn(1, 3, size, size)), str(path))
        yield name, frontend.lower(frontend.load_module(path), [TensorSpec((1, 3, size, size), "float32")], name).graph


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = [f"Arena vs lower bound. {platform.node() or 'machine'}, torch {torch.__version__}, "
             f"{datetime.date.today()}, `python benchmarks/memory_quality.py`. Batch 1, fp32. MiB.", "",
             "| model | ops | streams | arena | lower bound | arena / bound | no reuse | plan time (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name, graph in graphs(Path(tmp)):
            for streams in (1, "auto"):
                schedule = assign_streams(graph, streams)
                t = time.perf_counter()
                m = plan(graph, schedule)
                dt = time.perf_counter() - t
                ratio = m.arena_bytes / max(m.lower_bound_bytes, 1)
                worst = max(worst, ratio)
                lines.append(f"| {name} | {len(graph.ops)} | {schedule.num_streams} ({streams}) | "
                             f"{m.arena_bytes / 2**20:.2f} | {m.lower_bound_bytes / 2**20:.2f} | {ratio:.3f} | "
                             f"{m.no_reuse_bytes / 2**20:.2f} | {dt:.2f} |")
                print(lines[-1], flush=True)
    lines += ["", f"worst arena / bound: {worst:.3f} (target <= 1.10)"]
    print(lines[-1])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "memory_quality.md").write_text("\n".join(lines) + "\n")
    return 0 if worst <= 1.10 else 1


if __name__ == "__main__":
    sys.exit(main())
