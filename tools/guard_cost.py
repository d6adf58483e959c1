"""What the Python API's stale-weight guard costs a call, on any machine (the CPU too): a
ResNet-50 prepared with `nimble.Nimble`, then the guard's check alone, timed over many calls,
for the watch (`core/watch.py`: one flag) and the older every-tensor check (`guards.EveryTensor`) on an
unwatched copy of the same module, in one process.

    python tools/guard_cost.py [--device cpu|cuda] [--calls 100000]

ResNet-50 from torchvision where it is installed, else Hugging Face's ResNet-50 (transformers'
default ResNetConfig). Prints one line per guard: microseconds per check (the median of 5 runs).
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time


def resnet50():
    try:
        import torchvision

        return torchvision.models.resnet50(weights=None), "torchvision resnet50"
    except Exception:
        import transformers

        return transformers.ResNetModel(transformers.ResNetConfig()), "Hugging Face ResNet-50 (ResNetConfig())"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=100000)
    args = parser.parse_args()
    import torch

    import nimble
    from nimble.guards import EveryTensor

    torch.manual_seed(0)
    module, label = resnet50()
    module = module.eval().to(args.device)
    plain = copy.deepcopy(module)
    x = torch.randn(1, 3, 224, 224, device=args.device)
    model = nimble.Nimble(module).prepare(x)
    tensors = len(list(module.parameters())) + len(list(module.buffers()))
    where = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    print(f"{label}, {tensors} parameters and buffers; {args.device} ({where}), torch {torch.__version__}, "
          f"Python {platform.python_version()}; command: python tools/guard_cost.py {' '.join(sys.argv[1:])}")
    for name, check in (("watch (a call's guard now)", model._guard.check),
                        ("every-tensor check (the older guard)", EveryTensor(plain, versions=True).check)):
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(args.calls):
                check()
            runs.append((time.perf_counter() - t) / args.calls * 1e6)
        print(f"  {name}: {statistics.median(runs):.3f} us per call (median of 5 runs of {args.calls})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
