"""Value evidence for bindings: fingerprints of stored 16-bit copies and of fp32 masters rounded to 16 bits.

DeepSpeed 0.19.8 refreshes every 16-bit module copy from its fp32 master after each step with a plain
cast (``FP16_Optimizer``: ``fp16_groups_flat[i].copy_(fp32_groups_flat[i])``; ``FP16_UnfusedOptimizer``:
``p.data.copy_(q.data)``), so the copy is the master rounded to nearest even, bit for bit. Equal
fingerprints are the proof a reader needs before it attaches a master to a name. NaNs are compared as
"a NaN" (payloads differ between kernels). Torch-free: numpy, bounded chunks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..dtypes import DTYPES, from_float32, to_float32
from ..tensor_ref import StorageRef, TensorRef

__all__ = ["Fingerprint", "fingerprint_16bit", "fingerprint_rounded", "whole_storage"]

_CHUNK_NUMEL = 4 * 1024 * 1024
_NAN_BITS = {"bfloat16": (0x7F80, 0x007F, 0x7FC0), "float16": (0x7C00, 0x03FF, 0x7E00)}


@dataclass(frozen=True)
class Fingerprint:
    """A digest of 16-bit values; ``exact`` says whether the fp32 values it came from are exactly
    representable in that dtype (always True for a stored 16-bit copy)."""

    dtype: str
    numel: int
    digest: bytes
    exact: bool


def whole_storage(storage: StorageRef) -> TensorRef:
    """A flat view of a whole storage (e.g. the 16-bit flat buffer that stage-0 params are views into)."""
    return TensorRef(storage, 0, (storage.numel,), (1,))


def _canonical(bits: np.ndarray, dtype: str) -> np.ndarray:
    exp, mant, nan = _NAN_BITS[dtype]
    is_nan = ((bits & exp) == exp) & ((bits & mant) != 0)
    if is_nan.any():
        bits = bits.copy()
        bits[is_nan] = nan
    return bits


def _chunks(ref: TensorRef, start: int, numel: int):  # type: ignore[no-untyped-def]
    if ref.is_contiguous():
        for lo in range(start, start + numel, _CHUNK_NUMEL):
            yield ref.read_numpy(lo, min(_CHUNK_NUMEL, start + numel - lo))
        return
    flat = ref.load().reshape(-1)[start : start + numel]  # strided stored tensor (rare): via torch
    import torch

    if flat.dtype == torch.bfloat16:
        yield flat.view(torch.int16).numpy().view(np.uint16)
    elif flat.dtype == torch.float16:
        yield flat.numpy().view(np.uint16)
    else:
        yield flat.numpy()


def fingerprint_16bit(ref: TensorRef, start: int = 0, numel: int | None = None) -> Fingerprint | None:
    """Fingerprint of a stored bf16/fp16 tensor's elements ``[start, start + numel)``; None if it is not
    16-bit floating point."""
    dtype = ref.dtype_name
    if dtype not in _NAN_BITS:
        return None
    numel = ref.numel - start if numel is None else numel
    h = hashlib.blake2b(digest_size=16)
    for raw in _chunks(ref, start, numel):
        h.update(_canonical(raw.view(np.uint16), dtype).tobytes())
    return Fingerprint(dtype, numel, h.digest(), True)


def fingerprint_rounded(ref: TensorRef, dtype: str, start: int = 0, numel: int | None = None) -> Fingerprint | None:
    """Fingerprint of fp32 elements ``[start, start + numel)`` of ``ref`` rounded to ``dtype`` (bf16 or
    fp16) as DeepSpeed casts them; None if ``ref`` is not fp32 or ``dtype`` not 16-bit."""
    if ref.dtype_name != "float32" or dtype not in _NAN_BITS:
        return None
    numel = ref.numel - start if numel is None else numel
    h = hashlib.blake2b(digest_size=16)
    exact = True
    for raw in _chunks(ref, start, numel):
        x = raw.view(np.float32)
        bits = from_float32(x, dtype).view(np.uint16)
        if exact:
            back = to_float32(bits.view(DTYPES[dtype].numpy), dtype)
            exact = bool(np.array_equal(back, x, equal_nan=True))
        h.update(_canonical(bits, dtype).tobytes())
    return Fingerprint(dtype, numel, h.digest(), exact)
