"""Which aten out= kernels write a buffer of another memory format wrong, on this machine's torch
and device: every op of torchvision models' training steps, called through its out= overload into
contiguous and channels_last buffers, with its tensor inputs as the step traced them and in the
other format, against the reference executor's result (an instrument for the training issue).

    python tools/out_layouts.py [MODEL ...] [--device cuda] [--size 64] [--batch 2]

A training step writes an op's result into its planned buffer through the op's out= overload, and
PyTorch's out= kernels do not all honour the buffer's strides: some write in their input's memory
format whatever the buffer's (max pooling on CUDA), some write wrong values into a buffer of
another layout (softmax and exact GELU on the CPU). `runtime/placed/placement` keeps the ones
found so far apart (`STRIDES_IGNORED`, `LAYOUT_BOUND`, `COPYING_OUT`), and this finds the others.

Each model is traced as a channels_last `nimble.TrainStep` (fused_norms=False: aten's batch norms,
so that they are checked too; dropout and stochastic depth off), run once by the reference
executor for every value, then each op with an out= overload that writes (not one torch
generates, which computes and copies) and a result of rank 4 or more is called 4 ways: inputs as
traced or flipped (contiguous <-> channels_last) by buffers contiguous or channels_last. Printed:
one line per (op, inputs, buffer) that is off by more than 1e-3 of its largest value, with whether
the step guards it; then a summary. Exit status 1 if any op that the step does not guard is off.
TF32 is off.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tools"))

MODELS = ("resnet18", "googlenet", "mobilenet_v3_small", "efficientnet_b0", "convnext_tiny", "swin_t", "maxvit_t",
          "shufflenet_v2_x0_5", "squeezenet1_0", "inception_v3")


def _flip(torch, t):
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        return t
    cl = t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
    return t.contiguous(memory_format=torch.contiguous_format if cl else torch.channels_last)


def _buffer(torch, like, fmt):
    return torch.empty_like(like, memory_format=fmt) if like.dim() == 4 else torch.empty_like(like)


def check(name: str, size: int, batch: int, device: str, found: dict) -> None:
    """`check_module` on torchvision's `name` (10 classes) at `size` px."""
    import torch
    import zoo
    from train_step_layouts import LEAST

    torchvision = zoo.import_torchvision()
    torch.manual_seed(0)
    size = max(size, LEAST.get(name, size))
    extra = {"aux_logits": False, "init_weights": False} if name in ("googlenet", "inception_v3") else {}
    net = getattr(torchvision.models, name)(num_classes=10, **extra).train().to(device)
    x, y = torch.randn(batch, 3, size, size, device=device), torch.randint(0, 10, (batch,), device=device)
    check_module(name, net, x, y, found)


def check_module(name: str, net, x, y, found: dict) -> None:
    """Add to `found` each (target, inputs, buffer) way that the out= kernels of `net`'s training
    step (cross-entropy of `net(x)` against `y`, on their device) write off: (name, how far off,
    whether the step guards it). Prints a line for each new one."""
    import torch
    import torch.nn.functional as F

    import nimble
    from nimble.ops import arguments, fusion
    from nimble.runtime.placed import reference
    from nimble.runtime.placed.placement import COPYING_OUT, LAYOUT_BOUND, STRIDES_IGNORED, copies, out_overload

    device = x.device
    net = copy.deepcopy(net)
    for module in net.modules():
        if isinstance(module, torch.nn.Dropout) or type(module).__name__ == "StochasticDepth":
            module.p = 0.0
    step = nimble.TrainStep(net, F.cross_entropy, x, y, layout="channels_last", streams=1,
                            cuda_graphs=False, fused_norms=False)
    graph = step.graph
    data = iter([x, y])  # as the step traced it: every view of the trace replays
    bound = [t if t is not None else next(data) for t in step._bound]
    constants = {graph.values[vid].name: t for vid, t in step.runner._constants.items()}
    values = reference.run_values(graph, constants, bound, device, training=True)
    formats = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
    for op in graph.ops:
        if op.target == fusion.FUSED or op.target.startswith("nimble::"):
            continue
        overload = out_overload(op.target, training=True)
        results = [values.get(v) for v in op.outputs]
        if overload is None or copies(overload[0]) or len(overload[1]) != len(results) or not all(
                isinstance(r, torch.Tensor) and r.is_floating_point() for r in results) \
                or not any(r.dim() >= 4 for r in results):
            continue
        args, kwargs = arguments.op_arguments(op, values, device)
        guarded = op.target in STRIDES_IGNORED or op.target in LAYOUT_BOUND or op.target in COPYING_OUT
        for inputs in ("as traced", "flipped"):
            given = args if inputs == "as traced" else [_flip(torch, a) for a in args]
            for label, fmt in formats.items():
                buffers = [_buffer(torch, r, fmt) for r in results]
                with torch.no_grad():
                    overload[0](*given, **kwargs, **dict(zip(overload[1], buffers)))
                off = max(float((b.float() - r.float()).abs().max()) / (float(r.float().abs().max()) + 1e-6)
                          for b, r in zip(buffers, results))
                key = (op.target, inputs, label)
                if off > 1e-3 and key not in found:
                    strides = [tuple(a.stride()) for a in given if isinstance(a, torch.Tensor)][:2]
                    found[key] = (name, off, guarded)
                    print(f"{name:20s} {op.target} inputs {inputs} {strides} into {label}: {off:.3g} off"
                          f"{' (guarded)' if guarded else ' (NOT GUARDED)'}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(MODELS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    import torch

    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    found: dict = {}
    for name in args.models:
        try:
            check(name, args.size, args.batch, args.device, found)
        except Exception as e:  # one line per model, and the rest still run
            print(f"{name:20s} failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                  flush=True)
    unguarded = sorted({k[0] for k, (_, _, guarded) in found.items() if not guarded})
    print(f"{len(found)} (op, inputs, buffer) ways off; not guarded: {', '.join(unguarded) or 'none'}")
    return 1 if unguarded else 0


if __name__ == "__main__":
    sys.exit(main())
