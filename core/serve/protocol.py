"""The KServe v2 inference protocol (the one Triton Inference Server speaks), over HTTP, with its
binary tensor data extension: requests decoded and checked against the model, responses encoded.
No Ray and no HTTP server here: bytes and headers in, tensors out, and back.

A request body is JSON, or JSON followed by the raw bytes of the inputs that say
`"parameters": {"binary_data_size": N}` in order, with the JSON's length in the header
`Inference-Header-Content-Length`. Each input is checked before anything is allocated for it:
its name, datatype, shape (the first dimension is the batch, -1 in the metadata) and byte count.
Any defect is a `ProtocolError` with the HTTP status to answer and one line saying what is wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from ..ir import ITEMSIZE
from ..ops import types

HEADER_LENGTH = "Inference-Header-Content-Length"
DATATYPES = {"bool": "BOOL", "uint8": "UINT8", "int8": "INT8", "int16": "INT16", "int32": "INT32",
             "int64": "INT64", "float16": "FP16", "float32": "FP32", "float64": "FP64", "bfloat16": "BF16"}
MAX_BODY_BYTES = 64 * 2**20  # a request body; `nimble serve --max-body` sets it


class ProtocolError(Exception):
    """A request the server refuses: `status` is the HTTP status, the message one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # nimble's dtype name
    shape: tuple[int, ...]  # -1 for the batch dimension

    def document(self) -> dict:
        return {"name": self.name, "datatype": DATATYPES[self.dtype], "shape": list(self.shape)}


@dataclass(frozen=True)
class ModelInfo:
    """What the server says of a model, and what its requests are checked against."""

    name: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    max_batch: int  # rows one request may hold: the largest compiled batch size
    batched: bool  # the first dimension varies (a multi-batch artifact); else every shape is fixed

    def metadata(self) -> dict:
        return {"name": self.name, "versions": ["1"], "platform": "nimble",
                "inputs": [t.document() for t in self.inputs], "outputs": [t.document() for t in self.outputs]}


def model_info(name: str, graph, batch_sizes: list[int]) -> ModelInfo:
    """The ModelInfo of a loaded artifact's graph (its smallest batch size's)."""
    batched = len(batch_sizes) > 1

    def info(vid) -> TensorInfo:
        v = graph.values[vid]
        shape = (-1, *v.spec.shape[1:]) if batched else tuple(v.spec.shape)
        return TensorInfo(v.name, v.spec.dtype, shape)

    return ModelInfo(name, tuple(info(i) for i in graph.inputs), tuple(info(o) for o in graph.outputs),
                     max(batch_sizes) if batched else 1, batched)


@dataclass
class InferRequest:
    id: str | None
    tensors: list[torch.Tensor]  # one per model input, in the model's order (CPU)
    rows: int  # the batch: the first dimension of every input (1 for a model of fixed shapes)
    outputs: list[tuple[int, bool]] = field(default_factory=list)  # (output index, as binary data)
    received: float = 0.0  # time.perf_counter() when it was decoded (queue time)
    arrived: float = 0.0  # ... when the replica's handler took it, before its body was read (the timeline)
    ran: tuple[float, float] | None = None  # ... when the call that answered it began and ended (the timeline)


