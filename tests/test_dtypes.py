"""The torch-free conversions used by to-fp32 agree with torch bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsckpt.convert import convert_chunk
from dsckpt.dtypes import from_float32, to_float32

SPECIAL = [0.0, -0.0, 1.0, -1.0, 65504.0, 65520.0, 70000.0, 3.3895314e38, 3.4e38, 1e-40, -1e-45,
           float("inf"), float("-inf"), 1.00390625, 1.01171875, 2.0 ** -126, 2.0 ** -133]


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=64))
def test_narrowing_rounds_like_torch(values):
    x = torch.tensor(values + SPECIAL, dtype=torch.float32)
    assert np.array_equal(from_float32(x.numpy(), "bfloat16"), _bits(x.to(torch.bfloat16)))
    assert np.array_equal(from_float32(x.numpy(), "float16").view(np.uint16), _bits(x.to(torch.float16)))


@settings(derandomize=True, max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=64))
def test_widening_is_exact_for_every_bit_pattern(patterns):
    raw = np.array(patterns, dtype=np.uint16)
    for name, tdtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        want = torch.from_numpy(raw.view(np.int16).copy()).view(tdtype).float().numpy()
        got = to_float32(raw if name == "bfloat16" else raw.view(np.float16), name)
        assert np.array_equal(got, want, equal_nan=True)


def test_nan_stays_nan_and_counts():
    x = np.array([1.0, np.nan, np.inf, -np.inf, 2.0], dtype=np.float32)
    out, bad = convert_chunk(x, "float32", "bfloat16")
    assert bad == (1, 1, 1)
    assert np.isnan(to_float32(out, "bfloat16")[1])
    assert to_float32(out, "bfloat16")[2] == np.inf


@pytest.mark.parametrize("src", ["bfloat16", "float16"])
def test_16bit_nonfinite_counted_before_widening(src):
    t = torch.tensor([1.0, float("nan"), float("inf"), float("-inf")], dtype=getattr(torch, src))
    raw = t.view(torch.int16).numpy().view(np.uint16 if src == "bfloat16" else np.float16)
    out, bad = convert_chunk(raw, src, "float32")
    assert bad == (1, 1, 1)
    assert np.array_equal(out, t.float().numpy(), equal_nan=True)
