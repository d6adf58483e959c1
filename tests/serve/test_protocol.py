"""The KServe v2 protocol without a server: decoding checks every field against the model before
allocating, and encoding round-trips through the official client's result parser."""

import json

import pytest
import torch

from nimble.serve.protocol import HEADER_LENGTH, ModelInfo, ProtocolError, TensorInfo, decode, encode

MODEL = ModelInfo("m", (TensorInfo("x", "float32", (-1, 2, 3)), TensorInfo("ids", "int64", (-1, 4))),
                  (TensorInfo("y", "float32", (-1, 5)), TensorInfo("z", "bfloat16", (-1,))), 8, True)


def request(inputs, **extra) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def good(rows=2):
    return [{"name": "x", "datatype": "FP32", "shape": [rows, 2, 3], "data": [[0.5] * 6] * rows},
            {"name": "ids", "datatype": "INT64", "shape": [rows, 4], "data": list(range(4 * rows))}]


def test_json_inputs_nested_or_flat_decode_in_the_models_order():
    r = decode(request(good()[::-1], id="a"), None, MODEL)
    assert r.rows == 2 and r.id == "a"
    assert r.tensors[0].shape == (2, 2, 3) and r.tensors[0].dtype == torch.float32
    assert r.tensors[1].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert r.outputs == [(0, False), (1, False)]


def test_binary_inputs_follow_the_json_header():
    x = torch.arange(12, dtype=torch.float32).reshape(2, 2, 3)
    ids = torch.arange(8).reshape(2, 4)
    head = request([{"name": "x", "datatype": "FP32", "shape": [2, 2, 3], "parameters": {"binary_data_size": 48}},
                    {"name": "ids", "datatype": "INT64", "shape": [2, 4], "parameters": {"binary_data_size": 64}}],
                   parameters={"binary_data_output": True})
    body = head + x.numpy().tobytes() + ids.numpy().tobytes()
    r = decode(body, str(len(head)), MODEL)
    assert torch.equal(r.tensors[0], x) and torch.equal(r.tensors[1], ids)
    assert r.outputs == [(0, True), (1, True)]


@pytest.mark.parametrize("edit,says", [
    (lambda i: i[0].update(name="w"), "unknown input 'w'"),
    (lambda i: i.pop(), "missing input 'ids'"),
    (lambda i: i.append(dict(i[0])), "given twice"),
    (lambda i: i[0].update(datatype="FP16"), "is FP32, not FP16"),
    (lambda i: i[0].update(shape=[2, 3, 2]), "must have shape [B, 2, 3]"),
    (lambda i: i[0].update(shape=[9, 2, 3], data=[0.0] * 54), "with B from 1 to 8"),
    (lambda i: i[0].update(shape=[0, 2, 3], data=[]), "with B from 1 to 8"),
    (lambda i: i[0].update(shape="2x2x3"), "'shape' list of integers"),
    (lambda i: i[0].update(data=[0.5] * 5), "holds 5 values"),
    (lambda i: i[0].pop("data"), "neither 'data' nor binary_data_size"),
    (lambda i: i[1].update(data=[0.5] * 8), "holds a value of another type"),
    (lambda i: i[1].update(data=[True] * 8), "holds a value of another type"),
    (lambda i: i[1].update(data=[2**70] * 8), "input 'ids'"),
    (lambda i: i[1].update(shape=[3, 4], data=list(range(12))), "different batch sizes"),
    (lambda i: i[0].update(parameters={"binary_data_size": -1}), "byte count"),
])
def test_every_defect_is_a_400_naming_it(edit, says):
    inputs = good()
    edit(inputs)
    with pytest.raises(ProtocolError, match=says.replace("[", r"\[").replace("]", r"\]")) as e:
        decode(request(inputs), None, MODEL)
    assert e.value.status == 400


def test_malformed_bodies_and_headers_are_400():
    for body, header, says in [(b"{", None, "not valid JSON"), (b"[]", None, "JSON object with an 'inputs' list"),
                               (b"\xff\xfe", None, "not valid JSON"), (request(good()), "abc", "is not a length"),
                               (request(good()), "999999", "is not a length"), (request(good()), "0", "is not a length")]:
        with pytest.raises(ProtocolError, match=says):
            decode(body, header, MODEL)
    head = request([{"name": "x", "datatype": "FP32", "shape": [1, 2, 3], "parameters": {"binary_data_size": 24}},
                    good(1)[1]])
    with pytest.raises(ProtocolError, match="only 20 follow"):
        decode(head + b"\0" * 20, str(len(head)), MODEL)
    with pytest.raises(ProtocolError, match="4 bytes of binary data follow the inputs that no input claims"):
        decode(head + b"\0" * 28, str(len(head)), MODEL)
    with pytest.raises(ProtocolError, match="unknown output 'q'"):
        decode(request(good(), outputs=[{"name": "q"}]), None, MODEL)


