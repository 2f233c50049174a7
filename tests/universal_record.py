"""DeepSpeed's own ``ds_to_universal`` output for the TP, TP x PP and AutoEP fixtures, as recorded once by
``tests/fixtures/record_ds_to_universal.py`` (``tests/fixtures/ds_to_universal_record.json``), so that the default tier
compares dsckpt's ``reshard --universal`` against it in milliseconds instead of launching ds_to_universal per test."""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"


def recorder():
    """The recording module (``describe_folder``, ``differences``, ``fixtures``)."""
    sys.path.insert(0, str(FIXTURES))
    try:
        import record_ds_to_universal
    finally:
        sys.path.remove(str(FIXTURES))
    return record_ds_to_universal


@cache
def record() -> dict:
    return json.loads((FIXTURES / "ds_to_universal_record.json").read_text())


def fixture_key(fx: Path) -> str:
    """``autotp/NAME`` for a fixture folder."""
    return fx.resolve().relative_to(FIXTURES.resolve()).as_posix()


def ds_to_universal_differences(fx: Path, folder: Path) -> list[str]:
    """How ``folder`` (holding ``<tag>_universal/`` and ``latest_universal``) differs from what ds_to_universal wrote
    for fixture ``fx``: the same files, and in each the same keys in order, dtypes, shapes, bytes, tensor attributes
    and objects (``torch.load``, test side). Empty when it is the same."""
    rec = recorder()
    want = record()["fixtures"][fixture_key(fx)]
    assert want["rc"] == 0, want
    return rec.differences(rec.describe_folder(folder), want["files"])
