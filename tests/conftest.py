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

    @property
    def expect_ambiguous(self) -> tuple[str, ...]:
        """Names this fixture was designed to leave unbound (fixture_models.FIXTURES); empty for most."""
        return tuple(_spec(self.name).get("expect_ambiguous", ()))

    @property
    def ep_size(self) -> int:
        """The expert-parallel size of a MoE fixture (1 otherwise): reshard keeps it, so target world
        sizes it does not divide are refused rather than resharded."""
        return int((self.meta.get("moe") or {}).get("ep_size", 1))

    @property
    def elastic(self) -> bool:
        """A ZeRO-1/2 ``elastic_checkpoint`` save: reshard rewrites it only to elastic ZeRO-1/2 files (its
        optimizer files keep no param groups), and refuses every other target by name."""
        return bool((self.meta.get("config", {}).get("zero_optimization") or {}).get("elastic_checkpoint"))

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


def _spec(name: str) -> dict:
    import sys

    sys.path.insert(0, str(FIXTURES))
    try:
        import fixture_models
    finally:
        sys.path.remove(str(FIXTURES))
    return fixture_models.FIXTURES.get(name, {})


def all_fixtures(*, include_ambiguous: bool = False) -> list[Fixture]:
    """Every committed fixture; those designed with an undeterminable binding (``expect_ambiguous``)
    only on request, since dsckpt rightly refuses much of what generic tests ask of them."""
    out = []
    for meta_path in sorted(FIXTURES.glob("*/truth.json")):
        meta = json.loads(meta_path.read_text())
        fx = Fixture(meta_path.parent.name, meta_path.parent, meta)
        if include_ambiguous or not fx.expect_ambiguous:
            out.append(fx)
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


def parsed_file(path: Path):
    """A .pt file as dsckpt parses it, tensors materialized (safe_load: no DeepSpeed import)."""
    from dsckpt import parsed_tree, safe_load

    return parsed_tree.materialize(safe_load.load(path))


def tree_differences(a, b, path: str = "") -> list[str]:
    """Where two parsed trees (:func:`parsed_file`) differ: keys and their order, scalar values (pickled objects by
    their fields), tensor dtypes, shapes, values and, for views, storage offset and storage size. ``[]``: the same."""
    import torch

    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return [f"{path}: keys {list(a)} != {list(b) if isinstance(b, dict) else type(b).__name__}"]
        return [d for k in a for d in tree_differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{path}: {type(a).__name__} of {len(a)} != {b!r:.60}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in tree_differences(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or (a.dtype, a.shape) != (b.dtype, b.shape):
            return [f"{path}: {a.dtype} {tuple(a.shape)} != {b!r:.60}"]
        if not torch.equal(a.cpu(), b.cpu()):
            return [f"{path}: values differ"]
        if (a.storage_offset(), a.untyped_storage().nbytes()) != (b.storage_offset(), b.untyped_storage().nbytes()):
            return [f"{path}: view at {a.storage_offset()} of {a.untyped_storage().nbytes()} bytes != "
                    f"{b.storage_offset()} of {b.untyped_storage().nbytes()}"]
        return []
    if type(a) is not type(b) or (vars(a) != vars(b) if hasattr(a, "__dict__") else a != b):
        return [f"{path}: {a!r:.60} != {b!r:.60}"]
    return []


def ids(fixtures: list[Fixture]) -> list[str]:
    return [f.name for f in fixtures]


def assert_no_fsync_writes_the_same_bytes(tmp_path: Path, monkeypatch, argv: list[str]) -> None:
    """``dsckpt *argv OUT`` fsyncs every output file by default; with ``--no-fsync`` it writes the very
    same files, with no fsync, still through the rename (no temp folder left), and says so on its first
    stdout line."""
    from click.testing import CliRunner

    from dsckpt.cli import main

    synced: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    runner = CliRunner()
    r = runner.invoke(main, [*argv, str(tmp_path / "durable"), "-q"])
    assert r.exit_code == 0, r.output
    files = sorted(p for p in (tmp_path / "durable").rglob("*") if p.is_file())
    assert len(synced) >= len(files) and "--no-fsync" not in r.stdout
    synced.clear()
    r = runner.invoke(main, [*argv, str(tmp_path / "fast"), "-q", "--no-fsync"])
    assert r.exit_code == 0, r.output
    assert synced == []
    assert "not fsync'd (--no-fsync)" in r.stdout.splitlines()[0] and r.stderr == ""
    fast = sorted(p for p in (tmp_path / "fast").rglob("*") if p.is_file())
    assert [p.relative_to(tmp_path / "fast") for p in fast] == [p.relative_to(tmp_path / "durable") for p in files]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(fast, files))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


@pytest.fixture(autouse=True)
def _deepspeed_on_cpu():
    """Tests that launch DeepSpeed (in subprocesses) run it on CPU ranks over gloo."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    yield
