"""Device footprint of a multi-batch artifact (`nimble compile --batch-sizes`: one CUDA graph per
batch size, on one copy of the weights and one arena) as loaded, where every batch size runs on
the same CUDA streams and cuDNN graph workspaces, beside each batch size on streams and workspaces
of its own (how such an artifact loaded before they were shared). Each new CUDA stream that
multiplies matrices gets its own cuBLAS workspace for the life of the process. Run on the GPU
machine:

    python benchmarks/batched_footprint.py --model resnet50 --batch-sizes 1 2 4 8 16 --out DIR

Each load runs in a fresh process with an empty tuning cache; the figures are the growth of
`torch.cuda.memory_reserved()` over the load and one call at the largest batch size, and the
footprint by kind the load reports (`runtime/base/footprint.py`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import report
from memory_footprint import child

LOAD = """
import json, sys, torch
import nimble
from nimble.runtime.executable import Executable
if sys.argv[2] == "unshared":  # each batch size makes its own streams and cuDNN graph workspaces
    Executable._share_streams = lambda self, lender: None
torch.cuda.init()
torch.cuda.synchronize()
before = torch.cuda.memory_reserved()
exe = nimble.load(sys.argv[1], device="cuda")
largest = exe.executable(exe.batch_sizes[-1])
exe(*[torch.zeros(t.shape, dtype=t.dtype, device="cuda") for t in largest._inputs], copy=False)
torch.cuda.synchronize()
execs = [exe.executable(b) for b in exe.batch_sizes]
doc = {"reserved_growth": torch.cuda.memory_reserved() - before, "footprint": exe.stats.footprint.document(),
       "cuda_streams": len({s.cuda_stream for e in execs for s in e._streams}),
       "workspace_sets": len({id(e._cudnn_workspaces) for e in execs}), "choice": exe.stats.choice}
exe.close()
doc["after_close"] = torch.cuda.memory_reserved() - before
print(json.dumps(doc))
"""


def main() -> int:
    import torch

    from nimble.formats import write_artifact
    from nimble.frontend import quiet_torchscript
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs
    from peers import make_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sizes = sorted(args.batch_sizes)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, shapes = make_model(args.model)
        xs = tuple(torch.randn(sizes[0], *s) for s in shapes)
        with torch.no_grad(), quiet_torchscript():
            torch.jit.save(torch.jit.trace(model, xs, check_trace=False), str(folder / "m.pt"))
        compiled = compile_model(folder / "m.pt", input_specs(["x".join(map(str, x.shape)) for x in xs]),
                                 device="cpu", check=False, batch_sizes=sizes)
        path = folder / f"{args.model}.nimble"
        write_artifact(path, compiled.artifact())
        for mode in ("shared", "unshared"):
            doc = child(LOAD, str(path), mode, cache=str(folder / f"cache_{mode}"))
            doc["mode"] = mode
            rows.append(doc)
            print(json.dumps(doc), flush=True)
    mib = 2**20
    header = ["batch sizes' streams and workspaces", "CUDA streams", "cuDNN workspace sets", "weights", "arena",
              "pool free", "other", "cached", "reserved growth", "after close()"]
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["mode"], r["error"], *["-"] * (len(header) - 2)])
            continue
        f = r["footprint"]
        table.append([r["mode"], r["cuda_streams"], r["workspace_sets"],
                      *(f"{f[k] / mib:.1f}" for k in ("weights", "arena", "pool_free", "other_allocated", "cached")),
                      f"{r['reserved_growth'] / mib:.1f}", f"{r['after_close'] / mib:.1f}"])
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    lines = [f"Footprint of a multi-batch artifact, {args.model} at batch sizes {', '.join(map(str, sizes))}, {gpu}, "
             f"torch {torch.__version__}, fp32, {datetime.date.today()}. MiB; each load in a fresh process, default "
             f"tuning from an empty cache, one call at batch {sizes[-1]}. Command: `python benchmarks/batched_footprint.py "
             f"{' '.join(sys.argv[1:])}`.", "", *report.table(header, table)]
    report.write(args.out, f"batched_footprint_{args.model}", lines, {"rows": rows, "command": sys.argv})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
