"""The KServe v2 gRPC messages without a server: what the official client (tritonclient.grpc's
own protobuf classes, which no one here wrote) serializes parses as nimble's messages and back,
and every infer request is checked, field by field, before a tensor is made of it."""

import numpy as np
import pytest
import torch

pytest.importorskip("grpc")
pb = pytest.importorskip("tritonclient.grpc.service_pb2")

from nimble.serve import grpc_protocol as g  # noqa: E402
from nimble.serve.protocol import ModelInfo, ProtocolError, TensorInfo  # noqa: E402

MODEL = ModelInfo("m", (TensorInfo("x", "float32", (-1, 2, 3)), TensorInfo("ids", "int64", (-1, 4))),
                  (TensorInfo("y", "float32", (-1, 5)), TensorInfo("z", "float16", (-1,))), 8, True)


def official(rows: int = 2, raw: bool = True) -> bytes:
    """A ModelInferRequest as tritonclient's own classes write it."""
    r = pb.ModelInferRequest(model_name="m", id="req-1")
    x = np.arange(rows * 6, dtype=np.float32).reshape(rows, 2, 3)
    ids = np.arange(rows * 4, dtype=np.int64).reshape(rows, 4)
    for name, datatype, a in (("x", "FP32", x), ("ids", "INT64", ids)):
        t = r.inputs.add(name=name, datatype=datatype, shape=list(a.shape))
        if raw:
            r.raw_input_contents.append(a.tobytes())
        elif datatype == "FP32":
            t.contents.fp32_contents.extend(a.reshape(-1).tolist())
        else:
            t.contents.int64_contents.extend(a.reshape(-1).tolist())
    return r.SerializeToString()


def decode(data: bytes):
    return g.decode(g.M["ModelInferRequest"].FromString(data), MODEL)


@pytest.mark.parametrize("raw", [True, False])
def test_raw_and_typed_inputs_decode_in_the_models_order(raw):
    r = decode(official(3, raw=raw))
    assert r.rows == 3 and r.id == "req-1"
    assert torch.equal(r.tensors[0], torch.arange(18, dtype=torch.float32).reshape(3, 2, 3))
    assert torch.equal(r.tensors[1], torch.arange(12).reshape(3, 4))
    assert r.outputs == [(0, True), (1, True)]


def test_the_response_parses_with_the_official_client():
    import tritonclient.grpc as tg

    r = decode(official(2))
    outs = [torch.arange(10, dtype=torch.float32).reshape(2, 5), torch.tensor([1.5, -2.0], dtype=torch.float16)]
    message = pb.ModelInferResponse.FromString(g.encode(MODEL, r, outs).SerializeToString())
    result = tg.InferResult(message)
    assert message.model_name == "m" and message.id == "req-1"
    np.testing.assert_array_equal(result.as_numpy("y"), outs[0].numpy())
    np.testing.assert_array_equal(result.as_numpy("z"), outs[1].numpy())


def test_only_the_outputs_asked_for_are_sent():
    data = pb.ModelInferRequest.FromString(official(1))
    data.outputs.add(name="z")
    r = decode(data.SerializeToString())
    assert r.outputs == [(1, True)]
    outs = [torch.zeros(1, 5), torch.zeros(1, dtype=torch.float16)]
    assert [o.name for o in g.encode(MODEL, r, outs).outputs] == ["z"]


def edit(change):
    def made() -> bytes:
        r = pb.ModelInferRequest.FromString(official(2))
        change(r)
        return r.SerializeToString()
    return made


