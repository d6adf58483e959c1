"""The rewrite passes (`pipeline.REWRITES`): each one changes the op graph as its name says, keeps
what the model computes (checked by running the rewritten graph against the model itself), and
leaves alone what it must not touch. The frontends emit what the model says; these passes are
the only place a graph is rewritten before fusion."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
import torch.nn.functional as F

from nimble import frontend, passes
from nimble.ir import WEIGHT, TensorSpec
from nimble.pipeline import PASSES, REWRITES, rewrite, sample_inputs
from nimble.runtime.placed import reference
from nimble.runtime.trace import op_label
from nimble.runtime.base.compare import compare

from ..conftest import save_script


def exported(module: nn.Module, *example):
    return frontend.lower_program(torch.export.export(module.eval(), example), None, type(module).__name__)


def scripted(tmp_path, module: nn.Module, *example):
    specs = [TensorSpec(tuple(x.shape), str(x.dtype).removeprefix("torch.")) for x in example]
    return frontend.lower(frontend.load_module(save_script(tmp_path, module.eval(), "m")), specs, "m")


def targets(lowered) -> list[str]:
    return [op.target for op in lowered.graph.ops]


def assert_reproduces(lowered, module: nn.Module):
    """The graph's outputs equal the model's for the same sample inputs."""
    xs = sample_inputs([lowered.graph.values[i].spec for i in lowered.graph.inputs])
    with torch.no_grad():
        expected = module(*[x.clone() for x in xs])
    expected = list(expected) if isinstance(expected, (tuple, list)) else [expected]
    got = reference.run(lowered.graph, lowered.weights, xs, "cpu")
    result = compare(got, expected, 1e-5, 1e-5)
    assert result.passed, result.describe()


class ConvNorm(nn.Module):
    def __init__(self, tap: bool = False):
        super().__init__()
        self.conv, self.norm, self.tap = nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), tap
        with torch.no_grad():
            self.norm.running_mean.uniform_(-1, 1)
            self.norm.running_var.uniform_(0.5, 2)
            self.norm.weight.uniform_(0.5, 2)

    def forward(self, x):
        y = self.conv(x)
        z = self.norm(y).relu_()
        return (z, y) if self.tap else z


def test_batch_norm_folds_into_the_convolution_before_it():
    model = ConvNorm().eval()
    raw = exported(model, torch.randn(1, 3, 16, 16))
    assert "aten::batch_norm.default" in targets(raw)
    folded = rewrite(raw)
    assert "aten::batch_norm.default" not in targets(folded)
    weights = [v.name for v in folded.graph.values if v.kind == WEIGHT]
    assert weights == ["conv.weight_fused_bn", "conv.bias_fused_bn"] and set(folded.weights) == set(weights)
    assert_reproduces(folded, model)


def test_a_convolution_read_twice_keeps_its_batch_norm_as_a_multiply_and_add():
    model = ConvNorm(tap=True).eval()
    lowered = rewrite(exported(model, torch.randn(1, 3, 16, 16)))
    assert "aten::batch_norm.default" not in targets(lowered)
    assert targets(lowered)[1:3] == ["aten::mul.Tensor", "aten::add.Tensor"]
    g = lowered.graph
    scale, shift = (g.values[next(r for r in op.refs() if g.values[r].kind == WEIGHT)] for op in g.ops[1:3])
    assert (scale.name, shift.name) == ("norm.scale", "norm.shift") and scale.spec.shape == (1, 8, 1, 1)
    assert_reproduces(lowered, model)


class PreActivation(nn.Module):
    """densenet's order: concatenate, batch norm, relu, convolution."""

    def __init__(self):
        super().__init__()
        self.norm, self.conv = nn.BatchNorm2d(6), nn.Conv2d(6, 4, 1)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-1, 1)
            self.norm.running_var.uniform_(0.5, 2)
            self.norm.weight.uniform_(0.5, 2)
            self.norm.bias.uniform_(-1, 1)

    def forward(self, x, y):
        return self.conv(torch.relu(self.norm(torch.cat([x, y], 1))))


def test_a_batch_norm_no_convolution_absorbs_fuses_with_its_relu(tmp_path):
    model = PreActivation().eval()
    example = (torch.randn(2, 2, 5, 5), torch.randn(2, 4, 5, 5))
    for raw in (exported(model, *example), scripted(tmp_path, model, *example)):
        lowered = rewrite(raw)
        assert "aten::batch_norm.default" not in targets(lowered)
        assert_reproduces(lowered, model)
        fused = rewrite(raw, PASSES)
        bodies = [[node[0] for node in op.args[0]] for op in fused.graph.ops if op.target == "nimble::fused"]
        # x and y are inputs, which the layout chosen at load may lay out otherwise than the
        # result: the cat stays (`fuse_concats` takes in activations of their own only)
        assert ["aten::mul.Tensor", "aten::add.Tensor", "aten::relu.default"] in bodies, bodies
        assert_reproduces(fused, model)


