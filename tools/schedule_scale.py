"""How long scheduling takes on deep NASNet-like DAGs (CPU only; no torch needed).

    python tools/schedule_scale.py [--sizes 1300 10000 50000] [--streams auto 8]

Targets (issue 3): 10,000 ops in at most 2 s and 50,000 ops in at most 30 s on the CPU machine.
A cell takes the two previous cell outputs, builds five blocks (each adds two branches of 1 to 8
ops that start from the cell's inputs or earlier blocks) and concatenates them, as NASNet-A does.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nimble.plan.schedule import schedule_dag  # noqa: E402


def nasnet_like(num_ops: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    preds: list[list[int]] = [[]]
    prev2 = prev = 0

    def add(ps):
        preds.append(sorted(set(ps)))
        return len(preds) - 1

    while len(preds) < num_ops:
        states = [prev2, prev]
        blocks = []
        for _ in range(5):
            ends = []
            for _ in range(2):
                node = rng.choice(states)
                for _ in range(rng.randint(1, 8)):
                    node = add([node])
                ends.append(node)
            blocks.append(add(ends))
            states.append(blocks[-1])
        prev2, prev = prev, add(blocks)
    return preds[:num_ops]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[1300, 10_000, 50_000])
    parser.add_argument("--streams", nargs="*", default=["auto", "8"])
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    print("| ops | streams asked | streams | waits | reduction edges | seconds |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in args.sizes:
        preds = nasnet_like(n)
        for streams in args.streams:
            t = time.perf_counter()
            s = schedule_dag(preds, streams if streams == "auto" else int(streams))
            dt = time.perf_counter() - t
            print(f"| {n} | {streams} | {s.num_streams} | {s.num_waits} | {s.reduction_edges} | {dt:.2f} |", flush=True)


if __name__ == "__main__":
    main()
