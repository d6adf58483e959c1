"""Compile time for a NASNet-A-large-sized model (about 1,300 ops, 90M parameters) on the CPU.

    python benchmarks/compile_large.py [--cells 29] [--channels 364]

Target (issue 4): at most 10 s on the CPU machine, excluding the reference run (running the
TorchScript module and the op list once to check and to record sample outputs). The model stacks
the sample NASNet cells until op and parameter counts match NASNet-A-large; it is traced once
(untimed) and written to a temp folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nimble.formats import write_artifact  # noqa: E402
from nimble.pipeline import compile_model  # noqa: E402
from nimble.specs import input_specs  # noqa: E402
from sample_models.build import NasCell, conv_bn  # noqa: E402


class BigNAS(nn.Module):
    def __init__(self, cells: int, c: int):
        super().__init__()
        self.stem = nn.Sequential(conv_bn(3, 96, 3, 2), conv_bn(96, 6 * c, 3, 2))
        self.cells = nn.ModuleList(NasCell(6 * c, 6 * c, c) for _ in range(cells))
        self.fc = nn.Linear(6 * c, 1000)

    def forward(self, x):
        prev = cur = self.stem(x)
        for cell in self.cells:
            prev, cur = cur, cell(cur, prev)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(cur, 1), 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", type=int, default=29)
    parser.add_argument("--channels", type=int, default=364)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = BigNAS(args.cells, args.channels).eval()
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bignas.pt"
        with torch.no_grad():
            torch.jit.save(torch.jit.trace(model, torch.randn(1, 3, args.size, args.size)), str(path))
        t = time.perf_counter()
        compiled = compile_model(path, input_specs([f"1x3x{args.size}x{args.size}"]), device="cpu")
        t_write = time.perf_counter()
        size = write_artifact(Path(tmp) / "bignas.nimble", compiled.artifact())
        compiled.seconds["write"] = time.perf_counter() - t_write
        total = time.perf_counter() - t
    s = compiled.seconds
    print(f"model: {args.cells} cells, {params / 1e6:.1f}M parameters, {len(compiled.graph.ops)} ops, "
          f"{compiled.schedule.num_streams} streams, artifact {size / 1e6:.0f} MB")
    print("stages (s): " + ", ".join(f"{k} {v:.2f}" for k, v in s.items()))
    print(f"total {total:.2f} s; without the reference run {total - s['check']:.2f} s (target <= 10 s)")


if __name__ == "__main__":
    main()
