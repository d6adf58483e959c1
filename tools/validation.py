"""How long loading takes to validate a large artifact (CPU only).

    python tools/validation.py [--ops 30000] [--chains 1 4] [--out benchmarks/results]

Builds valid artifacts of N relu ops on a [1, 64] input, in `chains` parallel chains joined by a
final sum (one stream per chain, a wait where they join), with a hand-made ping-pong memory plan,
and times reading them (`read_artifact`: zip, hashes, JSON, the O(n log n) schedule and memory
checks) and the preflight that loading runs before any data moves. Target (issue 17): a
30,000-op artifact validates in at most 1 s on the CPU machine.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nimble.formats import read_artifact, write_artifact  # noqa: E402
from nimble.formats.artifact import Artifact  # noqa: E402
from nimble.ir import ACTIVATION, INPUT, Graph, Op, Ref, TensorSpec, Value  # noqa: E402
from nimble.plan.memory import ALIGNMENT, MemoryPlan  # noqa: E402
from nimble.plan.schedule import Schedule  # noqa: E402
from nimble.runtime.placed.preflight import preflight  # noqa: E402


def relu_chains(n_ops: int, chains: int) -> Artifact:
    spec = TensorSpec((1, 64), "float32")
    values = [Value(0, INPUT, spec, "x")]
    ops, stream, waits = [], [], []
    offset, size = [None], [0]
    per_chain = (n_ops - max(chains - 1, 0)) // chains
    ends = []
    for c in range(chains):
        prev = 0
        for k in range(per_chain):
            vid, oid = len(values), len(ops)
            values.append(Value(vid, ACTIVATION, spec, f"r{vid}", oid))
            ops.append(Op(oid, "aten::relu.default", (Ref(prev),), (), (vid,)))
            stream.append(c)
            waits.append(())
            offset.append((2 * c + k % 2) * ALIGNMENT)  # ping-pong between two slots per chain
            size.append(ALIGNMENT)
            prev = vid
        ends.append(prev)
    acc = ends[0]
    for e in ends[1:]:  # join: one add per extra chain, on stream 0, waiting on that chain's end
        vid, oid = len(values), len(ops)
        values.append(Value(vid, ACTIVATION, spec, f"s{vid}", oid))
        ops.append(Op(oid, "aten::add.Tensor", (Ref(acc), Ref(e)), (("alpha", 1),), (vid,)))
        stream.append(0)
        waits.append((values[e].producer,))
        offset.append(None)
        size.append(ALIGNMENT)
        acc = vid
    out = acc
    offset[out] = 2 * chains * ALIGNMENT  # the output: a region of its own above the ping-pong slots
    for v in range(len(values)):
        if offset[v] is None and values[v].kind == ACTIVATION:
            offset[v] = 2 * chains * ALIGNMENT + ALIGNMENT * (1 + v % 2)  # join sums: two more slots
    graph = Graph(tuple(values), tuple(ops), (0,), (out,))
    graph.lint()
    order = sorted(range(len(ops)), key=lambda i: (i >= chains * per_chain, i % per_chain if i < chains * per_chain
                                                   else i, i))
    position = [0] * len(ops)
    for p, i in enumerate(order):
        position[i] = p
    schedule = Schedule(tuple(stream), tuple(order), tuple(position), tuple(waits), 0, 0, 0, 0, str(chains))
    arena = max(o + s for o, s in zip(offset, size) if o is not None)
    memory = MemoryPlan(tuple(offset), tuple(s if o is not None else 0 for o, s in zip(offset, size)), arena, 0,
                        sum(s for o, s in zip(offset, size) if o is not None))
    x = torch.zeros(1, 64)
    return Artifact({"model": "relu_chains.pt", "source_sha256": "0" * 64, "options": {"streams": str(chains)}},
                    graph, schedule, memory, {}, [x], [x])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", type=int, default=30_000)
    parser.add_argument("--chains", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    lines = [f"Validation time. {platform.node() or 'machine'} ({platform.machine()}, Python "
             f"{platform.python_version()}), torch {torch.__version__}, {datetime.date.today()}, "
             f"`python tools/validation.py --ops {args.ops}`. Median of 3.", "",
             "| ops | chains (streams) | artifact | read_artifact (s) | preflight (s) | total (s) |",
             "| --- | --- | --- | --- | --- | --- |"]
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for chains in args.chains:
            path = Path(tmp) / f"chains{chains}.nimble"
            size = write_artifact(path, relu_chains(args.ops, chains))
            reads, checks = [], []
            for _ in range(3):
                t = time.perf_counter()
                art = read_artifact(path)
                reads.append(time.perf_counter() - t)
                t = time.perf_counter()
                preflight(art.graph, art.memory, path.name)
                checks.append(time.perf_counter() - t)
            read_s, check_s = sorted(reads)[1], sorted(checks)[1]
            worst = max(worst, read_s)
            lines.append(f"| {len(art.graph.ops)} | {chains} | {size / 2**20:.1f} MiB | {read_s:.2f} | {check_s:.2f} | "
                         f"{read_s + check_s:.2f} |")
            print(lines[-1], flush=True)
    return report.finish(args.out, "validation", lines, f"slowest read_artifact: {worst:.2f} s (target <= 1 s)",
                         worst <= 1.0)


if __name__ == "__main__":
    sys.exit(main())
