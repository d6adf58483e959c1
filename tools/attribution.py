"""Which op classes the sweep's losers lose in, summed across models: the attribution that
`tools/kernel_diff.py` gives per model, grouped. Runs anywhere (it reads result files).

    python tools/attribution.py benchmarks/results/kernel_diff_*.json
                                [--sweep benchmarks/results/sweep_fp32_*.jsonl] [--over 0.8] [--out DIR]

Each kernel diff row (model, batch, precision) holds, per op class, nimble's and torch.compile's
kernel time per inference; a later file's row replaces an earlier one's. With `--sweep`, only the
rows whose model and batch lose in the sweep (nimble over `--over` times torch.compile's GPU-bound
time, the sweep's last row for them) count, and `--list` prints those models and batches (the ones
still to diff). Per class: the kernel time nimble loses in it summed over the rows where it loses,
what it gains where it wins, the rows of each, and the three rows where it loses most.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # report.py: the benchmarks'
import report


def diff_rows(files: list[Path]) -> dict[tuple, dict]:
    """(model, batch, precision) -> its kernel diff row; a later file's row wins."""
    rows = {}
    for path in files:
        for row in json.loads(path.read_text()).get("rows", []):
            rows[(row["model"], row["batch"], row.get("precision", "fp32"))] = row | {"file": path.name}
    return rows


def losers(files: list[Path], over: float) -> dict[tuple, float]:
    """(model, batch, precision) -> nimble / torch.compile GPU-bound, for the sweep's rows over
    `over` (each one's last row)."""
    last = {}
    for path in files:
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            ms = row.get("gpu_bound_ms") or {}
            if ms.get("nimble") and ms.get("torch_compile"):
                last[(row["model"], row["batch"], row.get("precision", "fp32"))] = ms["nimble"] / ms["torch_compile"]
    return {key: ratio for key, ratio in last.items() if ratio > over}


def attribute(rows: dict[tuple, dict]) -> dict[str, dict]:
    """Per class: ms lost (summed where nimble loses), ms gained, the rows of each, the worst three."""
    found = defaultdict(lambda: {"lost_ms": 0.0, "gained_ms": 0.0, "losing": [], "winning": 0})
    for key, row in rows.items():
        for cls, v in row.get("classes", {}).items():
            diff = v["nimble_ms"] - v["torch_compile_ms"]
            entry = found[cls]
            if diff > 0:
                entry["lost_ms"] += diff
                entry["losing"].append({"model": key[0], "batch": key[1], "precision": key[2], "ms": diff})
            elif diff < 0:
                entry["gained_ms"] -= diff
                entry["winning"] += 1
    for entry in found.values():
        entry["losing"].sort(key=lambda r: -r["ms"])
    return dict(sorted(found.items(), key=lambda kv: -kv[1]["lost_ms"]))


def table(classes: dict[str, dict], rows: dict[tuple, dict], missing: list[tuple]) -> list[str]:
    body = [[cls, f"{e['lost_ms']:.3f}", len(e["losing"]), f"{e['gained_ms']:.3f}", e["winning"],
             "; ".join(f"{r['model']} b{r['batch']} {r['precision']} {r['ms']:.3f}" for r in e["losing"][:3])]
            for cls, e in classes.items()]
    lines = [f"Kernel time by op class across {len(rows)} kernel diff rows "
             f"({', '.join(sorted({r['file'] for r in rows.values()}))}), nimble against torch.compile: "
             "ms per inference lost where nimble's kernels of that class take longer, gained where shorter.", "",
             *report.table(["class", "lost ms", "rows losing", "gained ms", "rows winning", "worst rows"], body)]
    if missing:
        lines += ["", "Sweep losers with no kernel diff yet: "
                  + ", ".join(f"{m} b{b} {p}" for m, b, p in missing)]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("diffs", nargs="*", type=Path, help="kernel_diff JSON files (`tools/kernel_diff.py --out`)")
    parser.add_argument("--sweep", nargs="*", type=Path, default=[], help="sweep JSONL files: count their losers only")
    parser.add_argument("--over", type=float, default=0.8, help="a loser's nimble / torch.compile GPU-bound time")
    parser.add_argument("--list", action="store_true", help="print the sweep's losers as MODEL BATCH PRECISION lines")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tag", default="run")
    args = parser.parse_args()
    for path in [*args.diffs, *args.sweep]:
        if not path.is_file():
            parser.error(f"{path} is not a file")
    if args.list and not args.sweep:
        parser.error("--list prints the sweep's losers: give --sweep FILES")
    try:
        wanted = losers(args.sweep, args.over) if args.sweep else None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        parser.error(f"not a sweep result (benchmarks/sweep.py's JSONL): {e}")
    if args.list:
        print("\n".join(f"{m} {b} {p}" for m, b, p in sorted(wanted or {})))
        return 0
    try:
        rows = diff_rows(args.diffs)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        parser.error(f"not a kernel diff result (tools/kernel_diff.py's JSON): {e}")
    if wanted is not None:
        rows = {k: r for k, r in rows.items() if k in wanted}
    if not rows:
        print("no kernel diff rows to attribute" + (" among the sweep's losers" if wanted is not None else ""),
              file=sys.stderr)
        return 1
    classes = attribute(rows)
    lines = table(classes, rows, sorted(set(wanted or {}) - set(rows)))
    report.write(args.out, f"attribution_{args.tag}", lines, {"classes": classes, "rows": sorted(rows)})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
