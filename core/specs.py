"""Parsing of user-given input specs (`--shape 1x3x224x224`, `--dtype float32`) and the other
options a command checks before it imports torch. No torch."""

from __future__ import annotations

from .dtypes import canonical, refusal
from .errors import UsageError
from .ir import ITEMSIZE, TensorSpec


MAX_INPUT_BYTES = 2**32  # one input's bytes (4 GiB); raise it with NIMBLE_MAX_INPUT_BYTES


def parse_shape(text: str) -> tuple[int, ...]:
    """'1x3x224x224' -> (1, 3, 224, 224). A 0-d tensor is written 'scalar'. Each dimension is a
    plain ASCII integer of at least 1."""
    text = text.strip()
    if text == "scalar":
        return ()
    dims = text.lower().split("x")
    if not all(d.isascii() and d.isdigit() for d in dims):
        raise UsageError(f"--shape {text!r} is not a shape; write dimensions joined by 'x', "
                         "e.g. --shape 1x3x224x224")
    shape = tuple(int(d) for d in dims)
    if min(shape) < 1:
        raise UsageError(f"--shape {text!r} has a dimension of 0; every dimension is at least 1")
    return shape


def max_input_bytes() -> int:
    import os

    text = os.environ.get("NIMBLE_MAX_INPUT_BYTES", "")
    return int(text) if text.isascii() and text.isdecimal() else MAX_INPUT_BYTES


NEED_SHAPES = "give each model input a shape with --shape, e.g. --shape 1x3x224x224"


def input_specs(shapes: list[str], dtypes: list[str] | None = None) -> list[TensorSpec]:
    """One TensorSpec per --shape. Give no --dtype (float32), one for all inputs, or one per input."""
    if not shapes:
        raise UsageError(NEED_SHAPES)
    dtypes = list(dtypes or ["float32"])
    if len(dtypes) == 1:
        dtypes *= len(shapes)
    if len(dtypes) != len(shapes):
        raise UsageError(f"{len(dtypes)} --dtype values for {len(shapes)} --shape values; give one "
                         "--dtype for all inputs or one per input")
    specs = []
    for shape, dtype in zip(shapes, dtypes):
        dtype = canonical(dtype)
        if dtype not in ITEMSIZE:
            raise UsageError(f"--dtype {dtype!r}: {refusal(dtype).removeprefix(f'dtype {dtype} ')}")
        spec = TensorSpec(parse_shape(shape), dtype)
        cap = max_input_bytes()
        if spec.numel * ITEMSIZE[dtype] > cap:
            raise UsageError(f"--shape {shape.strip()} ({dtype}) needs {spec.numel * ITEMSIZE[dtype]:,} bytes, over the "
                             f"limit of {cap:,} per input; use a smaller shape, or raise the limit with "
                             "NIMBLE_MAX_INPUT_BYTES")
        specs.append(spec)
    return specs


def parse_streams(streams: str | int) -> str | int:
    if streams == "auto":
        return streams
    if isinstance(streams, int) or (isinstance(streams, str) and streams.isdigit()):
        if int(streams) >= 1:
            return int(streams)
    raise UsageError(f"--streams {streams!r}: use auto (one stream per chain), 1, or a cap such as 8")


DEVICES = ("auto", "cpu", "cuda")  # --device
TUNE_MODES = ("off", "cached", "full")  # --tune (runtime/tune/choices.py says what each does)


def check_device_name(device: str) -> None:
    if device not in DEVICES:
        raise UsageError(f"--device {device!r}: use auto, cpu or cuda")


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str, option: str = "--max-memory") -> int:
    """`512MiB`, `2GB`, `1.5GiB` or a plain number of bytes, as a positive int."""
    import re

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise UsageError(f"{option} {text!r}: give a size such as 4GiB, 512MiB, 2GB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[unit])


def check_tune_mode(tune: str) -> None:
    if tune not in TUNE_MODES:
        raise UsageError(f"--tune {tune!r}: use off, cached or full")


PRECISIONS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}  # --precision -> dtype


def check_precision(precision: str, io_dtype: str = "model", tolerance: float | None = None) -> None:
    """--precision, --io-dtype and --tolerance, together."""
    if precision not in PRECISIONS:
        raise UsageError(f"--precision {precision!r}: use fp32, fp16 or bf16")
    if io_dtype not in ("model", "reduced"):
        raise UsageError(f"--io-dtype {io_dtype!r}: use model (inputs and outputs keep the model's dtype) or reduced")
    if tolerance is not None and not 0 < tolerance < 1:
        raise UsageError(f"--tolerance {tolerance:g}: give a relative L2 error between 0 and 1, e.g. 1e-2")
    if precision == "fp32" and (tolerance is not None or io_dtype != "model"):
        raise UsageError("--tolerance and --io-dtype go with --precision fp16 or bf16")


MAX_BATCH_SIZES = 16  # --batch-sizes: graphs one artifact holds
MAX_BATCH = 2**16


def parse_batch_sizes(text: str | None) -> list[int] | None:
    """'1,2,4,8,16' -> [1, 2, 4, 8, 16] (sorted, each once); None or '' -> None (one batch size)."""
    if text is None or not str(text).strip():
        return None
    parts = [p.strip() for p in str(text).split(",")]
    if not all(p.isascii() and p.isdigit() and 1 <= int(p) <= MAX_BATCH for p in parts):
        raise UsageError(f"--batch-sizes {text!r}: give batch sizes from 1 to {MAX_BATCH} joined by commas, "
                         "e.g. --batch-sizes 1,2,4,8,16")
    sizes = sorted({int(p) for p in parts})
    if len(sizes) > MAX_BATCH_SIZES:
        raise UsageError(f"--batch-sizes {text!r}: at most {MAX_BATCH_SIZES} batch sizes per artifact")
    return sizes


NAME_PATTERN = r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}"  # a client's name for an input or output: 1 to 64 characters


def parse_names(text: str | None, option: str) -> tuple[str, ...] | None:
    """'input_ids,attention_mask' -> ('input_ids', 'attention_mask'); None or '' -> None."""
    import re

    if text is None or not str(text).strip():
        return None
    names = tuple(p.strip() for p in str(text).split(","))
    bad = next((n for n in names if not re.fullmatch(NAME_PATTERN, n)), None)
    if bad is not None:
        raise UsageError(f"{option} {bad[:80]!r}: a name starts with a letter or _, and holds up to 64 letters, "
                         "digits, _, . and -; join names with commas, e.g. {option} logits,hidden".replace(
                             "{option}", option))
    if len(set(names)) != len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise UsageError(f"{option}: {twice!r} is given twice; each input or output needs its own name")
    return names


def with_batch(specs: list[TensorSpec], batch: int, model: str = "the model") -> list[TensorSpec]:
    """`specs` with the first dimension of every input set to `batch`."""
    for k, s in enumerate(specs):
        if not s.shape:
            raise UsageError(f"{model}: input {k} is a scalar, so it has no batch dimension for --batch-sizes")
    return [TensorSpec((batch, *s.shape[1:]), s.dtype) for s in specs]