def test_in_place_ops_become_functional_unless_a_view_would_see_the_write():
    class InPlace(nn.Module):
        def forward(self, x):
            y = x * 2
            y.relu_()  # y owns its storage and has no views: relu(y)
            z = x + 1
            v = z[0]
            z.add_(1)  # v sees this write: stays in place
            return y, v

    model = InPlace()
    raw = exported(model, torch.randn(2, 3))
    assert {"aten::relu_.default", "aten::add_.Tensor"} <= set(targets(raw))
    lowered = rewrite(raw, (passes.functionalise,))
    assert "aten::relu.default" in targets(lowered) and "aten::relu_.default" not in targets(lowered)
    assert "aten::add_.Tensor" in targets(lowered)
    assert_reproduces(lowered, model)


def test_common_subexpressions_and_repeated_views_are_computed_once(tmp_path):
    class Twice(nn.Module):
        def forward(self, x):
            a = torch.relu(x).transpose(0, 1)
            b = torch.relu(x).transpose(0, 1)  # the same relu, then the same view of it
            return a.exp() + b.exp()

    model = Twice()
    lowered = rewrite(scripted(tmp_path, model, torch.randn(2, 3)))
    assert targets(lowered).count("aten::relu.default") == 1
    assert targets(lowered).count("aten::transpose.int") == 1 and targets(lowered).count("aten::exp.default") == 1
    assert_reproduces(lowered, model)


def test_a_merged_value_written_in_place_later_keeps_its_two_ops(tmp_path):
    """Before the passes, such a write made the frontend lower the whole model again without CSE."""
    class WriteAfter(nn.Module):
        def forward(self, x):
            a = torch.relu(x)
            b = torch.relu(x)
            b[0].add_(1)  # a write through a view: `a` must not see it
            return a, b

    model = WriteAfter()
    lowered = rewrite(scripted(tmp_path, model, torch.randn(2, 3)))
    assert targets(lowered).count("aten::relu.default") == 2
    assert_reproduces(lowered, model)


def test_pure_ops_on_either_side_of_a_write_are_not_merged(tmp_path):
    class Around(nn.Module):
        def forward(self, x):
            y = x * 1
            a = y.sum()
            y[0].fill_(3.0)
            b = y.sum()  # reads y after the write
            return a, b

    model = Around()
    lowered = rewrite(scripted(tmp_path, model, torch.randn(2, 3)))
    assert targets(lowered).count("aten::sum.default") == 2
    assert_reproduces(lowered, model)


def test_a_cat_read_only_by_a_cat_along_the_same_dimension_hands_over_its_parts():
    class Cats(nn.Module):
        def forward(self, x):
            inner = torch.cat([x.exp(), x.sin()], 1)
            kept = torch.cat([x.cos(), x.tanh()], 0)  # along another dimension: stays
            return torch.cat([inner, x.abs()], 1), torch.cat([kept, kept], 1)

    model = Cats()
    raw = exported(model, torch.randn(2, 3))
    lowered = rewrite(raw)
    cats = [op for op in lowered.graph.ops if op.target == "aten::cat.default"]
    assert targets(raw).count("aten::cat.default") == 4 and len(cats) == 3
    assert sorted(len(op.args[0]) for op in cats) == [2, 2, 3]
    assert_reproduces(lowered, model)


def test_dead_ops_go_and_values_are_named_after_their_op():
    class Dead(nn.Module):
        def forward(self, x):
            unused = x.exp()  # noqa: F841 (read by nothing)
            return x.relu()

    model = Dead()
    raw = exported(model, torch.randn(2, 3))
    assert targets(raw) == ["aten::exp.default", "aten::relu.default"]
    lowered = rewrite(raw)
    assert targets(lowered) == ["aten::relu.default"]
    assert lowered.graph.values[lowered.graph.ops[0].outputs[0]].name == "relu_0"  # op 0 once the exp is gone
    assert_reproduces(lowered, model)


def test_the_rewrites_are_named_in_the_order_they_run():
    assert [p.__name__ for p in REWRITES] == ["functionalise", "fold_constants", "index_as_view", "normalise_convolutions",
                                             "fold_batch_norm",
                                             "affine_batch_norm", "flatten_concats",
                                             "merge_sibling_convolutions",
                                             "match_multi_head_attention", "match_attention",
                                             "precompute_attention_masks", "inline_scalar_constants",
                                             "drop_identity_copies",
                                             "bias_into_epilogue", "eliminate_common_subexpressions",
                                             "eliminate_dead_ops", "order_canonically", "name_values"]


