"""Data-parallel training throughput: images per second of `nimble.TrainStep` on one GPU and on
several, against eager PyTorch under DistributedDataParallel, as torchrun launches them.

    python benchmarks/training_ddp.py --out DIR [--gpus 2] [--model resnet50] [--batch 32] [--size 224]

It launches `torchrun --standalone --nproc-per-node N` on itself for N = 1 and N = --gpus; each
process trains torchvision's model (10 classes) on its own fixed random batch of --batch images
(the per-GPU batch), with SGD with momentum, fp32 (TF32 as PyTorch defaults), and rank 0 writes
the median synchronized step time. Scaling = images per second with N GPUs over one GPU's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import report


def worker(args) -> None:
    """One process of a torchrun launch: both variants, timed; rank 0 writes them to --out."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import zoo

    torchvision = zoo.import_torchvision()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import nimble

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    torch.cuda.set_device(device)
    gen = torch.Generator(device=device).manual_seed(rank)
    x = torch.randn(args.batch, 3, args.size, args.size, device=device, generator=gen)
    y = torch.randint(0, 10, (args.batch,), device=device, generator=gen)
    row = {"gpus": world, "model": args.model, "batch_per_gpu": args.batch, "size": args.size}

    def timed(step) -> float:
        for _ in range(5):
            step()
        times = []
        for _ in range(args.iters):
            torch.cuda.synchronize(device)
            dist.barrier()
            t = time.perf_counter()
            step()
            torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    torch.manual_seed(0)
    net = getattr(torchvision.models, args.model)(weights=None, num_classes=10).to(device).train()
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=[device.index]) if world > 1 else net
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def eager():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()

    row["eager_ms"] = timed(eager)
    eager = ddp = opt = net = None  # dropped before the next variant
    torch.manual_seed(0)
    net = getattr(torchvision.models, args.model)(weights=None, num_classes=10).to(device).train()
    t = time.perf_counter()
    step = nimble.TrainStep(net, F.cross_entropy, x, y,
                            optimizer=torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=True))
    row["step_prepare_s"] = time.perf_counter() - t
    row["step_ms"] = timed(lambda: step(x, y))
    for key in ("eager", "step"):
        row[f"{key}_images_per_s"] = world * args.batch / row[f"{key}_ms"] * 1e3
    if rank == 0:
        Path(args.out, f"ddp_{world}.json").write_text(json.dumps(row) + "\n")
    step.close()  # a captured all-reduce would keep the process group from closing
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--batch", type=int, default=32, help="images per GPU")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return
    import torch

    rows = []
    for n in (1, args.gpus):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), __file__,
               "--worker", "--out", str(args.out.resolve()), "--model", args.model, "--batch", str(args.batch),
               "--size", str(args.size), "--iters", str(args.iters)]
        done = subprocess.run(cmd, cwd=Path(__file__).parent)
        if done.returncode:
            sys.exit(f"the {n}-GPU launch failed (exit {done.returncode}); its output is above")
        rows.append(json.loads((args.out / f"ddp_{n}.json").read_text()))
    one, many = rows
    lines = [f"# Data-parallel training ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"{datetime.date.today().isoformat()})", "",
             f"{args.model}, {args.size} px, batch {args.batch} per GPU, fp32 (TF32), SGD with momentum; "
             "`python benchmarks/training_ddp.py`; median ms per synchronized step.", "",
             *report.table(["variant", "1 GPU ms", f"{args.gpus} GPUs ms", "images/s 1 GPU",
                            f"images/s {args.gpus} GPUs", "scaling"],
                           [[name, f"{one[f'{k}_ms']:.2f}", f"{many[f'{k}_ms']:.2f}",
                             f"{one[f'{k}_images_per_s']:.0f}", f"{many[f'{k}_images_per_s']:.0f}",
                             f"{many[f'{k}_images_per_s'] / one[f'{k}_images_per_s']:.2f}"]
                            for name, k in (("eager (DDP)", "eager"), ("nimble.TrainStep", "step"))])]
    report.write(args.out, "training_ddp", lines, {"rows": rows})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
