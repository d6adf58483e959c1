"""The sweep's report (`benchmarks/sweep.py --report`), which needs no GPU: its JSONL rows read and
merged (a later file's row for a model, batch, precision and mode wins), one table per precision,
torch.compile mode and batch with nimble's ratio to each peer, the geometric means and the worst ten."""

from __future__ import annotations

import json
import math
from pathlib import Path

import report

TARGET = {"torch_compile": 0.8, "inductor_graph": 0.9, "max_autotune": 0.9}  # the bounds on nimble's GPU-bound ratio
PEERS = {"reduce-overhead": "torch_compile", "max-autotune": "max_autotune"}  # --peer: torch.compile's mode -> variant


def ratio(row: dict, peer: str) -> float | None:
    ms = row.get("gpu_bound_ms", {})
    return ms["nimble"] / ms[peer] if "nimble" in ms and ms.get(peer) else None


def geomean(values: list[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def kind(r: dict) -> tuple[str, str]:
    """(precision, torch.compile's mode) of a row: the table it belongs to."""
    return r.get("precision", "fp32"), r.get("peer", "reduce-overhead")


def summary(rows: list[dict], meta: dict) -> str:
    """One table per (precision, torch.compile's mode, batch): every model's figures and ratios,
    then the geometric means and the worst ten by the ratio to torch.compile."""
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = [f"Models on {meta['gpu']}, torch {meta['torch']}, {meta['date']}. "
             f"Command(s): `{meta['command']}`. GPU-bound ms (50 back-to-back calls between CUDA events, "
             "median of 15); latency ms (copy in, run, synchronize; median of 200). Random weights. "
             "inductor_graph: torch.compile's kernels with no CUDA graphs of its own, captured by hand into "
             "one CUDA graph (its kernels without its call path).", ""]
    for (precision, peer), batch in sorted({(kind(r), r["batch"]) for r in rows}):
        part = sorted((r for r in rows if kind(r) == (precision, peer) and r["batch"] == batch),
                      key=lambda r: r["model"])
        first = PEERS[peer]
        peers_ = [first] + (["inductor_graph"] if first == "torch_compile" and precision == "fp32" else [])
        lines += [f"## {precision}, batch {batch}" + (f", torch.compile(mode=\"{peer}\")" if peer != "reduce-overhead"
                                                     else ""), ""]
        head = ["model", "eager", *peers_, "nimble", *(f"nimble / {p}" for p in peers_),
                f"latency nimble / {first}", "note"]
        body = []
        for r in part:
            g, lat = r.get("gpu_bound_ms", {}), r.get("latency_ms", {})
            lat_ratio = lat["nimble"] / lat[first] if "nimble" in lat and lat.get(first) else None
            note = r.get("error") or "; ".join(f"{k}: {v}" for k, v in r.get("errors", {}).items())
            body.append([r["model"], fmt(g.get("eager")), *(fmt(g.get(p)) for p in peers_), fmt(g.get("nimble")),
                         *(fmt(ratio(r, p)) for p in peers_), fmt(lat_ratio), note])
        lines += report.table(head, body) + [""]
        for p in peers_:
            values = [v for r in part if (v := ratio(r, p)) is not None]
            over = [r["model"] for r in part if (v := ratio(r, p)) is not None and v > TARGET[p]]
            lines.append(f"- nimble / {p}: geometric mean {fmt(geomean(values))} over {len(values)} models; "
                         f"over {TARGET[p]}: {len(over)} ({', '.join(over) or 'none'})")
        worst = sorted((r for r in part if ratio(r, first) is not None), key=lambda r: -ratio(r, first))[:10]
        lines.append(f"- worst ten by nimble / {first}: "
                     + ", ".join(f"{r['model']} {ratio(r, first):.3f}" for r in worst))
        compile_s = [f"{r['model']} {r[first + '_s']:.0f} s" for r in part if first + "_s" in r]
        if peer != "reduce-overhead" and compile_s:
            lines.append(f"- torch.compile(mode=\"{peer}\")'s compile (its first three calls): {', '.join(compile_s)}")
        failed = [f"{r['model']} ({r['error']})" for r in part if "error" in r]
        if failed:
            lines.append(f"- no figures: {'; '.join(failed)}")
        lines.append("")
    return "\n".join(lines)


def read_rows(paths: list[Path]) -> list[dict]:
    """Every row of these JSONL files, a later file's row for a (model, batch, precision, mode)
    winning. A file that is not this script's rows ends the run in one line."""
    latest = {}
    for p in paths:
        for k, line in enumerate(read_lines(p), 1):
            try:
                r = json.loads(line)
                if not r.get("meta"):
                    latest[(r["model"], r["batch"], *kind(r))] = r
            except (ValueError, KeyError, TypeError, AttributeError):
                raise SystemExit(f"{p}: line {k} is not a row of benchmarks/sweep.py; give the "
                                 "sweep_*.jsonl files it wrote") from None
    return list(latest.values())


def read_lines(path: Path) -> list[str]:
    """The non-blank lines of `path`, or one line saying why it cannot be read."""
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"{path}: cannot be read ({type(e).__name__}); give the sweep_*.jsonl files "
                         "benchmarks/sweep.py wrote") from None


def first_meta(path: Path) -> dict:
    """The run description on the first line of a sweep file, or one line saying it has none."""
    lines = read_lines(path)
    try:
        meta = json.loads(lines[0])["meta"]
        return {k: str(meta[k]) for k in ("gpu", "torch", "date", "command")}
    except (IndexError, ValueError, KeyError, TypeError):
        raise SystemExit(f"{path}: its first line is not the run description benchmarks/sweep.py writes") from None