@pytest.mark.parametrize("made, says", [
    (edit(lambda r: r.inputs[0].__setattr__("name", "w")), "unknown input 'w'"),
    (edit(lambda r: r.inputs[1].__setattr__("name", "x")), "given twice"),
    (edit(lambda r: r.inputs[0].__setattr__("datatype", "FP16")), "is FP32, not FP16"),
    (edit(lambda r: r.inputs[0].shape.__setitem__(1, 3)), "must have shape [B, 2, 3]"),
    (edit(lambda r: r.inputs[0].shape.__setitem__(0, 9)), "B from 1 to 8"),
    (edit(lambda r: r.inputs[0].shape.extend([1] * 20)), "dimensions"),
    (edit(lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 47)), "has 47 raw bytes, but float32[2, 2, 3] is 48"),
    (edit(lambda r: r.raw_input_contents.pop()), "holds 1 tensors for 2 inputs"),
    (edit(lambda r: (r.inputs.pop(), r.raw_input_contents.pop())), "missing input 'ids'"),
    (edit(lambda r: r.outputs.add(name="nope")), "unknown output 'nope'"),
    (edit(lambda r: (r.outputs.add(name="y"), r.outputs.add(name="y"))), "asked for twice"),
    (edit(lambda r: (r.inputs[1].shape.__setitem__(0, 1), r.raw_input_contents.__setitem__(1, b"\0" * 32))),
     "different batch sizes"),
])
def test_every_defect_is_invalid_argument_naming_it(made, says):
    with pytest.raises(ProtocolError) as got:
        decode(made())
    assert got.value.status == 400 and says in str(got.value), str(got.value)
    assert g.CODES[got.value.status].name == "INVALID_ARGUMENT"


def test_typed_contents_are_counted_and_typed_before_a_tensor_is_made():
    r = pb.ModelInferRequest.FromString(official(2, raw=False))
    r.inputs[0].contents.fp32_contents.append(1.0)
    with pytest.raises(ProtocolError, match="holds 13 values; shape"):
        decode(r.SerializeToString())
    r = pb.ModelInferRequest.FromString(official(2, raw=False))
    r.inputs[1].contents.Clear()
    r.inputs[1].contents.fp32_contents.extend([0.0] * 8)  # INT64 values sent in the float field
    with pytest.raises(ProtocolError, match="'ids' has no values; send them in contents.int64_contents"):
        decode(r.SerializeToString())


def test_fp16_comes_only_as_raw_bytes():
    half = ModelInfo("h", (TensorInfo("x", "float16", (-1, 2)),), (TensorInfo("y", "float16", (-1, 2)),), 4, True)
    r = pb.ModelInferRequest(model_name="h")
    r.inputs.add(name="x", datatype="FP16", shape=[1, 2])
    with pytest.raises(ProtocolError, match="in raw_input_contents"):
        g.decode(g.M["ModelInferRequest"].FromString(r.SerializeToString()), half)
    r.raw_input_contents.append(np.array([[1.5, 2.0]], dtype=np.float16).tobytes())
    got = g.decode(g.M["ModelInferRequest"].FromString(r.SerializeToString()), half)
    assert got.tensors[0].tolist() == [[1.5, 2.0]]


def test_the_ingress_routes_on_the_bytes_the_official_client_writes_first():
    """A request naming a model starts, after gRPC's 5-byte frame header, with the bytes the
    ingress's rule for that model matches (`ingress.grpc_routes`)."""
    from nimble.serve import ingress

    for request in (pb.ModelInferRequest(model_name="resnet50", id="x"), pb.ModelMetadataRequest(name="resnet50"),
                    pb.ModelReadyRequest(name="resnet50", version="1"), pb.ModelStatisticsRequest(name="resnet50")):
        assert request.SerializeToString().startswith(g.model_name_prefix("resnet50"))
    assert not pb.ModelInferRequest(model_name="resnet5").SerializeToString().startswith(
        g.model_name_prefix("resnet50"))
    edits = ingress.grpc_routes(["resnet50", "bert.v2"])
    assert f"-m bin {g.model_name_prefix('resnet50').hex()}" in edits[0] and r"str bert\.v2" in edits[1]
    assert "use_backend %[str(grpc-resnet50)]" in edits[2]


def test_the_servicer_registers_every_method_the_server_answers():
    seen = {}

    class Server:
        def add_generic_rpc_handlers(self, handlers):
            seen.update(handlers[0]._method_handlers)

    class Servicer:
        def __getattr__(self, name):
            return lambda request, context: None

    g.add_servicer_to_server(Servicer(), Server())
    assert set(seen) == {f"/{g.SERVICE}/{m}" for m in g.METHODS}
    handler = seen[f"/{g.SERVICE}/ModelInfer"]
    assert handler.request_deserializer(official(1)).model_name == "m"


