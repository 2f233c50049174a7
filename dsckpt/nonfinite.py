"""Counting NaN / +inf / -inf without torch (the ``to-fp32`` streaming path)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["NonFinite", "count_nonfinite_np"]


@dataclass(frozen=True)
class NonFinite:
    """NaN / +inf / -inf counts of one tensor (``to-fp32`` warnings)."""

    name: str
    nan: int
    posinf: int
    neginf: int
    numel: int

    def describe(self) -> str:
        parts = [f"{n} {label}" for n, label in ((self.nan, "NaN"), (self.posinf, "+inf"), (self.neginf, "-inf")) if n]
        return f"{self.name}: {', '.join(parts)} of {self.numel} values"


def count_nonfinite_np(x: np.ndarray) -> tuple[int, int, int]:
    """``(nan, +inf, -inf)`` counts of a floating numpy array (vectorised)."""
    if x.dtype.kind not in "fc":
        return 0, 0, 0
    # Any NaN/inf makes the sum NaN/inf, so a finite sum proves every value finite in one pass; a
    # finite array whose sum overflows falls through to the exact count.
    with np.errstate(all="ignore"):
        total = np.sum(x, dtype=np.float64 if x.dtype == np.float64 else np.float32)
    if np.isfinite(total) or np.isfinite(x).all():
        return 0, 0, 0
    return int(np.isnan(x).sum()), int(np.isposinf(x).sum()), int(np.isneginf(x).sum())
