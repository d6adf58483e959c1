"""nimble's float32 product kernel (`runtime/kernels/gemm.py`, three TF32 products on the tensor cores)
against cuBLAS in float32 (FMA units: TF32 off for matmul, PyTorch's default; the faster of `addmm`
with cuBLASLt's bias epilogue and the GEMM then an in-place bias add), at the
projection shapes of GPT-2 small and BERT-base with 128 rows (batch 1), 197 (vit_b_16 at batch 1)
and 1024 (batch 8). nimble's figure is its fastest tile (`gemm.TILES`), as the runtime picks.

Both are timed as the runtime chooses between them (`timing.graph_us`: a CUDA graph of 10 calls,
the median of three replays, microseconds per call). Error = the largest difference from a float64
product, relative to its largest magnitude.

    python tools/gemm.py [--rows 128 1024] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((768, 768), (768, 2304), (768, 3072), (3072, 768))  # (K, N)


def measure(rows: int, k: int, n: int) -> dict:
    import torch

    from nimble.runtime.kernels import gemm
    from nimble.runtime.kernels import generated
    from nimble.runtime.base import timing

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", generator=g)
    b = torch.randn(n, k, device="cuda", generator=g).t()  # a linear's weight, as linear reads it
    bias = torch.randn(n, device="cuda", generator=g)
    out = torch.empty(rows, n, device="cuda")
    exact = torch.addmm(bias.double(), x.double(), b.double())

    def error() -> float:
        return float((out.double() - exact).abs().max() / exact.abs().max())

    def separate():
        torch.mm(x, b, out=out)
        out.add_(bias)

    theirs = min(timing.graph_us(lambda: torch.addmm(bias, x, b, out=out), out.device),
                 timing.graph_us(separate, out.device))
    theirs_error = error()
    tiles = {}
    for tile in gemm.TILES:
        launch = gemm.launcher(generated.define(gemm.source(x, b, bias, out, tile=tile)), tile)
        launch(x, b, bias, out)
        tiles[tile] = (timing.graph_us(lambda: launch(x, b, bias, out), out.device), error())
    best = min(tiles, key=lambda t: tiles[t][0])
    ours, ours_error = tiles[best]
    return {"rows": rows, "k": k, "n": n, "cublas_us": round(theirs, 2), "nimble_us": round(ours, 2),
            "tile": list(best), "tiles_us": {str(t): round(v[0], 2) for t, v in tiles.items()},
            "speedup": round(theirs / ours, 3), "cublas_error": theirs_error, "nimble_error": ours_error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[128, 197, 1024])
    parser.add_argument("--out", type=Path, default=None, help="folder for gemm.json (default: print only)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gemm.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, float32")
    print("| rows | K | N | cuBLAS us | nimble us | tile (M, N, K, warps, stages) | speedup | cuBLAS error | nimble error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in args.rows:
        for k, n in SHAPES:
            r = measure(m, k, n)
            rows.append(r)
            print(f"| {m} | {k} | {n} | {r['cublas_us']} | {r['nimble_us']} | {tuple(r['tile'])} | {r['speedup']} | "
                  f"{r['cublas_error']:.1e} | {r['nimble_error']:.1e} |", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemm.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                         "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
