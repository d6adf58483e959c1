"""Parsing of user-given input specs: `--shape 1x3x224x224` and `--dtype float32`. No torch."""

from __future__ import annotations

from .errors import UsageError
from .ir import ITEMSIZE, TensorSpec


def parse_shape(text: str) -> tuple[int, ...]:
    """'1x3x224x224' -> (1, 3, 224, 224). A 0-d tensor is written 'scalar'."""
    text = text.strip()
    if text == "scalar":
        return ()
    dims = text.lower().split("x")
    if not all(d.isdigit() for d in dims):
        raise UsageError(f"--shape {text!r} is not a shape; write dimensions joined by 'x', "
                         "e.g. --shape 1x3x224x224")
    return tuple(int(d) for d in dims)


def input_specs(shapes: list[str], dtypes: list[str] | None = None) -> list[TensorSpec]:
    """One TensorSpec per --shape. Give no --dtype (float32), one for all inputs, or one per input."""
    if not shapes:
        raise UsageError("give each model input a shape with --shape, e.g. --shape 1x3x224x224")
    dtypes = list(dtypes or ["float32"])
    if len(dtypes) == 1:
        dtypes *= len(shapes)
    if len(dtypes) != len(shapes):
        raise UsageError(f"{len(dtypes)} --dtype values for {len(shapes)} --shape values; give one "
                         "--dtype for all inputs or one per input")
    specs = []
    for shape, dtype in zip(shapes, dtypes):
        dtype = dtype.removeprefix("torch.")
        if dtype not in ITEMSIZE:
            raise UsageError(f"--dtype {dtype!r} is not a dtype; use one of {', '.join(ITEMSIZE)}")
        specs.append(TensorSpec(parse_shape(shape), dtype))
    return specs
