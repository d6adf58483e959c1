"""The in-process call path: `nimble.Nimble(module)(x)` against `nimble.load(path)(x)` for the
same model, in one process on CUDA. Nimble's call also checks that the module has not changed
since `prepare`: `core/watch.py` notes changes as they happen, so a call checks one flag; the
older check of every parameter and buffer (`guards.EveryTensor`: replaced, given new storage or written
in place, still used for TorchScript modules) is timed beside it. This measures what each costs.

    python tools/call_path.py [--model resnet50] [--batch 1]

Prints latency medians (copy in, run, synchronize; 200 calls) in ms for both, with fresh outputs
and with views (`copy=False`), and the guard's check alone."""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # report.py, peers.py: the benchmarks'

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    import torch
    import torchvision

    import nimble
    from report import median_ms

    if not torch.cuda.is_available():
        print("call_path.py times CUDA calls; run it on a machine with a GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    module = getattr(torchvision.models, args.model)(weights=None).eval().cuda()
    x_host = torch.randn(args.batch, 3, 224, 224)
    x = x_host.cuda()
    plain = copy.deepcopy(module)  # unwatched, for the older guard
    wrapped = nimble.Nimble(module).prepare(x)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.nimble"
        wrapped.save(path)
        loaded = nimble.load(path, device="cuda")
    rows = {
        "Nimble(module)(x)": median_ms(lambda: wrapped(x_host.cuda(non_blocking=True))),
        "load(path)(x)": median_ms(lambda: loaded(x_host.cuda(non_blocking=True))),
        "Nimble(module)(x, copy=False)": median_ms(lambda: wrapped(x_host.cuda(non_blocking=True), copy=False)),
        "load(path)(x, copy=False)": median_ms(lambda: loaded(x_host.cuda(non_blocking=True), copy=False)),
    }
    from nimble.guards import EveryTensor

    tensors = len(list(module.parameters())) + len(list(module.buffers()))
    for label, guard in (("watch check alone (this call's guard)", wrapped._guard),
                         ("every-tensor check alone (the older guard)", EveryTensor(plain, versions=True))):
        t = time.perf_counter()
        for _ in range(10000):
            guard.check()
        rows[label] = (time.perf_counter() - t) / 10  # ms per call
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model} batch {args.batch}, fp32; "
          f"{tensors} parameters and buffers; latency medians of 200 calls, ms")
    for name, ms in rows.items():
        print(f"  {name}: {ms:.4f}")
    print(f"  difference, fresh outputs: {rows['Nimble(module)(x)'] - rows['load(path)(x)']:.4f}; "
          f"views: {rows['Nimble(module)(x, copy=False)'] - rows['load(path)(x, copy=False)']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
