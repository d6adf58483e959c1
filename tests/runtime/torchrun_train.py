"""A data-parallel training script as a user writes it for `torchrun` (run by
test_train_step_parallel.py::test_torchrun_launches_data_parallel_training_on_gloo): each process
trains its own batches with one `nimble.TrainStep`, then writes its losses and a digest of its
weights to `rank<N>.txt` in the working folder (a file each: the processes' prints interleave). With
`--nccl` each process trains on its own GPU (cuda:RANK) over NCCL, its step captured into a CUDA
graph unless `--no-graphs` (test_gpu_train_step.py)."""

import faulthandler
import hashlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import nimble  # noqa: E402
from tests.models import MobileNetV2Small  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    nccl = "--nccl" in sys.argv
    if nccl:  # a process that hangs (a collective one rank never joins) ends with where it was
        faulthandler.dump_traceback_later(60, exit=True)
    dist.init_process_group("nccl" if nccl else "gloo")  # rank, world size and rendezvous from torchrun's environment
    rank = dist.get_rank()
    device = torch.device(f"cuda:{rank}" if nccl else "cpu")
    if nccl:
        torch.cuda.set_device(device)
    torch.manual_seed(rank)  # each process starts elsewhere: the step takes rank 0's weights
    net = MobileNetV2Small().to(device)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(4, 3, 32, 32, generator=gen).to(device), torch.randint(0, 10, (4,), generator=gen).to(device))
               for _ in range(5 if nccl else 3)]  # on CUDA: an eager step, the capture, replays
    step = nimble.TrainStep(net, F.cross_entropy, *batches[0], cuda_graphs="--no-graphs" not in sys.argv,
                            optimizer=torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=True))
    losses = [float(step(x, t)) for x, t in batches]
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).cpu()
    torch.save(flat, f"weights{rank}.pt")
    weights = flat.numpy().tobytes()
    Path(f"rank{rank}.txt").write_text(f"losses {losses} weights {hashlib.sha256(weights).hexdigest()}\n")
    step.close()  # a captured all-reduce would keep the process group from closing
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
