"""How a training step's joint graph is traced (`frontend/joint.export_joint`): once by
AOTAutograd on fake tensors where it can be, else torch.export's way (three traces). Both ways
must give the same graph: same ops (detach aside), same inputs and outputs in the same roles."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from nimble.frontend import joint
from nimble.frontend.quiet import buffers_kept
from nimble.ir import TensorSpec
from torch import nn

from tests.models import MobileNetV2Small, ResNet18, StochasticNet, TinyEncoder


def traced(module, x, y, autocast=None, outputs=False, once=True):
    specs = [TensorSpec(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in (x, y)]
    if once:
        program = joint.export_joint(module, F.cross_entropy, [x], [y], "net", autocast, outputs)
        assert isinstance(program, joint.JointProgram)  # taken by the one trace, not torch.export's way
    else:
        wrapped = joint._WithLoss(module, F.cross_entropy, 1, None if autocast is None else ("cpu", autocast), outputs)
        with buffers_kept(module), torch.random.fork_rng(devices=[]):
            program = joint._exported(wrapped, [x, y])
        assert not isinstance(program, joint.JointProgram)
    lowered = joint.lower_joint(program, specs, "net")
    # detach is a no-op here (the step runs its graph with no autograd), and how many a trace
    # keeps varies: on torch 2.14.1 the one trace kept 36 in ResNet-18's step that torch.export's
    # way (whose last trace is a retrace of the joint graph) did not; on 2.13 both kept the same
    ops = Counter(op.target for op in lowered.lowered.graph.ops if op.target != "aten::detach.default")
    return ops, lowered.inputs, lowered.outputs


class WindowMasked(nn.Module):
    """A mask built in the forward by writing numbers into windows of a new tensor, as swin_t's
    shifted windows build theirs: the trace reads each number as a constant tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        mask = x.new_zeros(4, 4)
        count = 0
        for h in (slice(0, 2), slice(2, 4)):
            for w in (slice(0, 2), slice(2, 4)):
                mask[h, w] = count
                count += 1
        return self.fc((x * mask).flatten(1))


CASES = {
    "resnet18": (lambda: ResNet18(classes=10), (4, 3, 16, 16), torch.int64, None, False),
    "mobilenet_v2_small": (MobileNetV2Small, (4, 3, 16, 16), torch.int64, None, False),
    "bf16": (lambda: ResNet18(classes=10), (4, 3, 16, 16), torch.int64, torch.bfloat16, False),
    "stochastic_with_outputs": (StochasticNet, (4, 3, 8, 8), torch.int64, None, True),
    "encoder": (TinyEncoder, (4, 8), torch.int64, None, False),
    "constants": (WindowMasked, (4, 4, 4), torch.int64, None, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_trace_gives_torch_export_s_joint_graph(case):
    make, shape, dtype, autocast, outputs = CASES[case]
    torch.manual_seed(0)
    module = make().train()
    x = torch.randint(0, 100, shape) if case == "encoder" else torch.randn(shape)
    y = torch.randint(0, 10, (shape[0],), dtype=dtype)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    once = traced(module, x, y, autocast, outputs)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # buffers left as they were
    assert once == traced(module, x, y, autocast, outputs, once=False)


def test_constants_the_forward_makes_are_lifted_by_the_one_trace_and_the_step_follows_eager():
    """swin_t's 45 took torch.export's way after a failed first trace: 19 s of prepare on an H200.
    Its masks were then built again on every step: folding them stopped at the first
    training-only op (`fill.Tensor`)."""
    import copy

    import nimble

    torch.manual_seed(0)
    module = WindowMasked().train()
    x, y = torch.randn(4, 4, 4), torch.randint(0, 10, (4,))
    program = joint.export_joint(module, F.cross_entropy, [x], [y], "net")
    assert isinstance(program, joint.JointProgram) and len(program.constants) == 4
    assert sorted(float(t) for t in program.constants.values()) == [0.0, 1.0, 2.0, 3.0]
    ref = copy.deepcopy(module)
    step = nimble.TrainStep(module, F.cross_entropy, x, y)
    # the mask is built once, at prepare (`passes/fold_constants`, with a training graph's own ops)
    found = {op.target for op in step.graph.ops}
    assert not found & {"aten::fill.Tensor", "aten::new_zeros.default", "aten::slice_scatter.default"}, found
    loss = step(x, y)
    expected = F.cross_entropy(ref(x), y)
    expected.backward()
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)
    assert all(torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7) for p, q in zip(module.parameters(),
                                                                                      ref.parameters()))


def test_tied_weights_are_refused_in_one_line_naming_both():
    """Either trace would give the shared weight a gradient per name, or none (torch.export's way
    said 'gets no gradient from the loss', pointing at frozen layers)."""
    from nimble.errors import UnsupportedError

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(6, 6, bias=False)
            self.b = nn.Linear(6, 6, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    module, x, y = Tied(), torch.randn(4, 6), torch.randint(0, 6, (4,))
    with pytest.raises(UnsupportedError, match=r"parameter 'b.weight' is the same tensor as 'a.weight' \(tied"):
        joint.export_joint(module, F.cross_entropy, [x], [y], "tied")


def test_the_joint_graph_is_taken_as_traced_not_traced_again(monkeypatch):
    """aot_export_module traces the joint graph, then traces it again only to drop the tangents
    and flatten the outputs; nimble does that surgery on the FX graph (`joint._flattened`), and
    the graph is still torch.export's (the test above). A graph not laid out as expected gives
    None, and torch's own retrace runs then."""
    made = []
    real = joint._flattened

    def recorded(fx_g, metadata, full_args):
        out = real(fx_g, metadata, full_args)
        made.append((fx_g, metadata, full_args, out))
        return out

    monkeypatch.setattr(joint, "_flattened", recorded)
    torch.manual_seed(0)
    net = ResNet18(classes=10).train()
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    program = joint.export_joint(net, F.cross_entropy, [x], [y], "net")
    assert len(made) == 1 and isinstance(made[0][3], torch.fx.GraphModule)
    assert program.graph is made[0][3].graph  # the program's graph is the one the surgery made
    fx_g, metadata, full_args, _ = made[0]
    assert real(fx_g, object(), full_args) is None  # no metadata to count the outputs by
    assert real(fx_g, metadata, full_args[:-1]) is None  # the inputs do not add up
