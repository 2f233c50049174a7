"""Shared test helpers: the committed DeepSpeed fixtures and their recorded ground truth."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@dataclass(frozen=True)
class Fixture:
    name: str
    dir: Path
    meta: dict

    @property
    def ckpt(self) -> Path:
        return self.dir / "ckpt"

    def truth(self) -> dict:
        from safetensors.torch import load_file

        return load_file(str(self.dir / "truth.safetensors"))

    def expected_fp32(self) -> dict:
        """name -> tensor as to-fp32 must produce it: params fp32, buffers fp32 unless integer."""
        out = {}
        for key, t in self.truth().items():
            kind, name = key.split("/", 1)
            if kind == "param":
                out[name] = t.float()
            elif kind == "buffer":
                out[name] = t.float() if t.is_floating_point() else t
        return out


def all_fixtures() -> list[Fixture]:
    out = []
    for meta_path in sorted(FIXTURES.glob("*/truth.json")):
        meta = json.loads(meta_path.read_text())
        out.append(Fixture(meta_path.parent.name, meta_path.parent, meta))
    return out


def fixtures_where(**conditions) -> list[Fixture]:
    """Fixtures whose truth.json matches every ``key=value`` (a callable value is a predicate)."""
    chosen = []
    for fx in all_fixtures():
        ok = True
        for key, want in conditions.items():
            have = fx.meta.get(key)
            ok &= want(have) if callable(want) else have == want
        if ok:
            chosen.append(fx)
    return chosen


def tree_digest(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (to prove inputs are left byte-identical)."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def ids(fixtures: list[Fixture]) -> list[str]:
    return [f.name for f in fixtures]


@pytest.fixture(autouse=True)
def _deepspeed_on_cpu():
    """Tests that launch DeepSpeed (in subprocesses) run it on CPU ranks over gloo."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    yield
