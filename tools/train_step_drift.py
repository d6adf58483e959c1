"""A captured `nimble.TrainStep` against eager PyTorch, step by step: the relative difference of
all gradients after each step, to find the step that goes wrong (a GPU instrument).

    python tools/train_step_drift.py [--steps 12] [--streams 1 auto] [--graphs on off]
                                     [--fused-kernels off on] [--model resnet18|mobilenet_v2_small]
                                     [--probe sync keep spread deterministic] [--smooth]

Each variant trains its own copy of the model from the same weights (SGD with momentum, fused),
on batches 8x3x32x32 drawn per step from fixed seeds; before each step the eager copy takes the
step's parameters and buffers, so every figure is one step's error alone. fp32 with TF32 off: a
clean step is within about 1e-5. `--fused-kernels off` runs fused ops op by op instead of through
inference's generated kernels (`kernels/fused.FusedKernel`), the step's own way on CUDA.

`--probe` adds variants that take one suspect away each, to find where a bad step comes from:
`sync` synchronizes the device after every op (the schedule's order and plan, with no two ops at
once; uncaptured only), `keep` drops no value before the step ends (torch's allocator cannot
hand a freed block to another op), `spread` gives every planned buffer a region of its own (no
buffer of the memory plan is shared), `deterministic` asks cuDNN and torch for deterministic
algorithms in both the step and eager. A bad step's worst parameter is named. `--smooth` takes
the kinks out of the model (`tests/models.smoothed`: SiLU for ReLU, average for max pooling).

Found with it (H200, torch 2.11, 2026-11-30): the rare bad steps (1e-4 to 1e-2, a few in 24) come
with every probe, on one stream too, captured or not: they are the kinks' flips (see `smoothed`),
not a race, the memory plan or the capture.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _spread(memory):
    """`memory` with every buffer in a region of its own."""
    import dataclasses

    offsets, top = [], 0
    for offset, size in zip(memory.offset, memory.size):
        offsets.append(None if offset is None else top)
        top += size if offset is not None else 0
    return dataclasses.replace(memory, offset=tuple(offsets), arena_bytes=max(top, memory.alignment))


def _probed(probe: str | None):
    """Patches for one probe (see the module): (object, attribute, replacement) triples."""
    import nimble.runtime.base.streams as streams
    import nimble.runtime.joint as joint
    import nimble.train as train
    import torch

    if probe == "sync":
        place = joint.JointRunner._place

        def synced(self, order, step):
            def each(i):
                step(i)
                torch.cuda.synchronize(self.device)
            place(self, order, each)
        return [(joint.JointRunner, "_place", synced)]
    if probe == "keep":
        return [(streams, "release_plan", lambda *args: {})]
    if probe == "spread":
        plan = train.plan
        return [(train, "plan", lambda *args: _spread(plan(*args)))]
    return []


def drift(make, steps: int, streams, graphs: bool, fused: bool, device: str = "cuda",
          probe: str | None = None) -> list[float]:
    """Each step's relative gradient difference from eager, for one variant (and `probe`)."""
    import nimble
    import nimble.runtime.joint as joint
    import torch
    import torch.nn.functional as F

    from tests.runtime.test_train_step import batch, relative

    placed = joint._placed
    patches = _probed(probe)
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    torch.backends.cudnn.deterministic = probe == "deterministic"
    torch.use_deterministic_algorithms(probe == "deterministic", warn_only=True)

    joint._placed = placed if fused else (lambda op, cuda: placed(op, False))
    try:
        torch.manual_seed(0)
        net = make().to(device)
        ref = copy.deepcopy(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=True)
        x, t = (v.to(device) for v in batch(8, 32))
        step = nimble.TrainStep(net, F.cross_entropy, x, t, optimizer=opt, streams=streams, cuda_graphs=graphs)
        errors = []
        names = [n for n, _ in net.named_parameters()]
        for k in range(steps):
            x, t = (v.to(device) for v in batch(8, 32, seed=k + 1))
            ref.load_state_dict(net.state_dict())
            ref.zero_grad(set_to_none=True)
            F.cross_entropy(ref(x), t).backward()
            step(x, t)
            errors.append(relative(torch.cat([p.grad.reshape(-1) for p in net.parameters()]),
                                   torch.cat([p.grad.reshape(-1) for p in ref.parameters()])))
            if errors[-1] > 1e-4:
                each = [relative(p.grad, q.grad) for p, q in zip(net.parameters(), ref.parameters())]
                worst = max(range(len(each)), key=each.__getitem__)
                print(f"  step {k}: {errors[-1]:.1e}, worst {names[worst]} {each[worst]:.1e}; "
                      f"{sum(e > 1e-4 for e in each)} of {len(each)} parameters over 1e-4", flush=True)
        step.close()
        return errors
    finally:
        joint._placed = placed
        for obj, name, value in saved:
            setattr(obj, name, value)
        torch.backends.cudnn.deterministic = False
        torch.use_deterministic_algorithms(False)


def _efficientnet_b0():
    """torchvision's efficientnet_b0 (10 classes) drawing no random numbers."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import zoo

    net = zoo.import_torchvision().models.efficientnet_b0(num_classes=10)
    for m in net.modules():
        if hasattr(m, "p") and type(m).__name__ in ("Dropout", "StochasticDepth"):
            m.p = 0.0
    return net


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--streams", nargs="+", default=["1", "auto"])
    ap.add_argument("--graphs", nargs="+", choices=("on", "off"), default=["on"])
    ap.add_argument("--fused-kernels", nargs="+", choices=("on", "off"), default=["off", "on"])
    ap.add_argument("--model", choices=("resnet18", "mobilenet_v2_small", "efficientnet_b0"), default="resnet18",
                    help="efficientnet_b0: torchvision's, with dropout and stochastic depth at p=0 (so that "
                         "both sides draw nothing) and no kinks (SiLU, sigmoid)")
    ap.add_argument("--probe", nargs="*", choices=("sync", "keep", "spread", "deterministic"), default=[],
                    help="variants that each take one suspect away (see the module); sync runs uncaptured only")
    ap.add_argument("--smooth", action="store_true", help="SiLU for ReLU, average for max pooling")
    ap.add_argument("--device", default="cuda", help="cpu checks the instrument itself (no capture, no kernels)")
    args = ap.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("train_step_drift needs a CUDA device: it compares captured steps with eager ones")
    from tests.models import MobileNetV2Small, ResNet18, smoothed

    build = {"resnet18": lambda: ResNet18(classes=10), "mobilenet_v2_small": MobileNetV2Small,
             "efficientnet_b0": _efficientnet_b0}[args.model]
    make = (lambda: smoothed(build())) if args.smooth else build
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    print(f"{args.model}{' (smoothed)' if args.smooth else ''}, fp32 (TF32 off), {where}, torch {torch.__version__}: "
          "relative gradient difference from eager per step")
    for probe, streams, graphs, fused in itertools.product([None, *args.probe], args.streams, args.graphs,
                                                           args.fused_kernels):
        if probe == "sync" and graphs == "on":
            continue
        errors = drift(make, args.steps, int(streams) if streams.isdigit() else streams, graphs == "on",
                       fused == "on", args.device, probe)
        print(f"{'probe ' + probe + ', ' if probe else ''}streams {streams}, graphs {graphs}, fused kernels {fused}: "
              + " ".join(f"{e:.1e}" for e in errors) + f"  (worst {max(errors):.1e})", flush=True)


if __name__ == "__main__":
    main()
