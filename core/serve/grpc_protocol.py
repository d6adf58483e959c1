"""The KServe v2 inference protocol over gRPC (Triton's `inference.GRPCInferenceService`):
its messages, its service's registration, and infer requests decoded and checked as the HTTP ones
are (`protocol.py`), answers encoded. No Ray and no server here.

The messages are described in code, field by field, from the protocol's published schema (the
KServe v2 gRPC spec and Triton's statistics and repository extensions); only the field numbers and
types reach the wire, so any client built from that schema (tritonclient.grpc) reads them. Every
input is checked before its tensor is made: name, datatype, shape and byte count, as over HTTP.
"""

from __future__ import annotations

import math

import grpc
import torch
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from ..ir import ITEMSIZE
from ..ops import types
from .protocol import DATATYPES, InferRequest, ModelInfo, ProtocolError, _from_json, _shape, in_order

SERVICE = "inference.GRPCInferenceService"
SERVICER = "nimble.serve.grpc_protocol.add_servicer_to_server"  # what Ray Serve's gRPC options import

_F = descriptor_pb2.FieldDescriptorProto
_TYPES = {"bool": _F.TYPE_BOOL, "int32": _F.TYPE_INT32, "int64": _F.TYPE_INT64, "uint32": _F.TYPE_UINT32,
          "uint64": _F.TYPE_UINT64, "float": _F.TYPE_FLOAT, "double": _F.TYPE_DOUBLE, "string": _F.TYPE_STRING,
          "bytes": _F.TYPE_BYTES}

# message -> its fields: (number, name, type, repeated); a type not in _TYPES is a message, and
# "map:X" a map from string to X. Nested names are flattened with a dot.
PARAMETER = "InferParameter"
MESSAGES: dict[str, list[tuple[int, str, str, bool]]] = {
    "ServerLiveRequest": [], "ServerLiveResponse": [(1, "live", "bool", False)],
    "ServerReadyRequest": [], "ServerReadyResponse": [(1, "ready", "bool", False)],
    "ModelReadyRequest": [(1, "name", "string", False), (2, "version", "string", False)],
    "ModelReadyResponse": [(1, "ready", "bool", False)],
    "ServerMetadataRequest": [],
    "ServerMetadataResponse": [(1, "name", "string", False), (2, "version", "string", False),
                               (3, "extensions", "string", True)],
    "ModelMetadataRequest": [(1, "name", "string", False), (2, "version", "string", False)],
    "TensorMetadata": [(1, "name", "string", False), (2, "datatype", "string", False), (3, "shape", "int64", True)],
    "ModelMetadataResponse": [(1, "name", "string", False), (2, "versions", "string", True),
                              (3, "platform", "string", False), (4, "inputs", "TensorMetadata", True),
                              (5, "outputs", "TensorMetadata", True)],
    PARAMETER: [(1, "bool_param", "bool", False), (2, "int64_param", "int64", False),
                (3, "string_param", "string", False), (4, "double_param", "double", False),
                (5, "uint64_param", "uint64", False)],
    "InferTensorContents": [(1, "bool_contents", "bool", True), (2, "int_contents", "int32", True),
                            (3, "int64_contents", "int64", True), (4, "uint_contents", "uint32", True),
                            (5, "uint64_contents", "uint64", True), (6, "fp32_contents", "float", True),
                            (7, "fp64_contents", "double", True), (8, "bytes_contents", "bytes", True)],
    "InferInputTensor": [(1, "name", "string", False), (2, "datatype", "string", False), (3, "shape", "int64", True),
                         (4, "parameters", f"map:{PARAMETER}", True), (5, "contents", "InferTensorContents", False)],
    "InferRequestedOutputTensor": [(1, "name", "string", False), (2, "parameters", f"map:{PARAMETER}", True)],
    "ModelInferRequest": [(1, "model_name", "string", False), (2, "model_version", "string", False),
                          (3, "id", "string", False), (4, "parameters", f"map:{PARAMETER}", True),
                          (5, "inputs", "InferInputTensor", True), (6, "outputs", "InferRequestedOutputTensor", True),
                          (7, "raw_input_contents", "bytes", True)],
    "InferOutputTensor": [(1, "name", "string", False), (2, "datatype", "string", False), (3, "shape", "int64", True),
                          (4, "parameters", f"map:{PARAMETER}", True), (5, "contents", "InferTensorContents", False)],
    "ModelInferResponse": [(1, "model_name", "string", False), (2, "model_version", "string", False),
                           (3, "id", "string", False), (4, "parameters", f"map:{PARAMETER}", True),
                           (5, "outputs", "InferOutputTensor", True), (6, "raw_output_contents", "bytes", True)],
    # Triton's statistics extension
    "ModelStatisticsRequest": [(1, "name", "string", False), (2, "version", "string", False)],
    "StatisticDuration": [(1, "count", "uint64", False), (2, "ns", "uint64", False)],
    "InferStatistics": [(1, "success", "StatisticDuration", False), (2, "fail", "StatisticDuration", False),
                        (3, "queue", "StatisticDuration", False), (4, "compute_input", "StatisticDuration", False),
                        (5, "compute_infer", "StatisticDuration", False),
                        (6, "compute_output", "StatisticDuration", False)],
    "InferBatchStatistics": [(1, "batch_size", "uint64", False), (2, "compute_input", "StatisticDuration", False),
                             (3, "compute_infer", "StatisticDuration", False),
                             (4, "compute_output", "StatisticDuration", False)],
    "ModelStatistics": [(1, "name", "string", False), (2, "version", "string", False),
                        (3, "last_inference", "uint64", False), (4, "inference_count", "uint64", False),
                        (5, "execution_count", "uint64", False), (6, "inference_stats", "InferStatistics", False),
                        (7, "batch_stats", "InferBatchStatistics", True)],
    "ModelStatisticsResponse": [(1, "model_stats", "ModelStatistics", True)],
    # Triton's repository extension
    "RepositoryIndexRequest": [(1, "repository_name", "string", False), (2, "ready", "bool", False)],
    "ModelIndex": [(1, "name", "string", False), (2, "version", "string", False), (3, "state", "string", False),
                   (4, "reason", "string", False)],
    "RepositoryIndexResponse": [(1, "models", "ModelIndex", True)],
}
ONEOF = {PARAMETER: "parameter_choice"}  # every field of these messages is one choice