class Convs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 3, stride=2, bias=False, groups=2, dilation=2)
        self.c = nn.Conv2d(8, 4, 1, padding="same")

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def test_conv2d_becomes_the_convolution_it_calls():
    model = Convs().eval()
    raw = exported(model, torch.randn(2, 3, 16, 16))
    assert targets(raw) == ["aten::conv2d.default", "aten::conv2d.default", "aten::conv2d.padding"]
    out = passes.normalise_convolutions(raw.graph)
    assert [op.target for op in out.ops] == ["aten::convolution.default", "aten::convolution.default",
                                             "aten::conv2d.padding"]  # "same" padding keeps its own overload
    assert out.ops[1].args[2:] == (None, (2, 2), (0, 0), (2, 2), False, (0, 0), 2)
    assert_reproduces(rewrite(raw), model)
    unbatched = exported(nn.Conv2d(3, 4, 3).eval(), torch.randn(3, 8, 8))  # a 3-D input stays conv2d
    assert passes.normalise_convolutions(unbatched.graph) == unbatched.graph


class GeneralPath(nn.Module):
    """nn.MultiheadAttention's general path written out (batch first, 4 heads), as torch.export
    records it; `swap` feeds the value projection in as the key and the key as the value."""

    def __init__(self, swap: bool = False):
        super().__init__()
        self.inp, self.out, self.swap = nn.Linear(16, 48), nn.Linear(16, 16), swap

    def forward(self, x):
        batch, length, embed = x.shape
        packed = self.inp(x.transpose(1, 0)).unflatten(-1, (3, embed)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        packed = packed.contiguous()
        q, k, v = packed[0], packed[1], packed[2]
        if self.swap:
            k, v = v, k

        def heads(t):
            return t.view(length, batch * 4, 4).transpose(0, 1).view(batch, 4, length, 4)

        attended = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v))
        merged = attended.permute(2, 0, 1, 3).reshape(length * batch, embed)
        return self.out(merged).view(length, batch, embed).transpose(1, 0)


def test_an_exported_multi_head_attention_becomes_the_ops_a_trace_records(tmp_path):
    model = nn.MultiheadAttention(16, 4, batch_first=True).eval()

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = model

        def forward(self, x):
            return self.attention(x, x, x, need_weights=False)[0]

    x = torch.randn(2, 5, 16)
    program = rewrite(exported(SelfAttention(), x))
    trace = tmp_path / "mha.pt"
    with torch.no_grad():
        torch.jit.save(torch.jit.trace(SelfAttention().eval(), x), str(trace))
    traced = rewrite(frontend.lower(frontend.load_module(trace), [TensorSpec((2, 5, 16), "float32")], "mha"))
    assert targets(program) == targets(traced) and targets(program).count("aten::select.int") == 0
    assert_reproduces(program, SelfAttention())


def test_a_written_out_general_path_is_proven_before_it_is_replaced():
    x = torch.randn(2, 5, 16)
    right, swapped = GeneralPath(), GeneralPath(swap=True)
    swapped.load_state_dict(right.state_dict())
    matched = rewrite(exported(right, x))
    kept = rewrite(exported(swapped, x))
    assert "aten::split.Tensor" in targets(matched) and "aten::select.int" not in targets(matched)
    assert "aten::split.Tensor" not in targets(kept) and "aten::select.int" in targets(kept)
    assert_reproduces(matched, right)
    assert_reproduces(kept, swapped)


class HandAttention(nn.Module):
    """Attention as BERT writes it: scores scaled by a divide, an additive mask, softmax, matmul."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).split(16, -1)
        q, k, v = (t.reshape(2, 5, 2, 8).permute(0, 2, 1, 3) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) / 8 ** 0.5 + mask
        return torch.matmul(torch.softmax(scores, dim=-1), v)


class HandAttentionKeepingScores(HandAttention):
    def forward(self, x, mask):
        q, k, v = self.qkv(x).split(16, -1)
        q, k, v = (t.reshape(2, 5, 2, 8).permute(0, 2, 1, 3) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) / 8 ** 0.5 + mask
        return torch.matmul(torch.softmax(scores, dim=-1), v), scores


def test_hand_written_attention_becomes_scaled_dot_product_attention(tmp_path):
    model = HandAttention().eval()
    example = (torch.randn(2, 5, 16), torch.randn(2, 1, 1, 5))
    for raw in (exported(model, *example), scripted(tmp_path, model, *example)):
        lowered = rewrite(raw)
        kinds = targets(lowered)
        assert kinds.count("aten::scaled_dot_product_attention.default") == 1, kinds
        assert "aten::softmax.int" not in kinds and "aten::matmul.default" not in kinds
        attention = next(op for op in lowered.graph.ops if "attention" in op.target)
        assert dict(attention.kwargs)["scale"] == pytest.approx(8 ** -0.5)
        assert isinstance(attention.args[3], type(attention.args[0]))  # the mask
        assert_reproduces(lowered, model)


class PrescaledAttention(HandAttention):
    """Swin's way: q is scaled before the product, so the scores take no scale of their own."""

    def forward(self, x, mask):
        q, k, v = self.qkv(x).split(16, -1)
        q, k, v = (t.reshape(2, 5, 2, 8).permute(0, 2, 1, 3) for t in (q, k, v))
        scores = torch.matmul(q * 0.125, k.transpose(-1, -2)) + mask
        return torch.matmul(torch.softmax(scores, dim=-1), v)


