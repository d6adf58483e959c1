"""nimble's own GPU-bound and latency times on the peers models, for comparing two source trees
(a restructuring that must not change speed): run it once under each tree's install, in one
device call, and compare the JSON lines. Not a user benchmark (`benchmarks/peers.py` is).

    python tools/tree_ab.py TREE --label old [--models resnet50 mobilenet_v2] [--batch 8]

TREE is the source tree whose `benchmarks/peers.py` and `memory_footprint.py` make the models,
inputs and artifacts (each tree's own, so the older one runs as it was); nimble is whatever is
installed. Each model is compiled from TorchScript on the CPU (`compile_artifact`), loaded with `tune="full"` on a cache folder of its own, checked
against eager, then timed as `peers.py` times it: GPU-bound (50 back-to-back replays between
CUDA events, median of 15) and latency (copy in, run, synchronize; median of 200). Prints one
JSON line per model.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tree", type=Path)
    parser.add_argument("--label", required=True)
    parser.add_argument("--models", nargs="+", default=["resnet50", "mobilenet_v2", "inception_v3", "efficientnet_b0"])
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree / "benchmarks"))
    import report
    import torch
    from memory_footprint import compile_artifact
    from peers import gpu_bound_ms, make_inputs

    from nimble.formats import read_artifact
    from nimble.runtime.executable import Executable

    torch.backends.cudnn.benchmark = False
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["NIMBLE_CACHE_DIR"] = str(Path(tmp) / "cache")
        for name in args.models:
            path = compile_artifact(name, args.batch, Path(tmp))  # the tree's own: seeded, as make_inputs is
            model, xs = make_inputs(name, args.batch)
            with torch.no_grad():
                want = model.cuda()(*[x.cuda() for x in xs])
            exe = Executable(read_artifact(path), "cuda", tune="full")
            xs = [x.cuda() for x in xs]
            got = exe.run(*xs)
            error = float((got[0] - want).abs().max() / want.abs().max().clamp_min(1e-6))
            row = {"label": args.label, "model": name, "batch": args.batch, "gpu_bound_ms": gpu_bound_ms(exe.replay),
                   "latency_ms": report.median_ms(lambda: exe(*xs, copy=False)), "choice": exe.stats.choice,
                   "load_s": round(exe.stats.seconds["total"], 2), "max_rel_error": error,
                   "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
            print(json.dumps(row), flush=True)
            exe.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