# method -> (request, response): the unary methods this server answers. The service's other
# methods (shared memory, model load and unload, trace and log settings, streaming) are not
# registered, so a client calling one gets UNIMPLEMENTED.
METHODS = {
    "ServerLive": ("ServerLiveRequest", "ServerLiveResponse"),
    "ServerReady": ("ServerReadyRequest", "ServerReadyResponse"),
    "ModelReady": ("ModelReadyRequest", "ModelReadyResponse"),
    "ServerMetadata": ("ServerMetadataRequest", "ServerMetadataResponse"),
    "ModelMetadata": ("ModelMetadataRequest", "ModelMetadataResponse"),
    "ModelInfer": ("ModelInferRequest", "ModelInferResponse"),
    "ModelStatistics": ("ModelStatisticsRequest", "ModelStatisticsResponse"),
    "RepositoryIndex": ("RepositoryIndexRequest", "RepositoryIndexResponse"),
}


def _schema() -> descriptor_pb2.FileDescriptorProto:
    schema = descriptor_pb2.FileDescriptorProto(name="nimble/kserve_v2.proto", package="inference", syntax="proto3")
    for name, fields in MESSAGES.items():
        message = schema.message_type.add(name=name)
        if name in ONEOF:
            message.oneof_decl.add(name=ONEOF[name])
        for number, field_name, kind, repeated in fields:
            field = message.field.add(name=field_name, number=number, json_name=field_name)
            field.label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
            if name in ONEOF:
                field.oneof_index = 0
            if kind.startswith("map:"):  # map<string, X>: a repeated nested entry message, as protoc writes it
                entry = message.nested_type.add(name=_camel(field_name) + "Entry")
                entry.options.map_entry = True
                entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL, json_name="key")
                entry.field.add(name="value", number=2, type=_F.TYPE_MESSAGE, type_name=f".inference.{kind[4:]}",
                                label=_F.LABEL_OPTIONAL, json_name="value")
                field.type, field.type_name = _F.TYPE_MESSAGE, f".inference.{name}.{entry.name}"
            elif kind in _TYPES:
                field.type = _TYPES[kind]
            else:
                field.type, field.type_name = _F.TYPE_MESSAGE, f".inference.{kind}"
    service = schema.service.add(name=SERVICE.split(".")[1])
    for method, (request, response) in METHODS.items():
        service.method.add(name=method, input_type=f".inference.{request}", output_type=f".inference.{response}")
    return schema


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _classes() -> dict[str, type]:
    pool = descriptor_pool.DescriptorPool()  # its own pool: never clashes with a tritonclient imported beside it
    pool.Add(_schema())
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"inference.{name}")) for name in MESSAGES}


M = _classes()  # message name -> its class


def add_servicer_to_server(servicer, server) -> None:
    """Register `servicer`'s methods (named as the service's) on a grpc server: the function
    Ray Serve's `grpc_servicer_functions` names (SERVICER)."""
    handlers = {method: grpc.unary_unary_rpc_method_handler(
        getattr(servicer, method), request_deserializer=M[request].FromString,
        response_serializer=M[response].SerializeToString) for method, (request, response) in METHODS.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


# a ProtocolError's HTTP status -> the gRPC status a client sees
CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND, 408: grpc.StatusCode.DEADLINE_EXCEEDED,
         413: grpc.StatusCode.RESOURCE_EXHAUSTED, 422: grpc.StatusCode.FAILED_PRECONDITION,
         500: grpc.StatusCode.INTERNAL, 503: grpc.StatusCode.UNAVAILABLE}