class UnscaledAttention(HandAttention):
    """Scores that no number scales at all."""

    def forward(self, x, mask):
        q, k, v = self.qkv(x).split(16, -1)
        q, k, v = (t.reshape(2, 5, 2, 8).permute(0, 2, 1, 3) for t in (q, k, v))
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) + mask, dim=-1), v)


@pytest.mark.parametrize("model, scale", [(UnscaledAttention, 1.0), (PrescaledAttention, 0.125)])
def test_attention_takes_the_scale_its_scores_have(tmp_path, model, scale):
    """Scores no number scales get a scale of one, not sdpa's 1/sqrt(8); a query scaled before the
    product (Swin) gives its scale to the attention op, and no multiply is left as a kernel."""
    model = model().eval()
    example = (torch.randn(2, 5, 16) * 4, torch.randn(2, 1, 1, 5))
    for raw in (exported(model, *example), scripted(tmp_path, model, *example)):
        lowered = rewrite(raw)
        attention = [op for op in lowered.graph.ops if "attention" in op.target]
        assert len(attention) == 1 and dict(attention[0].kwargs)["scale"] == scale
        assert not any(t.startswith("aten::mul") for t in targets(lowered)), targets(lowered)
        assert_reproduces(lowered, model)


def test_attention_whose_scores_are_read_elsewhere_stays_as_written(tmp_path):
    model = HandAttentionKeepingScores().eval()
    lowered = rewrite(exported(model, torch.randn(2, 5, 16), torch.randn(2, 1, 1, 5)))
    assert "aten::scaled_dot_product_attention.default" not in targets(lowered)
    assert_reproduces(lowered, model)


class CausalAttention(nn.Module):
    """GPT-2's eager attention: scores divided by a 0-d tensor, a causal mask by `where`."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.register_buffer("allowed", torch.tril(torch.ones(5, 5, dtype=torch.bool)).view(1, 1, 5, 5))

    def forward(self, x):
        q, k, v = self.qkv(x).split(16, -1)
        q, k, v = (t.reshape(2, 5, 2, 8).permute(0, 2, 1, 3) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], 8 ** 0.5)
        scores = torch.where(self.allowed, scores, torch.full([], torch.finfo(torch.float32).min))
        return torch.matmul(torch.softmax(scores, dim=-1), v)


def test_a_causal_mask_by_where_becomes_a_boolean_attention_mask(tmp_path):
    model = CausalAttention().eval()
    lowered = rewrite(exported(model, torch.randn(2, 5, 16)))
    attention = [op for op in lowered.graph.ops if "attention" in op.target]
    assert len(attention) == 1 and "aten::where.self" not in targets(lowered)
    mask = lowered.graph.values[attention[0].args[3].id]  # made additive once, by where(mask, 0, -inf)
    convert = lowered.graph.ops[mask.producer]
    assert convert.target == "aten::where.Scalar" and convert.args[1:] == (0.0, float("-inf"))
    assert lowered.graph.values[convert.args[0].id].spec.dtype == "bool"
    assert_reproduces(lowered, model)


class SharedMask(nn.Module):
    """Three attention layers that read one boolean mask, as GPT-2's twelve do."""

    def __init__(self):
        super().__init__()
        self.register_buffer("allowed", torch.tril(torch.ones(6, 6, dtype=torch.bool)))

    def forward(self, x, keep):
        mask = self.allowed & keep.view(-1, 1, 1, 6)  # causal and padding, worked out at run time
        for _ in range(3):
            x = torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=mask) * 0.5 + x
        return x


def test_a_boolean_mask_read_by_several_attention_ops_is_made_additive_once(tmp_path):
    model = SharedMask().eval()
    x, keep = torch.randn(2, 2, 6, 4), torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    for raw in (exported(model, x, keep), scripted(tmp_path, model, x, keep)):
        before = [op for op in raw.graph.ops if "attention" in op.target]
        assert {raw.graph.values[op.args[3].id].spec.dtype for op in before} == {"bool"}
        lowered = rewrite(raw)
        assert targets(lowered).count("aten::where.Scalar") == 1
        masks = {op.args[3] for op in lowered.graph.ops if "attention" in op.target}
        assert len(masks) == 1 and lowered.graph.values[masks.pop().id].spec.dtype == "float32"
        xs = [x, keep]
        with torch.no_grad():
            expected = model(*xs)
        got = reference.run(lowered.graph, lowered.weights, xs, "cpu")
        assert compare(got, [expected], 1e-5, 1e-5).passed


class ZeroDimConstants(nn.Module):
    """GPT-2's tanh GELU as a frozen module holds it: its numbers as 0-d constant tensors."""

    def __init__(self):
        super().__init__()
        for name, value in (("c_half", 0.5), ("c_k", 0.044715), ("c_root", 0.7978845608), ("c_one", 1.0), ("c_two", 2.0)):
            self.register_buffer(name, torch.tensor(value))

    def forward(self, x):
        inner = self.c_root * (x + self.c_k * torch.pow(x, 3.0))
        gelu = self.c_half * x * (torch.tanh(inner) + self.c_one)
        return gelu / self.c_two - self.c_k, torch.add(x, self.c_two, alpha=3)


