"""What the canonical op order (`passes.order_canonically`) does to speed: each model compiled from
TorchScript and from torch.export, with the op order as the frontend emitted it (the pass left
out, as before it existed) and canonical (both frontends then give one schedule), loaded on CUDA
with the load-time choice timed (`--tune full`), in one process.

    python benchmarks/canonical_order.py --out DIR [--models resnet18 resnet50 ...] [--batches 1 8]

Per variant, two figures as medians: GPU-bound (50 back-to-back replays between CUDA events, median
of 15 such runs) and latency (copy the input in, replay, synchronize; median of 200). Also the
streams the schedule has, the load-time choice, and parity with eager PyTorch (TF32 tolerances).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

import report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TORCHVISION = {"resnet18": 224, "resnet50": 224, "inception_v3": 299, "googlenet": 224}
SAMPLES = ("resnet", "nasnet", "transformer")


def make(name: str, batch: int):
    import torch

    if name in TORCHVISION:
        import torchvision

        torch.manual_seed(0)
        extra = {"aux_logits": False, "init_weights": True} if name in ("inception_v3", "googlenet") else {}
        model = getattr(torchvision.models, name)(weights=None, **extra).eval()
        return model, (torch.randn(batch, 3, TORCHVISION[name], TORCHVISION[name]),)
    from sample_models.build import MODELS, build_module

    gen = torch.Generator().manual_seed(0)
    return build_module(name), tuple(torch.randn((batch, *s[1:]), generator=gen) for s in MODELS[name][1])


def bench(name: str, batch: int, tmp: Path) -> list[dict]:
    import torch

    from nimble import pipeline
    from nimble.frontend import quiet_torchscript
    from nimble.runtime.base.compare import compare
    from nimble.runtime.executable import Executable
    from nimble.runtime.base.timing import gpu_ms
    from nimble.specs import input_specs

    model, xs = make(name, batch)
    with torch.no_grad(), quiet_torchscript():
        torch.jit.save(torch.jit.trace(model, xs, check_trace=False), str(tmp / "m.pt"))
        torch.export.save(torch.export.export(model, xs), str(tmp / "m.pt2"))
        want = model.cuda()(*[x.cuda() for x in xs])
    want = [want] if isinstance(want, torch.Tensor) else list(want)
    specs = input_specs(["x".join(map(str, x.shape)) for x in xs])
    canonical = pipeline.PASSES
    emitted = tuple(p for p in canonical if p.__name__ != "order_canonically")
    rows = []
    for order, passes in (("emitted", emitted), ("canonical", canonical)):
        for frontend, path, given in (("torchscript", tmp / "m.pt", specs), ("torch.export", tmp / "m.pt2", None)):
            pipeline.PASSES = passes
            try:
                c = pipeline.compile_model(path, given, device="cpu", check=False)
            finally:
                pipeline.PASSES = canonical
            exe = Executable(c.artifact(), "cuda", tune="full")
            inputs = [x.cuda() for x in xs]
            parity = compare(exe.run(*inputs), want, 1e-2, 1e-3)
            rows.append({"model": name, "batch": batch, "order": order, "frontend": frontend,
                         "ops": len(c.graph.ops), "streams": c.schedule.num_streams,
                         "schedule": [list(c.schedule.stream), [list(w) for w in c.schedule.waits]],
                         "choice": exe.stats.choice, "parity": "ok" if parity.passed else parity.describe(),
                         "gpu_bound_ms": gpu_ms(exe.replay, torch.device("cuda"), 50, 15, warmup=10),
                         "latency_ms": report.median_ms(lambda: exe(*inputs, copy=False))})
            print({k: v for k, v in rows[-1].items() if k != "schedule"}, flush=True)
            del exe
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=[*TORCHVISION, *SAMPLES])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            for batch in args.batches:
                rows += bench(name, batch, Path(tmp))
    canonical = {}
    for r in rows:
        if r["order"] == "canonical":
            canonical.setdefault((r["model"], r["batch"]), []).append(r["schedule"])
    same = all(a == b for a, b in canonical.values())
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": str(datetime.date.today()),
            "command": "python " + " ".join(sys.argv)}
    lines = [f"Canonical op order against emission order, {meta['gpu']}, torch {meta['torch']}, fp32, "
             f"{meta['date']}. Command: `{meta['command']}`. Milliseconds, medians, one process.", "",
             *report.table(["model", "batch", "order", "frontend", "ops", "streams", "choice", "GPU-bound ms",
                            "latency ms", "parity"],
                           [[r["model"], r["batch"], r["order"], r["frontend"], r["ops"], r["streams"], r["choice"],
                             f"{r['gpu_bound_ms']:.3f}", f"{r['latency_ms']:.3f}", r["parity"]] for r in rows])]
    ok = same and all(r["parity"] == "ok" for r in rows)
    report.write(args.out, "canonical_order", doc={"meta": meta, "rows": rows})
    return report.finish(args.out, "canonical_order", lines,
                         "canonical: both frontends give one schedule; every variant matches eager" if ok else
                         "FAILED: a canonical schedule differs between frontends, or a variant differs from eager",
                         ok)

if __name__ == "__main__":
    sys.exit(main())