def test_a_port_another_grpc_server_holds_is_refused_even_where_it_shares_ports():
    """gRPC servers set SO_REUSEPORT unless told not to, and Ray Serve's 'not' is lost (a string
    where gRPC reads an integer): the replica's own check refuses such a port, so that Ray Serve
    takes another, rather than share it with another server's replica."""
    import asyncio

    import grpc

    from nimble.serve.ingress import refuse_taken_port

    async def held():
        server = grpc.aio.server(options=[("grpc.so_reuseport", "0")])  # as Ray 2.60 asks
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            second = grpc.aio.server(options=[("grpc.so_reuseport", "0")])
            assert second.add_insecure_port(f"127.0.0.1:{port}") == port  # what the check is for
            for address in (f"127.0.0.1:{port}", f"[::]:{port}"):
                with pytest.raises(RuntimeError, match=f"port {port} is held") as got:
                    refuse_taken_port(address)
                assert isinstance(got.value.__cause__, OSError)
        finally:
            await server.stop(None)

    asyncio.run(held())
    refuse_taken_port("127.0.0.1:0")  # any free port: never refused


def test_the_ingress_edits_route_by_model_and_answer_unavailable_where_no_model_is_served(tmp_path):
    """The edits applied by sed, as the ingress's wrapper applies them, to the lines of Ray's
    HAProxy config they concern (its shape in Ray 2.60)."""
    import subprocess

    from nimble.serve import ingress

    config = tmp_path / "haproxy.cfg"
    config.write_text("\n".join([
        "frontend grpc_frontend",
        "    acl is_grpc-bert req.hdr(application) -m str bert",
        "    use_backend grpc-bert if is_grpc-bert",
        "    default_backend default_grpc_backend",
        "backend default_grpc_backend",
        '    http-request return status 200 content-type application/grpc hdr grpc-status 5 hdr grpc-message '
        '"Application metadata not set. Ping /ray.serve.RayServeAPIService/ListApplications for available '
        'applications."',
        "backend grpc-bert",
        "    mode http",
        "    server r1 127.0.0.1:40001 proto h2 check",
        "    server fallback 127.0.0.1:9500 proto h2 check backup",
        "backend grpc-resnet",
        "    mode http",
        "    server r2 127.0.0.1:40002 proto h2 check",
        "backend http-bert",
        "    server fallback 127.0.0.1:8500 track http-bert/r1 backup", ""]))
    subprocess.run(["sed", "-i", *[a for e in ingress.grpc_routes(["bert", "resnet"]) for a in ("-e", e)], str(config)],
                   check=True)
    lines = [line.strip() for line in config.read_text().splitlines()]
    assert lines[1:6] == ["acl is_grpc-bert req.hdr(application) -m str bert",
                          f"acl nimble_model_grpc-bert req.body,bytes(5,6) -m bin {g.model_name_prefix('bert').hex()}",
                          "use_backend grpc-bert if nimble_model_grpc-bert", "use_backend grpc-bert if is_grpc-bert",
                          "use_backend %[str(grpc-bert)]"]
    status = next(line for line in lines if "grpc-status" in line)
    assert "grpc-status 14" in status and "starting or stopping" in status, status
    unavailable = ('http-request return status 200 content-type application/grpc hdr grpc-status 14 hdr grpc-message '
                   '"no replica of this model is up now; send the request again" if { nbsrv lt 1 }')
    assert lines[-10:] == ["backend grpc-bert", "mode http", unavailable, "server r1 127.0.0.1:40001 proto h2 check",
                           "backend grpc-resnet", "mode http", unavailable, "server r2 127.0.0.1:40002 proto h2 check",
                           "backend http-bert", "server fallback 127.0.0.1:8500 track http-bert/r1 backup"]