def test_zero_dim_constants_become_numbers_that_fuse(tmp_path):
    model = ZeroDimConstants().eval()
    x = torch.randn(2, 8)
    for raw in (exported(model, x), scripted(tmp_path, model, x)):
        lowered = rewrite(raw)
        kinds = targets(lowered)
        assert "aten::mul.Tensor" in kinds  # x * tanh(...): no constant there
        assert kinds.count("aten::mul.Scalar") >= 3 and "aten::div.Scalar" in kinds and "aten::sub.Scalar" in kinds
        assert "aten::add.Tensor" in kinds  # alpha=3 keeps its tensor
        assert_reproduces(lowered, model)
        fused = rewrite(raw, PASSES)
        bodies = [op for op in fused.graph.ops if op.target == "nimble::fused"]
        assert bodies and len(fused.graph.ops) < len(raw.graph.ops) // 2, targets(fused)
        assert_reproduces(fused, model)


class Projections(nn.Module):
    """GPT-2's Conv1D (addmm on a flattened input, viewed back) before a residual add, a linear
    before GELU, and a linear whose result is read twice (it keeps its bias)."""

    def __init__(self):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8))
        self.up, self.shared = nn.Linear(8, 16), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.addmm(self.bias, x.view(-1, 8), self.weight).view(x.shape) + x
        s = self.shared(h)
        return torch.nn.functional.gelu(self.up(h)), s * s, s + 1


def test_a_gemm_bias_moves_into_the_elementwise_op_that_reads_it(tmp_path):
    model = Projections().eval()
    x = torch.randn(2, 3, 8)
    for raw in (exported(model, x), scripted(tmp_path, model, x)):
        lowered = rewrite(raw)
        kinds = targets(lowered)
        assert "aten::mm.default" in kinds and "aten::addmm.default" not in kinds
        linears = [op for op in lowered.graph.ops if op.target == "aten::linear.default"]
        assert sorted(op.args[2] is None for op in linears) == [False, True]  # the shared one keeps it
        assert kinds.count("aten::add.Tensor") == 3  # two biases and the residual
        assert_reproduces(lowered, model)
        fused = rewrite(raw, PASSES)
        bodies = [op_label(op) for op in fused.graph.ops]
        assert "fused(add+add)" in bodies and "fused(add+gelu)" in bodies, bodies
        assert_reproduces(fused, model)


class TanhGelu(nn.Module):
    """GPT-2's MLP: a Conv1D (addmm, viewed back) whose result GELU's tanh form reads three times,
    and a second projection read by two ops whose results part ways (it keeps its bias)."""

    def __init__(self):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(8, 16)), nn.Parameter(torch.randn(16))
        self.other = nn.Linear(16, 16)

    def forward(self, x):
        h = torch.addmm(self.bias, x.view(-1, 8), self.weight).view(2, 3, 16)
        g = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))
        o = self.other(g)
        return torch.tanh(o), o * 2.0


def test_a_bias_joins_an_elementwise_group_that_reads_the_gemm_result_several_times(tmp_path):
    model = TanhGelu().eval()
    x = torch.randn(2, 3, 8)
    for raw in (exported(model, x), scripted(tmp_path, model, x)):
        fused = rewrite(raw, PASSES)
        kinds = targets(fused)
        assert "aten::mm.default" in kinds and "aten::addmm.default" not in kinds, kinds
        gelu = [op for op in fused.graph.ops if op.target == "nimble::fused" and "tanh" in op_label(op)]
        assert len(gelu) == 1 and op_label(gelu[0]).startswith("fused(add+mul+pow"), [op_label(op) for op in gelu]
        assert "aten::add.Tensor" not in kinds  # the bias add is inside the GELU's kernel, not on its own
        linears = [op for op in fused.graph.ops if op.target == "aten::linear.default"]
        assert len(linears) == 1 and linears[0].args[2] is not None  # tanh(o) and o * 2 part ways
        assert_reproduces(fused, model)


class IdentityCopies(nn.Module):
    """Copies that change nothing (Swin's pad by zero, contiguous and clone of contiguous values)
    beside ones that do: a real pad, contiguous of a transpose, a clone written in place, and a
    copy that is an output."""

    def forward(self, x):
        # constant_pad_nd's third argument, as a training step's joint graph has it, is a value that fills nothing
        a = F.pad(x, (0, 0, 0, 0)) * 2.0 + torch.constant_pad_nd(x, (0, 0, 0, 0), 1.0)
        b = x.contiguous() + x.clone()
        c = F.pad(x, (1, 0, 0, 0)).sum() + x.transpose(1, 2).contiguous().view(-1)[:3].sum()
        d = x.clone()
        d.add_(1.0)
        return a + b + c + d, x.clone()


