"""Transformers from code: a BERT-style encoder on int64 token ids with an attention mask, and a
ViT on nn.MultiheadAttention, through both frontends."""

import torch

from nimble.pipeline import compile_model
from nimble.specs import input_specs
from sample_models.build import build_module, example_inputs

from ..conftest import SAMPLES
from ..cli.test_cli import invoke


def test_bert_compiles_with_int64_ids_and_a_mask_and_matches_the_module():
    c = compile_model(SAMPLES / "bert.pt", input_specs(["1x16", "1x16"], ["int64"]), device="cpu")
    assert c.check.passed
    assert [c.graph.values[i].spec.dtype for i in c.graph.inputs] == ["int64", "int64"]
    module = build_module("bert")
    ids, mask = example_inputs("bert", seed=3)
    from nimble.runtime.placed import reference

    got = reference.run(c.graph, c.weights, [ids, mask], "cpu")
    with torch.no_grad():
        want = module(ids, mask)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    padded = mask.clone()
    padded[:, 4:] = 0  # the mask matters: other padding, other states
    assert not torch.allclose(reference.run(c.graph, c.weights, [ids, padded], "cpu")[0], got[0])


def test_bert_and_vit_export_and_compile_from_pt2(tmp_path):
    for name in ("bert", "vit"):
        path = tmp_path / f"{name}.pt2"
        torch.export.save(torch.export.export(build_module(name), example_inputs(name)), str(path))
        c = compile_model(path, None, device="cpu")
        assert c.check.passed, (name, c.check.describe())


def test_vit_lowers_the_traced_attention_fast_path():
    c = compile_model(SAMPLES / "vit.pt", input_specs(["1x3x32x32"]), device="cpu")
    targets = {op.target for op in c.graph.ops}
    assert "aten::scaled_dot_product_attention.default" in targets and c.check.passed
    assert not any("multi_head" in t for t in targets)


def test_bert_from_the_command_line(tmp_path):
    result = invoke("compile", SAMPLES / "bert.pt", "-s", "1x16", "-s", "1x16", "--dtype", "int64", "--device", "cpu",
                    "-o", tmp_path / "bert.nimble")
    assert result.exit_code == 0, result.stderr
    assert invoke("run", tmp_path / "bert.nimble", "--check", "--device", "cpu").exit_code == 0


class _Attention(torch.nn.Module):
    def __init__(self, batch_first=True, masked=False):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(32, 4, batch_first=batch_first)
        self.masked = masked

    def forward(self, x):
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1) if self.masked else None
        return self.attention(x, x, x, attn_mask=mask, need_weights=False)[0] + 1


def test_exported_multi_head_attention_lowers_as_the_fast_path_and_other_forms_op_by_op(tmp_path):
    """torch.export records nn.MultiheadAttention's general path (unflatten, contiguous, selects,
    views...). A batch-first self-attention without a mask lowers whole, to the fast path's ops, as
    a trace gives; a sequence-first one or a masked one lowers op by op. All match the module."""
    x = torch.randn(2, 6, 32)
    for kwargs, whole in (({}, True), ({"batch_first": False}, False), ({"masked": True}, False)):
        torch.manual_seed(0)
        path = tmp_path / "attention.pt2"
        torch.export.save(torch.export.export(_Attention(**kwargs).eval(), (x,)), str(path))
        c = compile_model(path, None, device="cpu")
        assert c.check.passed, (kwargs, c.check.describe())
        kinds = {op.target.split("::")[1].split(".")[0] for op in c.graph.ops}
        assert ("split" in kinds and "contiguous" not in kinds and "unflatten" not in kinds) == whole, (kwargs, kinds)


class _HuggingFaceLike(torch.nn.Module):
    """What Hugging Face's BERT and GPT-2 do that stopped `--batch-sizes` (issue 62): the batch size
    read from the input (`sym_size` in a dynamic export) and used in views; a buffer of zeros
    expanded to [batch, seq] and looked up in an embedding (a constant shaped by the batch once
    folded); constant positions diffed and summed (GPT-2 without a mask); outputs in a dict."""

    def __init__(self):
        super().__init__()
        self.words, self.types, self.positions = (torch.nn.Embedding(50, 8), torch.nn.Embedding(2, 8),
                                                  torch.nn.Embedding(16, 8))
        self.register_buffer("token_type_ids", torch.zeros(1, 16, dtype=torch.long), persistent=False)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, ids):
        batch, seq = ids.shape
        positions = torch.arange(seq).unsqueeze(0)
        packed = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
        types = self.token_type_ids[:, :seq].expand(batch, seq)
        h = self.words(ids) + self.types(types) + self.positions(positions + packed)
        heads = self.proj(h).view(batch, seq, 2, 4).transpose(1, 2)  # sizes from the input
        return {"hidden": h, "heads": heads.reshape(batch, 2, seq * 4)}


def test_a_dynamic_batch_export_and_a_trace_compile_at_several_batch_sizes(tmp_path):
    torch.manual_seed(0)
    model = _HuggingFaceLike().eval()
    ids = torch.randint(0, 50, (2, 16))
    exported = tmp_path / "dynamic.pt2"
    batch = torch.export.Dim("batch", min=1, max=32)
    torch.export.save(torch.export.export(model, (ids,), dynamic_shapes=({0: batch},)), str(exported))
    traced = tmp_path / "traced.pt"
    with torch.no_grad():
        torch.jit.save(torch.jit.trace(model, (ids,), strict=False), str(traced))
    for path, shape in ((exported, []), (traced, ["-s", "1x16", "--dtype", "int64"])):
        out = tmp_path / f"{path.stem}.nimble"
        result = invoke("compile", path, *shape, "--batch-sizes", "1,2,4,8", "--device", "cpu", "-o", out)
        assert result.exit_code == 0, result.stderr
        result = invoke("run", out, "--check", "--device", "cpu")  # every batch size, on rows that differ
        assert result.exit_code == 0 and "check: ok" in result.stderr, result.stderr
        if path == exported:  # the names a client sees are the model's own
            assert "hidden: float32[1, 16, 8]" in result.stderr and "heads: float32[1, 2, 64]" in result.stderr
    result = invoke("compile", exported, "--batch-sizes", "1,64", "--device", "cpu", "-o", tmp_path / "x.nimble")
    assert result.exit_code != 0 and "64" in result.stderr and "1 to 32" in result.stderr, result.stderr
