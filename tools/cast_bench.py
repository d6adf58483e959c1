"""What a bf16 training step's casts cost, three ways: a model's parameters cast float32 ->
bfloat16 (as its forward does) and bfloat16 gradients cast back to float32 (as its backward
leaves them: a weight's gradient through a transpose, a bias's dense), each way as PyTorch's
`copy_` per tensor (what a step's lone casts ran), as `torch._foreach_copy_`, and as
`runtime/kernels/casts.copy_all` (what `passes/group_casts` makes of them). Each variant is
captured into a CUDA graph of 5 runs and replayed; printed: the median us per run over 20
replays, and whether every result equals torch's cast. GPU only.

    python tools/cast_bench.py [--model vit_b_16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _timed(fn) -> float:
    """Median microseconds of one `fn()` over 20 replays of a CUDA graph of 5."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(5):
                fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / 5)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_b_16", help="a torchvision classification model")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cast_bench: needs a CUDA GPU")
    import zoo

    from nimble.runtime.kernels import casts

    zoo.import_torchvision()
    import torchvision

    net = torchvision.models.get_model(args.model)
    params = [p.detach().cuda() for p in net.parameters() if p.dim() >= 1]
    weights = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]
    # gradients as a linear's backward leaves them: 2-D ones the transpose of a row-major product
    grads = [torch.randn(p.shape[::-1], dtype=torch.bfloat16, device="cuda").t() if p.dim() == 2
             else torch.randn_like(p, dtype=torch.bfloat16) for p in params]
    into = [torch.empty_like(p) for p in params]
    print(f"{args.model}: {len(params)} tensors, {sum(p.numel() for p in params) / 1e6:.1f} M elements, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, sources, buffers in (("weights float32 -> bfloat16", params, weights),
                                   ("gradients bfloat16 -> float32", grads, into)):
        per = _timed(lambda: [d.copy_(s) for d, s in zip(buffers, sources)])
        each = _timed(lambda: torch._foreach_copy_(buffers, sources))
        grouped = _timed(lambda: casts.copy_all(sources, buffers))
        exact = all(torch.equal(d, s.to(d.dtype)) for d, s in zip(buffers, sources))
        print(f"  {name}: copy_ per tensor {per:.1f} us, _foreach_copy_ {each:.1f} us, "
              f"kernels/casts {grouped:.1f} us; equal to torch's casts: {exact}")


if __name__ == "__main__":
    main()