def test_copies_that_change_nothing_go_and_the_others_stay(tmp_path):
    model = IdentityCopies().eval()
    x = torch.randn(2, 3, 4)
    for raw in (exported(model, x), scripted(tmp_path, model, x)):
        before = rewrite(raw, REWRITES[:REWRITES.index(passes.drop_identity_copies)])
        after = rewrite(raw, REWRITES)
        count = {t: targets(after).count(t) for t in ("aten::pad.default", "aten::constant_pad_nd.default",
                                                       "aten::contiguous.default", "aten::clone.default")}
        assert sum(count.values()) < sum(targets(before).count(t) for t in count), (targets(before), count)
        assert count["aten::pad.default"] + count["aten::constant_pad_nd.default"] == 1, count  # the real pad
        assert count["aten::contiguous.default"] == 1 and count["aten::clone.default"] >= 1  # the transpose; the output
        assert_reproduces(after, model)
        graph = after.graph
        out = graph.values[graph.outputs[1]]
        assert out.id not in graph.inputs and out.producer is not None  # an output keeps its own copy


class ViewedCopy(nn.Module):
    """A clone of a contiguous view, itself viewed: once the clone goes, the view after it views
    the first view's storage (Swin's attention in a training step)."""

    def forward(self, x):
        return (x.relu().view(6, 4).clone().view(2, 12) * 2.0).sum(1)


def test_a_view_of_a_dropped_copy_views_the_storage_its_source_shares():
    model = ViewedCopy().eval()
    x = torch.randn(2, 3, 4)
    after = rewrite(exported(model, x), REWRITES)
    assert "aten::clone.default" not in targets(after)
    graph = after.graph
    for v in graph.values:  # every alias names a root (`Graph.lint` checks it after each pass, too)
        assert v.alias_of is None or graph.values[v.alias_of].alias_of is None
    assert_reproduces(after, model)