# a datatype -> the InferTensorContents field its values may come in (FP16 and BF16 only as raw bytes)
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
            "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents"}


def decode(message, model: ModelInfo) -> InferRequest:
    """A ModelInferRequest for `model`, checked as `protocol.decode` checks an HTTP one."""
    raw = message.raw_input_contents
    if raw and len(raw) != len(message.inputs):
        raise ProtocolError(400, f"raw_input_contents holds {len(raw)} tensors for {len(message.inputs)} inputs; "
                            "give one per input, in order, or none")
    want = {t.name: k for k, t in enumerate(model.inputs)}
    given: dict[int, torch.Tensor] = {}
    for n, entry in enumerate(message.inputs):
        if entry.name not in want:
            raise ProtocolError(400, f"unknown input '{entry.name[:100]}'; {model.name} takes "
                                f"{', '.join(t.name for t in model.inputs)}")
        k = want[entry.name]
        if k in given:
            raise ProtocolError(400, f"input '{entry.name}' is given twice")
        info = model.inputs[k]
        if len(entry.shape) > 16:
            raise ProtocolError(400, f"input '{info.name}' has {len(entry.shape)} dimensions")
        shape = _shape({"shape": list(entry.shape), "datatype": entry.datatype}, info, model)
        dtype = types.DTYPES[info.dtype]
        if raw:
            need = math.prod(shape) * ITEMSIZE[info.dtype]
            if len(raw[n]) != need:
                raise ProtocolError(400, f"input '{info.name}' has {len(raw[n])} raw bytes, but {info.dtype}"
                                    f"{list(shape)} is {need} bytes")
            given[k] = torch.frombuffer(bytearray(raw[n]), dtype=dtype).reshape(shape) if need else \
                torch.empty(shape, dtype=dtype)
        else:
            field = CONTENTS.get(entry.datatype)
            values = list(getattr(entry.contents, field)) if field else []
            if field is None or (not values and math.prod(shape)):
                how = f"in contents.{field} or " if field else ""
                raise ProtocolError(400, f"input '{info.name}' has no values; send them {how}in raw_input_contents")
            given[k] = _from_json(values, shape, info)
    tensors, rows = in_order(given, model)
    names = {t.name: k for k, t in enumerate(model.outputs)}
    outputs = []
    for entry in message.outputs:
        if entry.name not in names:
            raise ProtocolError(400, f"unknown output {entry.name[:100]!r}; {model.name} gives {', '.join(names)}")
        if any(k == names[entry.name] for k, _ in outputs):
            raise ProtocolError(400, f"output '{entry.name}' is asked for twice; name each output once")
        outputs.append((names[entry.name], True))
    return InferRequest(message.id or None, tensors, rows, outputs or [(k, True) for k in range(len(model.outputs))])


def encode(model: ModelInfo, request: InferRequest, outputs: list[torch.Tensor]):
    """The ModelInferResponse: every asked output as raw bytes (the form tritonclient reads)."""
    response = M["ModelInferResponse"](model_name=model.name, model_version="1", id=request.id or "")
    for k, _ in request.outputs:
        t, info = outputs[k].detach().cpu().contiguous(), model.outputs[k]
        response.outputs.add(name=info.name, datatype=DATATYPES[info.dtype], shape=list(t.shape))
        response.raw_output_contents.append(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return response


def metadata(model: ModelInfo):
    doc = model.metadata()
    return M["ModelMetadataResponse"](
        name=doc["name"], versions=doc["versions"], platform=doc["platform"],
        inputs=[M["TensorMetadata"](**t) for t in doc["inputs"]],
        outputs=[M["TensorMetadata"](**t) for t in doc["outputs"]])


def statistics(document: dict):
    """A ModelStatisticsResponse from the document `replica.Stats.document` writes."""
    def duration(d: dict):
        return M["StatisticDuration"](count=d["count"], ns=d["ns"])

    response = M["ModelStatisticsResponse"]()
    for s in document["model_stats"]:
        inference = {k: duration(v) for k, v in s["inference_stats"].items()}
        response.model_stats.add(
            name=s["name"], version=s["version"], last_inference=s["last_inference"],
            inference_count=s["inference_count"], execution_count=s["execution_count"],
            inference_stats=M["InferStatistics"](**inference),
            batch_stats=[M["InferBatchStatistics"](batch_size=b["batch_size"],
                                                   compute_infer=duration(b["compute_infer"]))
                         for b in s["batch_stats"]])
    return response


def model_name_prefix(name: str) -> bytes:
    """The bytes a gRPC request naming model `name` in its first field starts with, after the
    5-byte gRPC frame header: field 1 (tag 0x0a), the name's length, the name. The ingress routes
    on them (`ingress.haproxy_environment`); a name is at most 64 bytes, so its length is one byte."""
    data = name.encode()
    if len(data) >= 128:  # names are checked to 64 (lifecycle.NAME): a longer one would need a longer varint
        raise ValueError(f"model name {name[:80]!r} is over 127 bytes")
    return b"\x0a" + bytes([len(data)]) + data
