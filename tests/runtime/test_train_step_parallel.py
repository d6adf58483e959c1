"""`nimble.TrainStep` data parallel on the CPU: two gloo processes against
DistributedDataParallel, and the launch a user makes with torchrun. (On two GPUs over NCCL:
test_gpu_train_step.py.)"""

from __future__ import annotations

import copy
import gc
import re
import subprocess
import sys
from pathlib import Path

import nimble
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.models import MobileNetV2Small
from tests.runtime.test_train_step import batch


def _data_parallel_worker(rank: int, folder: str, precision: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # two processes on a CI machine of two cores, beside the other tests
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    try:
        torch.manual_seed(rank)  # different weights in each process: the step starts from rank 0's
        net = MobileNetV2Small()
        eager = nn.parallel.DistributedDataParallel(copy.deepcopy(net))  # broadcasts rank 0's too
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=True)
        step = nimble.TrainStep(net, F.cross_entropy, *batch(4, 32), optimizer=opt, bucket_mb=0.02,
                                precision=precision)
        assert len(step._data.buckets) > 1  # so that buckets go while the backward still runs
        if precision == "bf16":  # the gradients' casts grouped, each group's gradients reported as they come
            assert any(op.target == "nimble::cast_group" for op in step.graph.ops)
        # in bf16, eager computes in bfloat16 too (autocast), its gradients reduced as DDP reduces them
        loss_tol, grad_tol = (1e-4, 1e-4) if precision == "fp32" else (2e-2, 5e-2)
        for k in range(4):
            x, t = batch(4, 32, seed=100 * rank + k)  # each process its own half of the batch
            with torch.no_grad():
                for p, q in zip(eager.module.parameters(), net.parameters()):
                    p.copy_(q)
                for p, q in zip(eager.module.buffers(), net.buffers()):
                    p.copy_(q)
            eager.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                expected = F.cross_entropy(eager(x), t)
            expected.backward()  # DDP averages the gradients over the two processes
            grads = [p.grad.clone() for p in eager.module.parameters()]
            loss = step(x, t)
            assert abs(float(loss) - float(expected.detach())) <= loss_tol * abs(float(expected.detach())), (rank, k)
            scale = max(float(g.abs().max()) for g in grads)
            for (n, p), g in zip(net.named_parameters(), grads):
                assert float((p.grad - g).abs().max()) <= grad_tol * scale, (rank, k, n)
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        both = [torch.empty_like(flat) for _ in range(2)]
        dist.all_gather(both, flat)
        assert torch.equal(both[0], both[1])  # the processes' weights stayed one
        dist.barrier()  # neither process tears down while the other is still in a collective
    finally:
        # DDP's reducer and the step hold the process group and gloo's work: dropped before it is
        # destroyed (gloo work threads alive at interpreter exit abort the process, once in CI)
        eager = step = None  # noqa: F841
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_data_parallel_over_two_gloo_processes_averages_gradients_as_distributed_data_parallel_does(tmp_path, precision):
    torch.multiprocessing.spawn(_data_parallel_worker, args=(str(tmp_path), precision), nprocs=2, join=True)


def test_torchrun_launches_data_parallel_training_on_gloo(tmp_path):
    """The launch a user makes: `torchrun --standalone --nproc-per-node 2 script.py`. Both processes
    end with the same weights (each trained on its own batches, from different seeds) and
    different losses."""
    torchrun_trains_alike(tmp_path, [], timeout=600)


def torchrun_trains_alike(folder: Path, flags: list[str], timeout: int) -> None:
    """`torchrun --standalone --nproc-per-node 2 torchrun_train.py FLAGS` in `folder`: it exits
    cleanly, both processes end with one set of weights and each trained on its own data."""
    script = Path(__file__).with_name("torchrun_train.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), *flags], capture_output=True, text=True, timeout=timeout, cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [(folder / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    found = [re.fullmatch(r"losses (\[.*\]) weights ([0-9a-f]{64})\n", text) for text in said]
    assert all(found), said
    assert found[0][2] == found[1][2], said  # one set of weights
    assert found[0][1] != found[1][1]  # each process its own data