class WindowMask(nn.Module):
    """Swin's shifted-window mask, built in forward from shapes alone (new_zeros on the input, slice
    fills, a subtraction, masked_fill), and a bias gathered from a table by a fixed index."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(9, 2))
        self.register_buffer("index", torch.randint(0, 9, (4, 4)))
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        mask = x.new_zeros((4, 4))
        count = 0
        for rows in ((0, 2), (2, None)):
            for cols in ((0, 3), (3, None)):
                mask[rows[0]:rows[1], cols[0]:cols[1]] = count
                count += 1
        mask = mask.view(16).unsqueeze(0) - mask.view(16).unsqueeze(1)
        mask = mask.masked_fill(mask != 0, -100.0)
        bias = self.table[self.index.view(-1)].view(4, 4, 2).permute(2, 0, 1)
        return (x + mask).softmax(-1) @ x.transpose(-1, -2)[..., :16] + bias.sum(), x[0, :4, :4] @ self.weight.t()


def test_values_computed_from_weights_and_numbers_alone_become_weights(tmp_path):
    model = WindowMask().eval()
    x = torch.randn(2, 16, 16)
    for raw in (exported(model, x), scripted(tmp_path, model, x)):
        lowered = rewrite(raw)
        kinds = targets(lowered)
        assert not any(t in kinds for t in ("aten::fill_.Tensor", "aten::fill_.Scalar", "aten::masked_fill.Scalar",
                                            "aten::new_zeros.default", "aten::index.Tensor", "aten::sum.default")), kinds
        folded = [v for v in lowered.graph.values if v.kind == WEIGHT and v.name.endswith("_folded")]
        assert [v.spec.shape for v in folded] == [(16, 16)]  # the mask; the summed bias became a number
        assert "aten::add.Scalar" in kinds
        assert_reproduces(lowered, model)


class WrittenAfterRead(nn.Module):
    """A constant buffer that the model reads, then fills: folding its final state would be wrong."""

    def forward(self, x):
        z = x.new_zeros((3,))
        y = x + z
        z.fill_(2.0)
        return y * z


def test_a_constant_written_after_a_computed_read_is_not_folded():
    model = WrittenAfterRead().eval()
    lowered = rewrite(exported(model, torch.randn(3)))
    assert not any(v.name.endswith("_folded") for v in lowered.graph.values)
    assert_reproduces(lowered, model)


class SlicedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 4))

    def forward(self, x):
        return x @ self.w[:4], x @ self.w[4:], x @ self.w.t().t()[:4]


def test_views_of_a_weight_stay_views_and_store_nothing_twice(tmp_path):
    model = SlicedWeight().eval()
    x = torch.randn(3, 4)
    for raw in (exported(model, x), scripted(tmp_path, model, x)):
        lowered = rewrite(raw)
        assert not any(v.name.endswith("_folded") for v in lowered.graph.values)
        assert sum(t.numel() for t in lowered.weights.values()) <= 32 * 2  # at most the export's own copies
        assert_reproduces(lowered, model)


class Fire(nn.Module):
    """squeezenet's fire module: a squeeze, then 1x1 and 3x3 expansions of it side by side in a
    cat; `kernels` and `paddings` change the expansions."""

    def __init__(self, kernels=((1, 1), (3, 3)), paddings=((0, 0), (1, 1)), bias=(True, True)):
        super().__init__()
        self.squeeze = nn.Conv2d(8, 6, 1)
        self.e1 = nn.Conv2d(6, 5, kernels[0], padding=paddings[0], bias=bias[0])
        self.e3 = nn.Conv2d(6, 6, kernels[1], padding=paddings[1], bias=bias[1])

    def forward(self, x):
        s = self.squeeze(x).relu()
        return torch.cat([self.e1(s).relu(), self.e3(s).relu()], 1)


class TappedFire(Fire):
    """A fire module that also returns its 1x1 expansion."""

    def forward(self, x):
        s = self.squeeze(x).relu()
        y = self.e1(s).relu()
        return torch.cat([y, self.e3(s).relu()], 1), y


def convolutions(lowered) -> list:
    return [op for op in lowered.graph.ops if op.target == "aten::convolution.default"]


@pytest.mark.parametrize("frontend_of", ["script", "export"])
@pytest.mark.parametrize("bias", [(True, True), (False, True), (False, False)])
def test_sibling_convolutions_side_by_side_in_a_cat_become_one(tmp_path, frontend_of, bias):
    model = Fire(bias=bias)
    x = torch.randn(2, 8, 9, 7)
    lowered = rewrite(scripted(tmp_path, model, x) if frontend_of == "script" else exported(model, x))
    convs = convolutions(lowered)
    assert len(convs) == 2 and "aten::cat.default" not in targets(lowered)
    merged = lowered.graph.values[convs[1].args[1].id]
    assert merged.name.endswith(".weight_merged") and merged.spec.shape == (11, 6, 3, 3)
    assert tuple(convs[1].args[4]) == (1, 1)
    assert (convs[1].args[2] is None) == (bias == (False, False))
    assert lowered.graph.values[lowered.graph.outputs[0]].spec.shape == (2, 11, 9, 7)
    assert_reproduces(lowered, model)


@pytest.mark.parametrize("kernels, paddings", [
    (((1, 1), (3, 3)), ((0, 0), (1, 1))),   # squeezenet's: merged
    (((1, 3), (3, 1)), ((0, 1), (1, 0))),   # inception_v3's: three times the work, stays apart
    (((3, 3), (5, 5)), ((1, 1), (2, 2))),   # 1.4 times the work: merged, the 3x3 inside the 5x5
    (((1, 1), (3, 3)), ((1, 1), (2, 2))),   # padded 1x1 (one ring of zeros) inside a 3x3 padded by 2: merged
])
def test_siblings_merge_only_where_the_windows_line_up_and_the_work_stays_small(tmp_path, kernels, paddings):
    model = Fire(kernels, paddings)
    x = torch.randn(1, 8, 9, 9)
    lowered = rewrite(scripted(tmp_path, model, x))
    assert len(convolutions(lowered)) == (3 if kernels[0] == (1, 3) else 2)
    assert_reproduces(lowered, model)


def test_a_sibling_read_elsewhere_stays_apart(tmp_path):
    model = TappedFire()
    lowered = rewrite(scripted(tmp_path, model, torch.randn(1, 8, 6, 6)))
    assert len(convolutions(lowered)) == 3 and "aten::cat.default" in targets(lowered)
    assert_reproduces(lowered, model)


class Siblings(nn.Module):
    """Three parts of a cat: two expansions of one input around one of another input."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(4, 3, 1), nn.Conv2d(4, 2, 1), nn.Conv2d(4, 5, 3, padding=1)
        self.d = nn.Conv2d(4, 2, 1)

    def forward(self, x, y):
        return torch.cat([self.a(x).relu(), self.b(x).relu(), self.d(y).relu(), self.c(x).sigmoid(),
                          self.c(x).relu()], 1)


def test_only_adjacent_parts_with_the_same_input_and_chain_merge(tmp_path):
    model = Siblings()
    xs = torch.randn(1, 4, 5, 5), torch.randn(1, 4, 5, 5)
    lowered = rewrite(exported(model, *xs))
    cat = next(op for op in lowered.graph.ops if op.target == "aten::cat.default")
    assert len(cat.args[0]) == 4  # a and b merged; d reads y; the two c's end in different chains
    shapes = [lowered.graph.values[p.id].spec.shape[1] for p in cat.args[0]]
    assert shapes == [5, 2, 5, 5]
    assert_reproduces(lowered, model)