def test_a_model_of_fixed_shapes_takes_exactly_them():
    fixed = ModelInfo("f", (TensorInfo("x", "float32", (2, 3)),), (TensorInfo("y", "float32", (2,)),), 1, False)
    ok = decode(request([{"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [1.0] * 6}]), None, fixed)
    assert ok.rows == 1
    with pytest.raises(ProtocolError, match=r"must have shape \[2, 3\], got \[1, 3\]"):
        decode(request([{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1.0] * 3}]), None, fixed)


def test_responses_parse_with_the_official_client():
    th = pytest.importorskip("tritonclient.http")
    y = torch.randn(2, 5)
    z = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    for binary in (True, False):
        r = decode(request(good(), id="7", outputs=[{"name": "y", "parameters": {"binary_data": binary}}]), None,
                   MODEL)
        body, headers = encode(MODEL, r, [y, z])
        length = headers.get(HEADER_LENGTH)
        result = th.InferResult.from_response_body(body, header_length=None if length is None else int(length))
        assert result.get_response()["id"] == "7"
        assert torch.allclose(torch.from_numpy(result.as_numpy("y").copy()), y)
        assert (HEADER_LENGTH in headers) == binary
    r = decode(request(good(), outputs=[{"name": "z"}]), None, MODEL)
    body, _ = encode(MODEL, r, [y, z])
    assert json.loads(body)["outputs"][0]["data"] == [1.5, -2.0]


def test_a_replicas_answers_stay_its_own_after_the_next_call(tmp_path):
    """On the CPU a call's outputs are views of the arena: the replica copies them, so an answer
    not yet encoded is not overwritten by the next batch."""
    from nimble.formats import write_artifact
    from nimble.pipeline import compile_model
    from nimble.serve.replica import Replica
    from nimble.specs import input_specs

    from ..conftest import SAMPLES

    path = tmp_path / "r.nimble"
    write_artifact(path, compile_model(SAMPLES / "resnet.pt", input_specs(["1x3x32x32"]), device="cpu",
                                       batch_sizes=[1, 2]).artifact())
    replica = Replica(path, "r", "cpu")

    def one(seed):
        x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
        return decode(request([{"name": "x", "datatype": "FP32", "shape": [1, 3, 32, 32],
                                "data": x.flatten().tolist()}]), None, replica.info)

    first = replica.infer([one(0)])[0][0]
    kept = first.clone()
    replica.infer([one(1)])
    assert torch.equal(first, kept)


def test_a_batch_of_requests_is_checked_once_each_and_each_gets_its_own_rows(tmp_path, monkeypatch):
    """Three requests of 1, 2 and 1 rows in one call of the batch size 4: each request's tensors
    are checked once (`Replica.check`), go straight into the input buffers (`run_rows`: no
    concatenation, no second check), and each answer is the model's output for its own rows."""
    from nimble.formats import write_artifact
    from nimble.pipeline import compile_model
    from nimble.runtime.assemble import inputs as checks
    from nimble.serve.replica import Replica
    from nimble.specs import input_specs

    from ..conftest import SAMPLES

    path = tmp_path / "r.nimble"
    write_artifact(path, compile_model(SAMPLES / "resnet.pt", input_specs(["1x3x32x32"]), device="cpu",
                                       batch_sizes=[1, 4]).artifact())
    replica = Replica(path, "r", "cpu")
    module = torch.jit.load(str(SAMPLES / "resnet.pt")).eval()
    xs = [torch.randn(rows, 3, 32, 32, generator=torch.Generator().manual_seed(rows * 7 + k))
          for k, rows in enumerate((1, 2, 1))]
    reqs = [decode(request([{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.flatten().tolist()}]),
                   None, replica.info) for x in xs]
    calls, real = [], checks.check_inputs
    monkeypatch.setattr(checks, "check_inputs", lambda *a, **k: calls.append(1) or real(*a, **k))
    checked = []
    real_values = checks.check_values
    monkeypatch.setattr(checks, "check_values", lambda *a, **k: checked.append(1) or real_values(*a, **k))
    answers = replica.infer(reqs)
    assert replica.stats.calls == 1 and len(calls) == 0 and len(checked) == 3  # one index check a request
    with torch.no_grad():
        for x, answer in zip(xs, answers):
            torch.testing.assert_close(answer[0], module(x), rtol=1e-4, atol=1e-4)


def test_an_output_named_twice_is_refused_so_no_answer_grows_past_the_outputs():
    with pytest.raises(ProtocolError, match="output 'y' is asked for twice") as e:
        decode(request(good(), outputs=[{"name": "y"}] * 1000), None, MODEL)
    assert e.value.status == 400
    with pytest.raises(ProtocolError, match="unknown output"):
        decode(request(good(), outputs=[{"name": ["y"]}]), None, MODEL)


def test_nan_a_huge_header_length_and_non_finite_outputs_get_one_line():
    body = request(good()).replace(b"0.5", b"NaN", 1)
    with pytest.raises(ProtocolError, match="not valid JSON") as e:
        decode(body, None, MODEL)
    assert e.value.status == 400
    with pytest.raises(ProtocolError, match="is not a length") as e:
        decode(request(good()), "9" * 5000, MODEL)
    assert e.value.status == 400
    r = decode(request(good(1)), None, MODEL)
    with pytest.raises(ProtocolError, match="NaN or infinity") as e:
        encode(MODEL, r, [torch.full((1, 5), float("nan")), torch.zeros(1, dtype=torch.bfloat16)])
    r.outputs = [(0, True)]
    body, _ = encode(MODEL, r, [torch.full((1, 5), float("nan")), torch.zeros(1, dtype=torch.bfloat16)])
    assert len(body) < 200  # as binary data NaN travels
