"""Several models in one process: loaded one by one, or into one `nimble.Group` (one arena, one
set of CUDA streams and workspaces, calls one at a time). Run on a GPU machine.

    python benchmarks/group_footprint.py [--models resnet50 mobilenet_v2 bert-base gpt2] [--batch 8] [--out DIR]

Each way runs in a fresh process, from an empty tuning cache: `torch.cuda.memory_reserved()`
before the first load and after every model was loaded and called once, and after `close()`.
In the same processes, each model's latency (copy in, run, synchronize; median of 200) and
GPU-bound time (50 back-to-back calls between CUDA events, median of 15), to show what waiting
for the group's turn costs a call.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import report
from memory_footprint import child, compile_artifact

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOAD = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
import nimble, report
from nimble.formats import read_artifact
from peers import gpu_bound_ms
paths, grouped = sys.argv[3:], sys.argv[1] == "group"
torch.cuda.init()
xs = [[t.cuda() for t in read_artifact(p).sample_inputs] for p in paths]
torch.cuda.synchronize()
before = torch.cuda.memory_reserved()
if grouped:
    group = nimble.Group("cuda")
    exes = group.load(*paths)
    exes = exes if isinstance(exes, list) else [exes]
else:
    exes = [nimble.load(p, device="cuda") for p in paths]
for exe, x in zip(exes, xs):
    exe(*x, copy=False)
torch.cuda.synchronize()
doc = {"reserved_growth": torch.cuda.memory_reserved() - before,
       "arena_bytes": [e.artifact.memory.arena_bytes for e in exes],
       "streams": len(group._streams) if grouped else sum(len(e._streams) for e in exes),
       "latency_ms": [report.median_ms(lambda: e(*x, copy=False)) for e, x in zip(exes, xs)],
       "gpu_bound_ms": [gpu_bound_ms(e.replay) for e in exes],
       "footprints": [e.stats.footprint.document() for e in exes]}  # each from just before its own load
for e in exes:
    e.close()
torch.cuda.synchronize()
torch.cuda.empty_cache()
doc["after_close"] = torch.cuda.memory_reserved() - before
print(json.dumps(doc))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet50", "mobilenet_v2", "bert-base", "gpt2"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    meta = report.gpu_meta("group_footprint.py")
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        paths = [str(compile_artifact(name, args.batch, Path(tmp))) for name in args.models]
        runs = {way: child(LOAD, way, str(ROOT / "benchmarks"), *paths, cache=str(Path(tmp) / f"cache_{way}"))
                for way in ("apart", "group")}
    print(json.dumps(runs), flush=True)
    apart, group = runs["apart"], runs["group"]
    if "error" in apart or "error" in group:
        print(f"failed: {apart.get('error') or group.get('error')}", file=sys.stderr)
        return 1
    kinds = ("weights", "arena", "inputs", "outside_arena", "pool_free", "other_allocated", "cached")

    def grown(run, k):  # what the k-th load added, by kind (the arena: what the group's had to grow)
        f = run["footprints"][k]
        return f"{f['growth'] / mib:.1f} (" + ", ".join(f"{f[kind] / mib:.1f}" for kind in kinds) + ")"

    rows = [[name, f"{apart['gpu_bound_ms'][k]:.3f} / {group['gpu_bound_ms'][k]:.3f}",
             f"{apart['latency_ms'][k]:.3f} / {group['latency_ms'][k]:.3f}",
             f"{apart['arena_bytes'][k] / mib:.1f}", grown(apart, k), grown(group, k)]
            for k, name in enumerate(args.models)]
    lines = [f"{len(args.models)} models in one process at batch {args.batch}, loaded one by one or into one "
             f"nimble.Group; {meta['gpu']}, torch {meta['torch']}, fp32 (TF32 convolutions), {meta['date']}. "
             f"Command: `{meta['command']}`. Each way in a fresh process from an empty tuning cache.", "",
             f"- reserved growth, every model loaded and called once: {apart['reserved_growth'] / mib:.1f} MiB one "
             f"by one, {group['reserved_growth'] / mib:.1f} MiB in a group "
             f"({group['reserved_growth'] / apart['reserved_growth']:.2f}x)",
             f"- CUDA streams: {apart['streams']} one by one, {group['streams']} in a group",
             f"- arenas: {sum(apart['arena_bytes']) / mib:.1f} MiB one by one, "
             f"{max(group['arena_bytes']) / mib:.1f} MiB in a group",
             f"- still reserved after every close(): {apart['after_close'] / mib:.1f} MiB one by one, "
             f"{group['after_close'] / mib:.1f} MiB in a group", "",
             "Per model, in load order: MiB the load added to what was reserved, and in brackets by kind: "
             + ", ".join(kinds) + " (`runtime/base/footprint.py`).", "",
             *report.table(["model", "GPU-bound ms, apart / group", "latency ms, apart / group", "arena MiB",
                            "added apart", "added in the group"], rows)]
    report.write(args.out, f"group_footprint_b{args.batch}", lines, {"meta": meta, **runs})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
