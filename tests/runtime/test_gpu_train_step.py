"""`nimble.TrainStep` on CUDA: each of 20 steps against eager PyTorch from the same weights, in
fp32 (TF32 off, so both sides round alike) and in bf16 under autocast, on ResNet-18 and a
MobileNetV2-style net. (The CPU tests: test_train_step.py.)"""

from __future__ import annotations

import copy

import nimble
import pytest
import torch
import torch.nn.functional as F

from tests.models import MobileNetV2Small, ResNet18
from tests.runtime.test_train_step import batch, relative

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision, loss_tol, grad_tol", [("fp32", 1e-4, 1e-3), ("bf16", 1e-2, 3e-2)])
@pytest.mark.parametrize("make", [lambda: ResNet18(classes=10), MobileNetV2Small], ids=["resnet18", "mobilenet_v2_small"])
def test_each_step_on_cuda_gives_eager_s_loss_and_gradients(make, precision, loss_tol, grad_tol):
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.manual_seed(0)
        net = make().cuda()
        ref = copy.deepcopy(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, fused=True)
        x, t = (v.cuda() for v in batch(8, 32))
        step = nimble.TrainStep(net, F.cross_entropy, x, t, optimizer=opt, precision=precision)
        for k in range(20):
            x, t = (v.cuda() for v in batch(8, 32, seed=k + 1))
            ref.load_state_dict(net.state_dict())
            ref.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                expected = F.cross_entropy(ref(x), t)
            expected.backward()
            loss = step(x, t)
            assert abs(float(loss) - float(expected.detach())) <= loss_tol * abs(float(expected.detach())), k
            assert relative(torch.cat([p.grad.reshape(-1) for p in net.parameters()]),
                            torch.cat([p.grad.reshape(-1) for p in ref.parameters()])) <= grad_tol, k
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before
