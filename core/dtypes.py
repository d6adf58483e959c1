"""The one dtype table: every dtype torch has, and the ones a `.nimble` artifact can store.

The IR (`ir.ITEMSIZE`), the torch types (`ops/types.py`: torch dtypes and TorchScript's
ScalarType numbers) and the format (`formats/tensors.py`: safetensors codes) all read this
table. It is plain data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # torch's name, e.g. float32 for torch.float32
    itemsize: int
    safetensors: str  # the code a safetensors header uses for it
    scalar_type: int  # c10's ScalarType number, which TorchScript passes for a dtype argument


STORABLE: tuple[DType, ...] = (
    DType("float64", 8, "F64", 7), DType("float32", 4, "F32", 6), DType("float16", 2, "F16", 5),
    DType("bfloat16", 2, "BF16", 15), DType("int64", 8, "I64", 4), DType("int32", 4, "I32", 3),
    DType("int16", 2, "I16", 2), DType("int8", 1, "I8", 1), DType("uint8", 1, "U8", 0),
    DType("bool", 1, "BOOL", 11), DType("complex64", 8, "C64", 9),
)
BY_NAME = {d.name: d for d in STORABLE}

# Every other dtype of torch 2.11 to 2.14, and why an artifact cannot hold it.
UNSTORABLE: dict[str, str] = {
    **{name: "safetensors has no code for it" for name in ("complex128", "complex32", "bcomplex32")},
    **{name: "nimble does not compute in 8-bit or 4-bit floats yet" for name in (
        "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2")},
    **{name: "quantized tensors are not supported" for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")},
    **{name: "unsigned integers wider than 8 bits are not supported" for name in ("uint16", "uint32", "uint64")},
    **{f"{kind}{bits}": "sub-byte integers are not supported" for kind in ("int", "uint") for bits in range(1, 8)},
    **{name: "raw bit types are not supported" for name in ("bits8", "bits16", "bits1x8", "bits2x4", "bits4x2")},
}


# torch's other names for the same dtypes (torch.float is torch.float32)
ALIASES: dict[str, str] = {"float": "float32", "double": "float64", "half": "float16", "long": "int64",
                           "int": "int32", "short": "int16", "cfloat": "complex64", "cdouble": "complex128",
                           "chalf": "complex32"}


def canonical(name: str) -> str:
    """torch's own name for a dtype written as `float32`, `torch.float32` or an alias (`float`)."""
    name = name.strip().removeprefix("torch.")
    return ALIASES.get(name, name)


def refusal(name: str) -> str:
    """Why a dtype cannot be used, in one line naming the ones that can."""
    why = UNSTORABLE.get(name, "it is not a torch dtype")
    return f"dtype {name} cannot be stored in a .nimble artifact ({why}); use one of {', '.join(BY_NAME)}"
