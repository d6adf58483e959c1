"""Which ops allocate in a loaded artifact's CUDA-graph pool, and how its segments lie per stream.

    python tools/pool_census.py ARTIFACT [ARTIFACT ...] [--tune off|cached|full] [--top 15]

For each artifact: it is loaded on the GPU (empty tuning cache unless `--tune` says otherwise),
then captured once more with every op's call watched through the allocator's totals: the bytes
an op's call leaves allocated (its results outside the arena) and the peak above that while it
runs (workspaces and temporaries). It prints the segments outside the pool that are partly
free (the footprint's `cached`), the pool's segments by stream (size, allocated) and the ops
that allocate the most, with their stream and kind. This is the diagnostic behind
the footprint's `pool_free` and `outside_arena` (`nimble/runtime/base/footprint.py`).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def census(path: str, tune: str, top: int) -> None:
    import torch

    import nimble
    from nimble.runtime.placed import run as placed_run

    mib = 2**20
    exe = nimble.load(path, device="cuda", tune=tune)
    print(f"\n## {Path(path).name}: {exe.stats.choice}; footprint (MiB): "
          + ", ".join(f"{k} {v / mib:.1f}" for k, v in exe.stats.footprint.document().items()
                      if isinstance(v, int)))
    rows = []
    call = placed_run.PlacedRun.call

    def watched(run, p, args, kwargs):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        got = call(run, p, args, kwargs)
        after = torch.cuda.memory_allocated()
        stream = torch.cuda.current_stream().cuda_stream
        rows.append((p.op.id, p.op.target, stream, after - before, torch.cuda.max_memory_allocated() - after))
        return got

    placed_run.PlacedRun.call = watched
    try:
        exe._capture()
    finally:
        placed_run.PlacedRun.call = call
    torch.cuda.synchronize()
    pools = {tuple(p) for p in exe.pools()}
    by_stream = defaultdict(list)
    for seg in torch.cuda.memory_snapshot():
        if tuple(seg.get("segment_pool_id", ())) in pools:
            by_stream[seg["stream"]].append((seg["total_size"], seg["allocated_size"]))
    partly = [(seg["total_size"], seg["allocated_size"], seg["stream"]) for seg in torch.cuda.memory_snapshot()
              if tuple(seg.get("segment_pool_id", ())) not in pools and 0 < seg["allocated_size"] < seg["total_size"]]
    print("segments outside the pool with free room (MiB size/allocated, stream): "
          + (", ".join(f"{t / mib:.1f}/{a / mib:.1f} {s:#x}" for t, a, s in sorted(partly, reverse=True)) or "none"))
    print("pool segments by stream (MiB, size/allocated):")
    for stream, segs in sorted(by_stream.items()):
        print(f"  {stream:#x}: " + ", ".join(f"{s / mib:.1f}/{a / mib:.1f}" for s, a in sorted(segs, reverse=True)))
    kept, peak = defaultdict(int), defaultdict(int)
    for _, target, _, k, t in rows:
        kept[target] += max(k, 0)
        peak[target] = max(peak[target], t)
    print("by target: kept bytes summed, largest transient (MiB)")
    for target in sorted(kept, key=lambda t: -(kept[t] + peak[t]))[:top]:
        print(f"  {target}: kept {kept[target] / mib:.2f}, transient {peak[target] / mib:.2f}")
    print("largest ops (op, target, stream, kept MiB, transient MiB):")
    for op, target, stream, k, t in sorted(rows, key=lambda r: -(max(r[3], 0) + r[4]))[:top]:
        print(f"  {op} {target} {stream:#x} {k / mib:.2f} {t / mib:.2f}")
    exe.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+")
    parser.add_argument("--tune", default="cached")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    for path in args.artifacts:
        census(path, args.tune, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