def decode(body: bytes, header_length: str | None, model: ModelInfo) -> InferRequest:
    """An infer request for `model`, checked; ProtocolError (400) names what is wrong."""
    split = len(body)
    if header_length is not None:
        if not (header_length.isascii() and header_length.isdigit() and len(header_length) <= 20
                and 0 < int(header_length) <= len(body)):
            raise ProtocolError(400, f"{HEADER_LENGTH} {header_length[:40]!r} is not a length within the body "
                                f"({len(body)} bytes)")
        split = int(header_length)
    doc = _json(body[:split])
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list):
        raise ProtocolError(400, "the request must be a JSON object with an 'inputs' list")
    binary = memoryview(body)[split:]
    want = {t.name: k for k, t in enumerate(model.inputs)}
    given: dict[int, torch.Tensor] = {}
    offset = 0
    for entry in doc["inputs"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ProtocolError(400, "each input must be an object with a 'name'")
        name = entry["name"]
        if name not in want:
            raise ProtocolError(400, f"unknown input '{name[:100]}'; {model.name} takes "
                                f"{', '.join(t.name for t in model.inputs)}")
        k = want[name]
        if k in given:
            raise ProtocolError(400, f"input '{name}' is given twice")
        info = model.inputs[k]
        shape = _shape(entry, info, model)
        size = _binary_size(entry)
        if size is None:
            given[k] = _from_json(entry.get("data"), shape, info)
        else:
            need = math.prod(shape) * ITEMSIZE[info.dtype]
            if size != need:
                raise ProtocolError(400, f"input '{name}' says binary_data_size {size}, but {info.dtype}"
                                    f"{list(shape)} is {need} bytes")
            if offset + size > len(binary):
                raise ProtocolError(400, f"input '{name}' needs {size} bytes of binary data, but only "
                                    f"{len(binary) - offset} follow the JSON")
            given[k] = torch.frombuffer(bytearray(binary[offset:offset + size]), dtype=types.DTYPES[info.dtype]) \
                .reshape(shape) if size else torch.empty(shape, dtype=types.DTYPES[info.dtype])
            offset += size
    if offset != len(binary):
        raise ProtocolError(400, f"{len(binary) - offset} bytes of binary data follow the inputs that no input "
                            "claims")
    tensors, rows = in_order(given, model)
    request_id = doc.get("id")
    return InferRequest(request_id if isinstance(request_id, str) else None, tensors, rows, _outputs(doc, model))


def in_order(given: dict[int, torch.Tensor], model: ModelInfo) -> tuple[list[torch.Tensor], int]:
    """The decoded inputs (input index -> tensor) in the model's order, and their rows; 400 where
    one is missing or their batch sizes differ."""
    missing = [t.name for k, t in enumerate(model.inputs) if k not in given]
    if missing:
        raise ProtocolError(400, f"missing input {', '.join(repr(m) for m in missing)}")
    rows = {t.shape[0] for t in given.values()} if model.batched else {1}
    if len(rows) > 1:
        raise ProtocolError(400, f"the inputs have different batch sizes ({', '.join(map(str, sorted(rows)))})")
    return [given[k] for k in range(len(given))], rows.pop()


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _json(data) -> object:
    """Strict JSON: NaN and Infinity, which Python's parser takes, are refused."""
    try:
        return json.loads(bytes(data), parse_constant=_not_json)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ProtocolError(400, "the request is not valid JSON (NaN and Infinity are not JSON either; send such "
                            "values as binary data)") from None


def _shape(entry: dict, info: TensorInfo, model: ModelInfo) -> tuple[int, ...]:
    shape, dtype = entry.get("shape"), entry.get("datatype")
    if dtype != DATATYPES[info.dtype]:
        raise ProtocolError(400, f"input '{info.name}' is {DATATYPES[info.dtype]}, not {str(dtype)[:20]}")
    if not (isinstance(shape, list) and all(type(d) is int for d in shape)):
        raise ProtocolError(400, f"input '{info.name}' needs a 'shape' list of integers")
    fits = len(shape) == len(info.shape) and all(d == w for d, w in zip(shape, info.shape) if w != -1)
    if model.batched and fits:
        fits = 1 <= shape[0] <= model.max_batch
    if not fits:
        want = "[" + ", ".join("B" if d == -1 else str(d) for d in info.shape) + "]"
        rows = f" with B from 1 to {model.max_batch}" if model.batched else ""
        raise ProtocolError(400, f"input '{info.name}' must have shape {want}{rows}, got {shape[:8]}")
    return tuple(shape)


def _binary_size(entry: dict) -> int | None:
    params = entry.get("parameters") or {}
    if not isinstance(params, dict):
        raise ProtocolError(400, f"input '{entry['name']}': 'parameters' must be an object")
    size = params.get("binary_data_size")
    if size is not None and (type(size) is not int or size < 0):
        raise ProtocolError(400, f"input '{entry['name']}': binary_data_size must be a byte count")
    return size


def _from_json(data, shape: tuple[int, ...], info: TensorInfo) -> torch.Tensor:
    flat = _flatten(data)
    if flat is None:
        raise ProtocolError(400, f"input '{info.name}' has neither 'data' nor binary_data_size")
    if len(flat) != math.prod(shape):
        raise ProtocolError(400, f"input '{info.name}' holds {len(flat)} values; shape {list(shape)} needs "
                            f"{math.prod(shape)}")
    kind = bool if info.dtype == "bool" else int if info.dtype.startswith(("int", "uint")) else (int, float)
    if not all(isinstance(v, kind) and (kind is bool or not isinstance(v, bool)) for v in flat):
        raise ProtocolError(400, f"input '{info.name}' ({DATATYPES[info.dtype]}) holds a value of another type")
    try:
        return torch.tensor(flat, dtype=types.DTYPES[info.dtype]).reshape(shape)
    except (OverflowError, RuntimeError, TypeError, ValueError) as e:  # a value outside the dtype: ValueError
        raise ProtocolError(400, f"input '{info.name}': {str(e).splitlines()[0][:120]}") from None


def _flatten(data) -> list | None:
    """A row-major flat list from flat or nested lists; None if absent or not a list."""
    if not isinstance(data, list):
        return None
    flat, todo = [], [iter(data)]
    while todo:
        for item in todo[-1]:
            if isinstance(item, list):
                todo.append(iter(item))
                break
            flat.append(item)
        else:
            todo.pop()
    return flat


def _outputs(doc: dict, model: ModelInfo) -> list[tuple[int, bool]]:
    params = doc.get("parameters") or {}
    binary_default = isinstance(params, dict) and params.get("binary_data_output") is True
    requested = doc.get("outputs")
    if requested is None:
        return [(k, binary_default) for k in range(len(model.outputs))]
    names = {t.name: k for k, t in enumerate(model.outputs)}
    out = []
    if not isinstance(requested, list):
        raise ProtocolError(400, "'outputs' must be a list")
    for entry in requested:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or name not in names:
            raise ProtocolError(400, f"unknown output {str(name)[:100]!r}; {model.name} gives "
                                f"{', '.join(names)}")
        if any(k == names[name] for k, _ in out):  # each output once: a response is never larger than them
            raise ProtocolError(400, f"output '{name}' is asked for twice; name each output once")
        p = entry.get("parameters") or {}
        out.append((names[name], bool(p.get("binary_data", binary_default)) if isinstance(p, dict) else False))
    return out


def encode(model: ModelInfo, request: InferRequest, outputs: list[torch.Tensor]) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers: JSON, followed by the binary outputs if any asked so."""
    entries, blobs = [], []
    for k, binary in request.outputs:
        t, info = outputs[k].detach().cpu().contiguous(), model.outputs[k]  # on the host already: no copy
        entry = {"name": info.name, "datatype": DATATYPES[info.dtype], "shape": list(t.shape)}
        if binary:
            blob = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""  # read, not copied
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ProtocolError(422, f"output '{info.name}' holds NaN or infinity, which JSON cannot carry; ask "
                                    "for it as binary data (parameters.binary_data_output)")
            entry["data"] = (t.float() if t.dtype in (torch.float16, torch.bfloat16) else t).flatten().tolist()
        entries.append(entry)
    doc = {"model_name": model.name, "model_version": "1", "outputs": entries}
    if request.id is not None:
        doc["id"] = request.id
    head = json.dumps(doc, separators=(",", ":")).encode()
    headers = {"content-type": "application/octet-stream" if blobs else "application/json"}
    if blobs:
        headers[HEADER_LENGTH] = str(len(head))
    return head + b"".join(blobs), headers


def error_body(message: str) -> bytes:
    """The protocol's error response: {"error": message}."""
    return json.dumps({"error": message}).encode()
