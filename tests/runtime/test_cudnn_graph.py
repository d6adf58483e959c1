"""Which fused bodies become cuDNN graphs (`cudnn_graph.epilogue`), on the CPU: a chain of steps
cuDNN has, each reading the one before and at most one tensor that broadcasts to the result."""

import torch

from nimble.ir import Local
from nimble.runtime.base.settings import Settings
from nimble.runtime.kernels import cudnn_graph

CONV = ("aten::conv2d.default", (torch.zeros(1, 4, 6, 6), torch.zeros(8, 4, 3, 3), torch.zeros(8)), ())
OUT = torch.zeros(2, 8, 4, 4)


def steps_of(*nodes):
    return cudnn_graph.epilogue((CONV, *nodes), OUT)


def test_a_chain_of_known_steps_becomes_cudnn_pointwise_operations():
    z, s = torch.zeros(2, 8, 4, 4), torch.zeros(2, 8, 1, 1)
    steps, tensors = steps_of(("aten::silu.default", (Local(0),), ()),
                              ("aten::mul.Tensor", (Local(1), s), ()),
                              ("aten::add.Tensor", (z, Local(2)), (("alpha", 1),)),
                              ("aten::hardtanh.default", (Local(3), 0.0, 6.0), ()),
                              ("aten::gelu.default", (Local(4),), (("approximate", "tanh"),)))
    assert steps == (("swish", (("swish_beta", 1.0),)), ("mul", ()), ("add", ()),
                     ("relu", (("lower_clip", 0.0), ("upper_clip", 6.0))), ("gelu_approx_tanh", ()))
    assert [(t.data_ptr(), t.shape) for t in tensors] == [(s.data_ptr(), s.shape), (z.data_ptr(), z.shape)]


def test_a_per_channel_tensor_is_viewed_as_four_dimensional():
    steps, (t,) = steps_of(("aten::add.Tensor", (Local(0), torch.zeros(8, 1, 1)), ()))
    assert steps == (("add", ()),) and t.shape == (1, 8, 1, 1)


def test_anything_else_stays_with_nimble():
    refused = [
        ("aten::hardswish.default", (Local(0),), ()),  # no cuDNN step
        ("aten::add.Tensor", (Local(0), torch.zeros(2, 8, 4, 4)), (("alpha", 2),)),  # scaled
        ("aten::add.Tensor", (Local(0), torch.zeros(2, 8, 4, 3)), ()),  # does not broadcast
        ("aten::add.Tensor", (Local(0), torch.zeros(2, 8, 4, 4, dtype=torch.float16)), ()),  # another dtype
        ("aten::add.Tensor", (Local(0), 1.0), ()),  # a scalar
        ("aten::mul.Tensor", (Local(0), Local(0)), ()),  # reads no tensor
        ("aten::relu.default", (torch.zeros(2, 8, 4, 4),), ()),  # not the step before
    ]
    for node in refused:
        assert steps_of(node) is None, node
    # a step that reads an earlier step than the one before it breaks the chain
    assert steps_of(("aten::relu.default", (Local(0),), ()), ("aten::add.Tensor", (Local(1), Local(0)), ()),
                    ("aten::sigmoid.default", (Local(0),), ())) is None


def test_without_the_package_there_is_no_frontend(monkeypatch):
    monkeypatch.setattr(cudnn_graph.cudnn_plans, "_module", None)
    assert cudnn_graph.frontend() is None


def test_a_plan_too_slow_in_its_checked_run_is_never_timed(monkeypatch, use_settings):
    """Timing a plan runs it 41 more times; one whose checked run alone is far past the limit
    (some depthwise plans take seconds) is passed over, and a fast one is still chosen."""
    import time

    ref = torch.ones(4)

    class Plan:
        def __init__(self, seconds):
            self.seconds, self.runs, self.workspace_bytes = seconds, 0, 0

        def run(self, operands, out, workspace):
            self.runs += 1
            time.sleep(self.seconds)
            out.copy_(ref)

    slow, fast = Plan(0.05), Plan(0.0)
    use_settings(cudnn_too_slow_s=0.01)
    monkeypatch.setattr(cudnn_graph.cudnn_plans, "ranked", lambda *args: [slow, fast])

    def gpu_us(fn, device):
        fn()
        return 10.0
    monkeypatch.setattr(cudnn_graph, "_gpu_us", gpu_us)
    before = cudnn_graph.STATS["too_slow"]
    chosen = cudnn_graph._time_plans({}, (), (), torch.empty(4), lambda: ref.clone(), 1.03)
    assert chosen is fast and fast.runs == 2  # checked, then timed
    assert slow.runs == 1 and cudnn_graph.STATS["too_slow"] == before + 1  # checked only


def test_a_plan_may_be_slower_the_more_memory_its_reference_leaves_outside_the_arena():
    """The reference's result in the arena: `cudnn_slower`. Outside it, a small block:
    `cudnn_slower_outside`. A large one (a pool segment of its own): `cudnn_slower_large_outside`.
    Never less for more memory."""
    s = Settings()
    small, large = s.cudnn_large_block - 1, s.cudnn_large_block
    assert cudnn_graph._limit(False, large) == s.cudnn_slower
    assert cudnn_graph._limit(True, small) == s.cudnn_slower_outside
    assert cudnn_graph._limit(True, large) == s.cudnn_slower_large_outside
    assert cudnn_graph._limit(False, large) <= cudnn_graph._limit(True, small) <= cudnn_graph._limit(True, large)
