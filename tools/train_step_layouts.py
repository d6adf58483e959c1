"""A channels_last `nimble.TrainStep` against eager in channels_last, on torchvision's classifiers
(any device; written to try `layout="channels_last"`, the CUDA default for conv nets, on models
that no test covers).

    python tools/train_step_layouts.py [MODEL ... | --all] [--size 96] [--batch 2] [--layout channels_last]
                                       [--device cuda] [--unfused-norms]

`--all`: every torchvision classification model but `zoo.SKIP`'s (too large for a CPU builder),
the ones that need a larger input at its size (`LEAST`), the vision transformers built for `--size`.

Each model (10 classes, dropout and stochastic depth off, so that both sides compute the same)
takes one step from the same weights and batch: printed are both losses, the relative difference
of all gradients as one vector, and how many of the step's planned 4-D buffers are channels_last;
a model that fails says so in one line and the rest go on. TF32 is off (float32 on both sides). Beside
them, how far eager's own gradients move in the other layout (on CUDA at batch 2, ResNeXt's and
GoogLeNet's by 1e-2: batch norms over a few values amplify the order of a kernel's sums). Exit
status 1 if any failed or was off by more than 1e-4 or twice that movement, whichever is larger.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

MODELS = ("resnet18", "shufflenet_v2_x0_5", "vgg11", "alexnet", "squeezenet1_0", "densenet121", "mnasnet0_5",
          "regnet_x_400mf", "googlenet", "efficientnet_b0", "mobilenet_v3_small", "convnext_tiny")
LEAST = {"inception_v3": 96, "googlenet": 96, "maxvit_t": 224}  # the smallest input these take


def one(name: str, size: int, batch: int, layout: str, device: str, fused_norms=None) -> tuple[bool, str]:
    import torch
    import torch.nn.functional as F
    import zoo

    import nimble

    torchvision = zoo.import_torchvision()
    # float32 on both sides: TF32 convolutions (PyTorch's default on CUDA) round each side otherwise
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    size = max(size, LEAST.get(name, size))
    extra = {"aux_logits": False, "init_weights": False} if name in ("googlenet", "inception_v3") else {}
    if name.startswith("vit_"):
        extra["image_size"] = size
    net = getattr(torchvision.models, name)(num_classes=10, **extra).train().to(device)
    for module in net.modules():  # no random ops: eager and the step would draw apart
        if isinstance(module, torch.nn.Dropout) or type(module).__name__ == "StochasticDepth":
            module.p = 0.0
    fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    ref = copy.deepcopy(net).to(memory_format=fmt)
    x, y = torch.randn(batch, 3, size, size, device=device), torch.randint(0, 10, (batch,), device=device)
    step = nimble.TrainStep(net, F.cross_entropy, x, y, layout=layout, fused_norms=fused_norms)
    expected = F.cross_entropy(ref(x.contiguous(memory_format=fmt)), y)
    expected.backward()
    expected = expected.detach()
    loss = step(x, y)
    ours = torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.grad is not None])
    theirs = torch.cat([p.grad.reshape(-1) for p in ref.parameters() if p.grad is not None])
    off = float((ours - theirs).norm() / theirs.norm().clamp_min(1e-12))
    laid = sum(1 for t in step.runner.views.values() if t.dim() == 4 and not t.is_contiguous())
    # eager in the other layout: how far eager's own gradients move when only its kernels' order
    # changes (on CUDA at batch 2, batch norms over a few values amplify it to 1e-2 in some models)
    other = copy.deepcopy(ref).to(memory_format=torch.contiguous_format if layout == "channels_last"
                                  else torch.channels_last)
    for p in other.parameters():
        p.grad = None
    F.cross_entropy(other(x.contiguous(memory_format=torch.channels_last if layout != "channels_last"
                                       else torch.contiguous_format)), y).backward()
    moved = torch.cat([p.grad.reshape(-1) for p in other.parameters() if p.grad is not None])
    noise = float((moved - theirs).norm() / theirs.norm().clamp_min(1e-12))
    ok = off <= max(1e-4, 2 * noise) and abs(float(loss) - float(expected)) <= max(1e-4, 2 * noise) * abs(
        float(expected))
    return ok, (f"loss {float(loss):.5f} against eager's {float(expected):.5f}, gradients {off:.1e} off "
                f"(eager's own in the other layout {noise:.1e}), {laid} channels_last buffers")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(MODELS))
    ap.add_argument("--all", action="store_true", help="every torchvision classification model (but zoo.SKIP)")
    ap.add_argument("--size", type=int, default=96)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layout", choices=("channels_last", "contiguous"), default="channels_last")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--unfused-norms", action="store_true", help="fused_norms=False: aten's batch norms and activations")
    args = ap.parse_args()
    if args.all:
        import zoo

        models = zoo.import_torchvision().models
        args.models = sorted(n for n in models.list_models(module=models) if n not in zoo.SKIP)
    failed = 0
    for name in args.models:
        start = time.perf_counter()
        try:
            ok, text = one(name, args.size, args.batch, args.layout, args.device,
                           False if args.unfused_norms else None)
        except Exception as e:  # one line per model, and the rest still run
            ok, text = False, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        failed += not ok
        print(f"{name:20s} {'ok ' if ok else 'OFF'} {text} ({time.perf_counter() - start:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
