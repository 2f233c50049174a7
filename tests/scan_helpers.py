"""Helpers for scan/repair tests: copy a fixture and plant non-finite values into the copy."""

from __future__ import annotations

import shutil
from pathlib import Path

from dsckpt import parsed_tree, safe_load, safe_save
from dsckpt.checkpoint import open_checkpoint
from dsckpt.model import Role
from dsckpt.readers.common import lookup

#: A stored copy as tests name it: a role (master, module) or an optimizer state key ("exp_avg", ...)
Copy = Role | str


def is_copy(piece, copy: Copy, replica: int | None = 0) -> bool:
    """Whether ``piece`` is the stored copy ``copy`` (of ``replica``; any replica when None)."""
    same = (piece.role is copy) if isinstance(copy, Role) else (piece.role is Role.OPTIM_STATE
                                                                 and piece.state_key == copy)
    return same and (replica is None or piece.replica == replica)


def copy_of(entry, copy: Copy, replica: int = 0):
    """The piece of ``entry`` that is the stored copy ``copy`` of ``replica``, or None."""
    return next((p for p in entry.pieces if is_copy(p, copy, replica)), None)


def read_copy(entry, cache, copy: Copy):
    """The consolidated tensor of the stored copy ``copy`` of ``entry``."""
    from dsckpt.assemble import read_entry

    return read_entry(entry, cache, copy if isinstance(copy, Role) else None,
                      state=copy if isinstance(copy, str) else None)


def copy_fixture(fx, dest: Path) -> Path:
    ckpt = dest / "ckpt"
    shutil.copytree(fx.ckpt, ckpt)
    return ckpt


def assert_scan_and_verify_clean(ckpt: Path) -> None:
    """``scan`` finds nothing and ``verify`` exits 0 (a clean fixture)."""
    from click.testing import CliRunner

    from dsckpt.cli import main
    from dsckpt.scan import scan

    report = scan(ckpt)
    assert report.findings == (), [f.describe() for f in report.findings]
    r = CliRunner().invoke(main, ["verify", str(ckpt)])
    assert r.exit_code == 0, r.output


def copy_tp_fixture(fx: Path, tmp_path: Path) -> Path:
    """A copy of a TP fixture's ``ckpt`` folder at ``tmp_path/<fixture>/ckpt``."""
    dst = tmp_path / fx.name / "ckpt"
    shutil.copytree(fx / "ckpt", dst)
    return dst


def plant(ckpt: Path, name: str, role: Copy, index: int, value: float, *, replica: int | None = 0) -> list[Path]:
    """Set logical element ``index`` of the ``role`` copy of ``name`` to ``value`` in the files (every
    replica when ``replica`` is None). Returns the files changed; legacy files stay legacy."""
    logical = open_checkpoint(ckpt).logical
    entry = logical.entry(name)
    changed = []
    for piece in entry.pieces:
        if not is_copy(piece, role, replica):
            continue
        for f in piece.fragments:
            if f.dst_offset <= index < f.dst_offset + f.numel:
                legacy = f.file.read_bytes()[:2] != b"PK"
                tree = parsed_tree.materialize(safe_load.load(f.file))
                t = lookup(tree, f.key, f.file)
                t.view(-1)[f.src_offset + index - f.dst_offset] = value
                safe_save.save(tree, f.file, legacy_format=legacy)
                changed.append(f.file)
    assert changed, f"{name} has no {role} copy holding element {index}"
    return changed


def flip_record_bit(ckpt: Path) -> tuple[Path, str]:
    """Flip one bit in the middle of the first tensor record over 64 bytes of the first optimizer file of the
    checkpoint copy ``ckpt``; returns (that file, the record's name in its zip)."""
    import struct
    import zipfile

    path = next(ckpt.glob("*/*optim_states.pt"))
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 64)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    data[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return path, info.filename
