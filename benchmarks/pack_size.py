"""What a kernel pack adds to an artifact: each model compiled at batch 1 with its pack for one
architecture on this machine, no GPU visible (as `cold_start.py` builds them), and the sizes of the
artifact and of the pack beside it.

    python benchmarks/pack_size.py --out DIR [--models resnet50 densenet121 ...] [--arch sm_90] [--work W]

--models takes any model of the peers suite (`peers.py`). Writes DIR/pack_size.json and
DIR/pack_size.md after every model: per model, the artifact's bytes, the pack's bytes and kernels,
the pack as a share of the artifact, and the compile's wall seconds (building the pack included;
on a shared machine only a rough figure). The issue's target: a pack adds at most 30 % to the
artifact for one architecture.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import report  # noqa: E402  (beside this script)
MODELS = ("resnet50", "mobilenet_v2", "efficientnet_b0", "densenet121", "inception_v3", "googlenet", "swin_t",
          "vit_b_16", "bert-base")


def build(model: str, folder: Path, arch: str) -> tuple[Path, float]:
    """`model` traced at batch 1 and compiled into `folder` with its pack for `arch`, no GPU
    visible; its artifact and the compile's wall seconds."""
    import torch

    from peers import make_inputs
    from sample_models.build import MODELS as SAMPLES

    if model not in SAMPLES:  # before `peers` imports it (a CPU builder's torchvision wheel may lack its ops)
        from zoo import import_torchvision

        import_torchvision()

    from nimble.frontend import quiet_torchscript

    out = folder / f"{model}.nimble"
    m, xs = make_inputs(model, 1)
    script = folder / f"{model}.pt"
    with quiet_torchscript(), torch.no_grad():
        torch.jit.trace(m, tuple(xs), check_trace=False).save(script)
    shapes = [a for x in xs for a in ("--shape", "x".join(map(str, x.shape)), "--dtype",
                                      str(x.dtype).removeprefix("torch."))]
    cmd = [sys.executable, "-c", "from nimble_cli.entry import main; main()", "compile", str(script), *shapes,
           "-o", str(out), "--device", "cpu", "--gpu-arch", arch]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"pack_size.py: the compile of {model} failed: {done.stderr.strip().splitlines()[-1:]}")
    return out, time.perf_counter() - start


def kernels_in(pack: Path, arch: str) -> int | None:
    """How many kernels the pack holds, as a load that names it reads them (None where it would
    not use it: the load says why)."""
    from nimble.runtime.kernels import pack as packs

    try:
        return len(packs.Pack.open(pack, int(arch.removeprefix("sm_")), None, named=True))
    except packs.PackMiss:
        return None


def lines(rows: list[dict], meta: dict) -> list[str]:
    head = [f"Kernel packs against their artifacts: batch 1, fp32, one architecture ({meta['arch']}), built on "
            f"{meta['machine']} with no GPU visible, torch {meta['torch']}, {meta['date']}. Command: "
            f"`python benchmarks/pack_size.py --out DIR --models {' '.join(r['model'] for r in rows)} --arch "
            f"{meta['arch']}`. The compile's seconds include building the pack, from Triton's cache where "
            "this machine built a kernel before.", ""]
    cells = [[r["model"], f"{r['artifact_bytes'] / 2**20:.2f}", f"{r['pack_bytes'] / 2**20:.2f}",
              r["kernels"] if r["kernels"] is not None else "n/a", f"{100 * r['share']:.1f} %", f"{r['compile_s']:.1f}"]
             for r in rows]
    worst = max(rows, key=lambda r: r["share"])
    return head + report.table(["model", "artifact MiB", "pack MiB", "kernels", "pack / artifact",
                                "compile s (pack included)"], cells) \
        + ["", f"Largest share: {worst['model']}, {100 * worst['share']:.1f} % (target: at most 30 %)."]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--work", type=Path, help="where the models are compiled (default a new temporary folder)")
    a = ap.parse_args(argv)
    import torch

    a.out.mkdir(parents=True, exist_ok=True)
    work = a.work or Path(tempfile.mkdtemp(prefix="pack_size_"))
    work.mkdir(parents=True, exist_ok=True)
    meta = {"arch": a.arch, "machine": f"{platform.node()} ({os.cpu_count()} cores)", "torch": torch.__version__,
            "date": datetime.date.today().isoformat()}
    rows = []
    for model in a.models:
        artifact, seconds = build(model, work, a.arch)
        pack = Path(f"{artifact}.kernels")
        size, extra = artifact.stat().st_size, pack.stat().st_size
        rows.append({"model": model, "artifact_bytes": size, "pack_bytes": extra, "kernels": kernels_in(pack, a.arch),
                     "share": extra / size, "compile_s": seconds})
        print(f"{model}: artifact {size / 2**20:.2f} MiB, pack {extra / 2**20:.2f} MiB ({100 * extra / size:.1f} %), "
              f"compiled in {seconds:.1f} s", flush=True)
        report.write(a.out, "pack_size", lines(rows, meta), {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
