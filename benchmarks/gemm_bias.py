"""A GEMM's bias inside cuBLASLt's epilogue (`addmm`) against the plain GEMM followed by an
in-place add, for the projection shapes of GPT-2 and BERT, in every precision nimble runs.

Each variant is captured in a CUDA graph as 20 back-to-back calls and replayed; the figure is the
median over 15 replays of the time per call, in microseconds (GPU-bound). This is the measurement
behind `bias_into_epilogue` and the runtime's fp32 `addmm` (see `runtime/placed/placement.py`).

    python benchmarks/gemm_bias.py [--rows 128 1024] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((768, 768), (768, 2304), (768, 3072), (3072, 768))  # (K, N): GPT-2 small's four projections
PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


def graph_us(fn, calls: int = 20, repeats: int = 15) -> float:
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def measure(rows: int, k: int, n: int, precision: str) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    w = torch.randn(k, n, device="cuda", dtype=dtype) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=dtype)
    out = torch.empty(rows, n, device="cuda", dtype=dtype)

    def split():
        torch.mm(x, w, out=out)
        out.add_(bias)

    row = {"rows": rows, "k": k, "n": n, "precision": precision,
           "addmm_us": graph_us(lambda: torch.addmm(bias, x, w, out=out)),
           "mm_add_us": graph_us(split), "mm_us": graph_us(lambda: torch.mm(x, w, out=out))}
    torch.backends.cuda.matmul.allow_tf32 = False
    return row


def table(rows: list[dict]) -> str:
    import torch

    lines = [f"GEMM with bias: cuBLASLt's epilogue (`addmm`) against `mm` then an in-place add, in CUDA graphs, "
             f"us per call (median of 15 replays of 20 calls). {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}. Command: `python benchmarks/gemm_bias.py`.", "",
             "| M | K x N | precision | addmm | mm + add | mm alone | addmm / (mm + add) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['rows']} | {r['k']} x {r['n']} | {r['precision']} | {r['addmm_us']:.1f} | "
                     f"{r['mm_add_us']:.1f} | {r['mm_us']:.1f} | {r['addmm_us'] / r['mm_add_us']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 1024], help="M: batch x sequence length")
    parser.add_argument("--out", type=Path, default=None, help="write gemm_bias.md and .json there")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gemm_bias.py measures CUDA GEMMs; run it on a machine with a GPU", file=sys.stderr)
        return 2
    rows = [measure(m, k, n, p) for m in args.rows for p in PRECISIONS for k, n in SHAPES]
    text = table(rows)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemm_bias.md").write_text(text)
        (args.out / "gemm_bias.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
