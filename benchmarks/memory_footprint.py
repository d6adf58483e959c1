"""What a loaded artifact holds on the GPU, by kind, beside torch.compile(mode="reduce-overhead").

    python benchmarks/memory_footprint.py --out DIR [--models inception_v3 resnet50 ...] [--batches 1 8]
                                          [--no-peer] [--set cudnn_slower_outside=1.03 ...]

Each measurement runs in a fresh process, so that nothing else sits in the caching allocator:

- nimble: `torch.cuda.memory_reserved()` before `nimble.load` (default tuning, empty tuning
  cache) and after one call, and the footprint by kind the load reports (`runtime/base/footprint.py`);
  then `close()` and what is still reserved; with `--set NAME=VALUE`, again loaded under each
  such runtime setting (`nimble/runtime/base/settings.py`; a row of its own, an empty cache of its own);
- torch.compile(mode="reduce-overhead"): reserved after moving the model to the GPU and three
  calls, less before (weights included, as for nimble).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODELS = ["resnet50", "inception_v3", "googlenet", "mobilenet_v2", "efficientnet_b0", "squeezenet1_1",
          "densenet121", "inception", "nasnet", "resnet", "mobilenet", "transformer"]

NIMBLE = """
import json, sys, torch
import nimble
from nimble.runtime.base.settings import Settings
settings = Settings(**json.loads(sys.argv[2])) if len(sys.argv) > 2 else None  # what peers.setting changes
from nimble.formats import read_artifact
torch.cuda.init()
x = [t.cuda() for t in read_artifact(sys.argv[1]).sample_inputs]
torch.cuda.synchronize()
before = torch.cuda.memory_reserved()
exe = nimble.load(sys.argv[1], device="cuda", settings=settings)
exe(*x, copy=False)
torch.cuda.synchronize()
after = torch.cuda.memory_reserved()
doc = {"reserved_growth": after - before, "footprint": exe.stats.footprint.document(), "choice": exe.stats.choice,
       "tuning_ms": exe.stats.tuning_ms, "tuning_pool_bytes": exe.stats.tuning_pool_bytes}
exe.close()
doc["after_close"] = torch.cuda.memory_reserved() - before
print(json.dumps(doc))
"""

PEER = """
import json, sys, torch
sys.path.insert(0, sys.argv[2])
from peers import make_inputs
model, xs = make_inputs(sys.argv[1], int(sys.argv[3]))
xs = [x.cuda() for x in xs]
torch.cuda.synchronize()
before = torch.cuda.memory_reserved()
with torch.no_grad():
    compiled = torch.compile(model.cuda(), mode="reduce-overhead")
    for _ in range(3):
        compiled(*xs)
torch.cuda.synchronize()
print(json.dumps({"reserved_growth": torch.cuda.memory_reserved() - before}))
"""


def child(code: str, *args: str, cache: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    if cache:
        env["NIMBLE_CACHE_DIR"] = cache  # an empty tuning cache: the load times its choices
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compile_artifact(name: str, batch: int, folder: Path) -> Path:
    import torch

    from nimble.formats import write_artifact
    from nimble.frontend import quiet_torchscript
    from nimble.pipeline import compile_model
    from nimble.specs import input_specs
    from peers import make_inputs

    model, xs = make_inputs(name, batch)  # images, or token ids and a mask (the Hugging Face models)
    with torch.no_grad(), quiet_torchscript():
        torch.jit.save(torch.jit.trace(model, tuple(xs), check_trace=False), str(folder / "m.pt"))
    specs = input_specs(["x".join(map(str, x.shape)) for x in xs], [str(x.dtype).removeprefix("torch.") for x in xs])
    c = compile_model(folder / "m.pt", specs, device="cpu", check=False)
    path = folder / f"{name}_{batch}.nimble"
    write_artifact(path, c.artifact())
    return path


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--no-peer", action="store_true", help="Leave torch.compile out (it compiles for minutes).")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE",
                        help="also measure nimble loaded under this runtime setting, as cudnn_slower_outside=1.03 "
                             "(a row each)")
    args = parser.parse_args()
    from peers import setting

    for text in args.set:
        setting(text)  # exits, saying why, on a setting it cannot apply
    rows = []
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            for batch in args.batches:
                path = compile_artifact(name, batch, Path(tmp))
                row = {"model": name, "batch": batch,
                       "nimble": child(NIMBLE, str(path), cache=str(Path(tmp) / f"cache_{name}_{batch}"))}
                if not args.no_peer:
                    row["torch_compile"] = child(PEER, name, str(ROOT / "benchmarks"), str(batch))
                rows.append(row)
                print(json.dumps(row), flush=True)
                peer = row.get("torch_compile", {})  # the same model's, beside each setting's row
                for k, text in enumerate(args.set):
                    cache = str(Path(tmp) / f"cache_{name}_{batch}_{k}")
                    rows.append({"model": f"{name} ({text})", "batch": batch, "setting": text,
                                 "nimble": child(NIMBLE, str(path), json.dumps(setting(text).changed()), cache=cache),
                                 "torch_compile": peer})
                    print(json.dumps(rows[-1]), flush=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": str(datetime.date.today()),
            "command": "python " + " ".join(sys.argv)}
    body = []
    for r in rows:
        n, f = r["nimble"], r["nimble"].get("footprint")
        peer = r.get("torch_compile", {}).get("reserved_growth")
        if f is None:
            body.append([r["model"], r["batch"], n.get("error", "?")] + [""] * 12)
            continue
        target = f["weights"] + f["arena"] + 64 * mib
        body.append([r["model"], r["batch"], *(f"{f[k] / mib:.1f}" for k in (
            "weights", "arena", "inputs", "outside_arena", "pool_free", "other_allocated", "cached")),
            len(f["pool_segments_per_stream"]), f"{n['reserved_growth'] / mib:.1f}",
            f"{target / mib:.1f}", "-" if peer is None else f"{peer / mib:.1f}",
            "-" if peer is None else f"{n['reserved_growth'] / peer:.2f}", f"{n['after_close'] / mib:.1f}"])
    lines = [f"GPU footprint of a loaded artifact, {meta['gpu']}, torch {meta['torch']}, fp32, {meta['date']}. "
             f"Command: `{meta['command']}`. MiB; each measurement in a fresh process; reserved growth over "
             "nimble.load (default tuning, empty cache) and one call.", "",
             *report.table(["model", "batch", "weights", "arena", "inputs", "outside arena", "pool free", "other",
                            "cached", "pool streams", "nimble reserved", "target (w+a+64)",
                            "torch.compile reserved", "nimble / torch.compile", "after close()"], body)]
    report.write(args.out, "memory_footprint", lines, {"meta": meta, "rows": rows})
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