class Inception(nn.Module):
    """googlenet's inception block: a 1x1; a 1x1 reduction then a 3x3; another of those; a max
    pool then a 1x1; each convolution then batch norm and ReLU, the four side by side in a cat."""

    def __init__(self, reduce=(6, 3), out=(8, 4)):
        super().__init__()

        def conv(i, o, k):
            return nn.Sequential(nn.Conv2d(i, o, k, padding=k // 2, bias=False), nn.BatchNorm2d(o), nn.ReLU())
        self.b1 = conv(8, 4, 1)
        self.b2 = nn.Sequential(conv(8, reduce[0], 1), conv(reduce[0], out[0], 3))
        self.b3 = nn.Sequential(conv(8, reduce[1], 1), conv(reduce[1], out[1], 3))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), conv(8, 4, 1))
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                nn.init.uniform_(m.running_mean, -1, 1)
                nn.init.uniform_(m.running_var, 0.5, 2)

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)


@pytest.mark.parametrize("frontend_of", ["script", "export"])
def test_towers_two_convolutions_deep_merge_level_by_level(tmp_path, frontend_of):
    model = Inception().eval()
    x = torch.randn(2, 8, 7, 6)
    lowered = rewrite(scripted(tmp_path, model, x) if frontend_of == "script" else exported(model, x))
    convs = convolutions(lowered)
    assert len(convs) == 4  # b1; b2 and b3's reductions as one, their 3x3s as one; b4
    shapes = sorted(lowered.graph.values[c.args[1].id].spec.shape for c in convs)
    assert shapes == [(4, 8, 1, 1), (4, 8, 1, 1), (9, 8, 1, 1), (12, 9, 3, 3)]
    reduction = next(c for c in convs if lowered.graph.values[c.args[1].id].spec.shape == (9, 8, 1, 1))
    block = next(c for c in convs if lowered.graph.values[c.args[1].id].spec.shape == (12, 9, 3, 3))
    w = lowered.weights[lowered.graph.values[block.args[1].id].name]
    assert w[:8, 6:].abs().max() == 0 and w[8:, :6].abs().max() == 0  # block-diagonal: each reads its own
    assert lowered.graph.values[block.args[0].id].producer is not None
    cat = next(op for op in lowered.graph.ops if op.target == "aten::cat.default")
    assert len(cat.args[0]) == 3
    assert reduction.outputs[0] != block.outputs[0]
    assert_reproduces(lowered, model)


def test_towers_merge_up_to_twice_the_work_and_stay_apart_past_it(tmp_path):
    model = Inception(reduce=(6, 6), out=(8, 8)).eval()  # block-diagonal 3x3: 12 x 16 against 2 x 6 x 8: 2.0
    lowered = rewrite(scripted(tmp_path, model, torch.randn(1, 8, 5, 5)))
    assert len(convolutions(lowered)) == 4  # at the bound: merged
    assert_reproduces(lowered, model)
    model = Inception(reduce=(6, 2), out=(2, 8)).eval()  # 8 x 10 against 12 + 16: 2.9
    lowered = rewrite(scripted(tmp_path, model, torch.randn(1, 8, 5, 5)))
    assert len(convolutions(lowered)) == 6
    assert_reproduces(lowered, model)


class Towers(nn.Module):
    """Parts of a cat along channels, each a tower over one input: a kxk convolution (after a 1x1
    reduction where two deep), each then an activation or none."""

    def __init__(self, parts, stride, dilation):
        super().__init__()
        self.towers = nn.ModuleList()
        self.acts = []
        for kernel, depth, channels, bias, act in parts:
            pad = tuple(dilation * (k - 1) // 2 for k in kernel)
            levels = [nn.Conv2d(4, channels, 1, bias=bias)] if depth == 2 else []
            levels.append(nn.Conv2d(channels if depth == 2 else 4, channels + 1, kernel, stride, pad, dilation,
                                    bias=bias))
            self.towers.append(nn.ModuleList(levels))
            self.acts.append(act)

    def forward(self, x):
        outs = []
        for levels, act in zip(self.towers, self.acts):
            y = x
            for conv in levels:
                y = conv(y)
                y = torch.relu(y) if act == "relu" else torch.sigmoid(y) if act == "sigmoid" else y
            outs.append(y)
        return torch.cat(outs, 1)


_PARTS = st.lists(st.tuples(st.sampled_from([(1, 1), (3, 3), (1, 3), (3, 1), (5, 5), (1, 5)]), st.integers(1, 2),
                            st.integers(1, 4), st.booleans(), st.sampled_from(["relu", "sigmoid", ""])),
                  min_size=2, max_size=5)


@settings(max_examples=30, deadline=None)
@given(_PARTS, st.integers(1, 2), st.integers(1, 2), st.integers(5, 9))
def test_merged_towers_compute_what_the_model_does(parts, stride, dilation, size):
    """Random cats of towers (kernels, depths, channels, biases, activations, one stride and
    dilation): whatever merges, the rewritten graph gives the model's result, with no more
    convolutions than before."""
    torch.manual_seed(0)
    model = Towers(parts, stride, dilation).eval()
    x = torch.randn(1, 4, size, size + 1)
    raw = exported(model, x)
    lowered = rewrite(raw)
    assert len(convolutions(lowered)) <= sum(depth for _, depth, _, _, _ in parts)
    assert_reproduces(lowered, model)
