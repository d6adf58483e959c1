"""How many ops each torchvision model of `peers.py` must keep in float32 at fp16 and bf16: compile
with the default tolerance (fp16 1e-2, bf16 5e-2 relative L2), then with `--tolerance 1e-2` (the
precision search), on the CPU builder, batch 1, random weights (torch.manual_seed(0)).

    python benchmarks/precision_search.py --out DIR [--models resnet50 ...]

Prints, per model and precision: whether the default compile passes (else the op it names), and
for the search: ops kept in float32 of the ops with floating results, the error reached, graphs
tried and seconds.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> int:
    import torch

    from nimble.errors import NimbleError
    from nimble.frontend import quiet_torchscript
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs
    from peers import TORCHVISION, make_model
    from zoo import import_torchvision

    import_torchvision()  # on a CPU-only machine, with its C++ ops declared first (docs/troubleshooting.md)

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(TORCHVISION))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model, shapes = make_model(name)
            x = torch.randn(1, *shapes[0])
            path = Path(tmp) / f"{name}.pt"
            with quiet_torchscript():
                torch.jit.save(torch.jit.trace(model, x), str(path))
            specs = input_specs(["x".join(map(str, (1, *shapes[0])))])
            for precision in ("fp16", "bf16"):
                row = [name, precision]
                for tolerance in (None, 1e-2):
                    t = time.perf_counter()
                    try:
                        c = compile_model(path, specs, device="cpu", precision=precision, tolerance=tolerance)
                    except NimbleError as e:
                        row.append("fails: " + str(e).split("first op to lose accuracy is ")[-1][:160])
                        continue
                    r = c.precision
                    kept = len(r["fp32_ops"])
                    row.append("passes" if tolerance is None else
                               f"{kept} of {r['floating_ops']} ({kept / r['floating_ops']:.0%}), error "
                               f"{max(r['errors']):.1e}, {r['tries']} tries, {time.perf_counter() - t:.1f} s")
                rows.append(row)
                print(" | ".join(row), flush=True)
    meta = f"torch {torch.__version__}, CPU, {datetime.date.today()}, command `python {' '.join(sys.argv)}`"
    lines = [f"Ops kept in float32 at reduced precision ({meta}). Random weights; batch 1.", "",
             *report.table(["model", "precision", "default tolerance", "--tolerance 1e-2: float32 ops"], rows)]
    report.write(args.out, "precision_search", lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
