"""Tensor element types by name, without torch: sizes, kinds, safetensors codes, numpy views.

dsckpt's read path (and ``to-fp32`` into safetensors) runs on numpy alone, so that converting a
checkpoint does not pay torch's import (about 1.5 s and 220 MB here). ``bfloat16`` has no numpy type:
its bytes are viewed as ``uint16`` and widened to float32 by a 16-bit shift, which is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DTYPES", "DType", "dtype_info", "from_float32", "to_float32"]


@dataclass(frozen=True)
class DType:
    name: str  # torch's name without "torch.": "float32", "bfloat16", ...
    itemsize: int
    is_floating: bool
    safetensors: str
    numpy: str  # numpy dtype that holds the same bytes (uint16 for bfloat16)
    storage: str  # the typed-storage class torch.save pickles for it ("FloatStorage")


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float64", 8, True, "F64", "<f8", "DoubleStorage"),
    DType("float32", 4, True, "F32", "<f4", "FloatStorage"),
    DType("float16", 2, True, "F16", "<f2", "HalfStorage"),
    DType("bfloat16", 2, True, "BF16", "<u2", "BFloat16Storage"),
    DType("int64", 8, False, "I64", "<i8", "LongStorage"),
    DType("int32", 4, False, "I32", "<i4", "IntStorage"),
    DType("int16", 2, False, "I16", "<i2", "ShortStorage"),
    DType("int8", 1, False, "I8", "i1", "CharStorage"),
    DType("uint8", 1, False, "U8", "u1", "ByteStorage"),
    DType("bool", 1, False, "BOOL", "?", "BoolStorage"),
    DType("complex64", 8, True, "C64", "<c8", "ComplexFloatStorage"),
    DType("complex128", 16, True, "C128", "<c16", "ComplexDoubleStorage"),
)}

_ALIASES = {"float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
            "short": "int16", "cfloat": "complex64", "cdouble": "complex128"}


def dtype_info(name: object) -> DType:
    """The :class:`DType` for a name (``"float32"``, ``"torch.float32"``) or a ``torch.dtype``."""
    key = str(name).removeprefix("torch.")
    key = _ALIASES.get(key, key)
    try:
        return DTYPES[key]
    except KeyError:
        raise ValueError(f"unsupported tensor dtype {name!r}") from None


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Widen a 1-D array holding ``dtype`` bytes (as :attr:`DType.numpy`) to float32, exactly."""
    if dtype == "float32":
        return raw
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32)


def from_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    """Narrow float32 to ``dtype`` bytes with round-to-nearest-even, as torch's ``.to()`` does."""
    if dtype == "float32":
        return x
    if dtype == "bfloat16":
        u = x.view(np.uint32)
        rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
        nan = np.isnan(x)
        if nan.any():  # keep NaN a NaN (rounding could carry it into inf): sign + quiet bit
            rounded[nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)
        return rounded
    with np.errstate(over="ignore"):  # out-of-range values become inf, as in torch
        return x.astype(DTYPES[dtype].numpy)
