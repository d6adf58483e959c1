"""What the benchmark scripts share: markdown tables, the result files they write beside each other
(`NAME.md` and `NAME.json` in `--out`), and the wall-clock timer around a synchronised GPU call."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def table(header: list[str], rows: list[list]) -> list[str]:
    """A markdown table's lines; cells are printed with str(), pipes escaped."""
    def cells(row):
        return "| " + " | ".join(str(c).replace("|", "/") for c in row) + " |"

    return [cells(header), "| " + " | ".join("---" for _ in header) + " |", *(cells(r) for r in rows)]


def write(out: Path | None, name: str, lines: list[str] | str | None = None, doc=None) -> None:
    """`out/NAME.md` from the lines (or text) and `out/NAME.json` from `doc`, where given; nothing
    without `out`."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    if lines is not None:
        text = lines if isinstance(lines, str) else "\n".join(lines) + "\n"
        (out / f"{name}.md").write_text(text)
    if doc is not None:
        (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")


def each_row(models: list[str], batches: list[int], one) -> list[dict]:
    """`one(name, batch, folder)` for every model and batch, in order, with a temporary folder they
    share: the rows it returned. Each row's seconds go to stderr; a row that raises is printed
    there and left out (one model's failure is a result too)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            for batch in batches:
                t = time.perf_counter()
                try:
                    rows.append(one(name, batch, Path(tmp)))
                except Exception as e:
                    print(f"{name} batch {batch}: FAILED {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                print(f"{name} batch {batch}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    return rows


def finish(out: Path | None, name: str, lines: list[str], verdict: str, ok: bool) -> int:
    """End a table with its verdict line (printed), write it, and return the exit code."""
    lines += ["", verdict]
    print(verdict)
    write(out, name, lines)
    return 0 if ok else 1


def median_ms(call, iters: int = 200, warmup: int = 10) -> float:
    """Median wall-clock milliseconds of `call()` followed by a CUDA synchronize (latency)."""
    import torch

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t) * 1000)
    return statistics.median(samples)


def gpu_meta(script: str) -> dict:
    """Where and how a GPU benchmark ran: the GPU, torch, the date and the command line."""
    import datetime
    import sys

    import torch

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": str(datetime.date.today()),
            "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:])}
