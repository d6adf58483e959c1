"""Loss curves of `nimble.TrainStep` against eager PyTorch, free-running, beside eager's own
spread: how far 100 steps of nimble drift from eager, and how far eager drifts from itself when
its starting weights differ in the last bits.

    python benchmarks/training_curves.py [--models resnet18 mobilenet_v2] [--steps 100]
                                         [--precision fp32 bf16] [--lr 0.01] [--device cpu] [--out DIR]

Per model and precision, from the same weights and the same batches (torchvision's model with 10
classes, 32x32 inputs, batch 8, SGD with momentum 0.9 at --lr): nimble's step, eager's step, and eager
again from weights multiplied by 1 + 1e-7 * noise (the control). Training is chaotic: a
difference of one rounding grows by orders of magnitude within tens of steps, so a curve that
follows eager as closely as eager's control does is as close as float arithmetic allows. Each
step's exactness is tested apart (tests/runtime/test_train_step.py starts eager from nimble's
weights at every step). Reported: the largest |loss difference| over the steps and over the
first 10, for nimble and for the control, and the last losses. Writes training_curves.md/json.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
from pathlib import Path

import report

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def curves(name: str, steps: int, precision: str, device: str, lr: float) -> dict:
    import nimble
    import torch
    import torch.nn.functional as F
    import zoo

    tv = zoo.import_torchvision()
    torch.manual_seed(0)
    base = getattr(tv.models, name)(num_classes=10).to(device).train()
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 3, 32, 32, generator=gen).to(device), torch.randint(0, 10, (8,), generator=gen).to(device))
            for _ in range(steps)]
    amp = precision == "bf16"

    def eager_curve(net) -> list[float]:
        opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
        out = []
        for x, t in data:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=amp):
                loss = F.cross_entropy(net(x), t)
            loss.backward()
            opt.step()
            out.append(loss.item())
        return out

    eager = eager_curve(copy.deepcopy(base))
    control_net = copy.deepcopy(base)
    with torch.no_grad():
        for p in control_net.parameters():
            p.mul_(1 + 1e-7 * torch.randn_like(p))
    control = eager_curve(control_net)
    net = copy.deepcopy(base)
    step = nimble.TrainStep(net, F.cross_entropy, *data[0], precision=precision,
                            optimizer=torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9))
    mine = [step(x, t).item() for x, t in data]

    def worst(curve, n=None):
        return max(abs(a - b) for a, b in list(zip(curve, eager))[:n])

    return {"model": name, "precision": precision, "steps": steps, "lr": lr, "nimble_max": worst(mine),
            "nimble_max_10": worst(mine, 10), "control_max": worst(control), "control_max_10": worst(control, 10),
            "last": {"nimble": mine[-1], "eager": eager[-1], "control": control[-1]}}


def summary(rows: list[dict], meta: dict) -> str:
    lines = [f"# TrainStep loss curves against eager ({meta['device']}, torch {meta['torch']}, {meta['date']})", "",
             "`python benchmarks/training_curves.py`: free-running steps from the same weights and batches",
             "(batch 8, 32x32, SGD with momentum 0.9). Control: eager from weights changed by 1e-7 relative.", ""]
    lines += report.table(
        ["model", "precision", "lr", "steps", "max abs loss diff, nimble (first 10)", "control (first 10)",
         "last loss nimble / eager / control"],
        [[r["model"], r["precision"], r["lr"], r["steps"], f"{r['nimble_max']:.2e} ({r['nimble_max_10']:.2e})",
          f"{r['control_max']:.2e} ({r['control_max_10']:.2e})",
          f"{r['last']['nimble']:.4f} / {r['last']['eager']:.4f} / {r['last']['control']:.4f}"] for r in rows])
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet18", "mobilenet_v2"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: give at least 1")
    if not args.lr > 0:
        ap.error(f"--lr {args.lr}: give a positive learning rate")
    import torch

    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({torch.get_num_threads()} "
            "threads)", "torch": torch.__version__, "date": datetime.date.today().isoformat()}
    rows = []
    for name in args.models:
        for precision in args.precision:
            rows.append(curves(name, args.steps, precision, args.device, args.lr))
            print(rows[-1], flush=True)
    text = summary(rows, meta)
    report.write(args.out, "training_curves", text, {"meta": meta, "rows": rows})
    print(text)


if __name__ == "__main__":
    main()
