"""``to-dcp`` makes OUT durable with one fsync per file it writes and one per folder (issue 42): each DCP data file
is fsync'd once by the thread that wrote it, ``.metadata`` and the folders once by the atomic publish; not once or
twice per tensor as DCP's ``FileSystemWriter`` with ``sync_files`` and a second pass over every file did."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
from conftest import FIXTURES

from dsckpt.checkpoint import open_checkpoint
from dsckpt.dcp_writer import plan_to_dcp, run_to_dcp


def _count_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``os.fsync`` is called on, in order, from any thread."""
    calls: list[str] = []
    real = os.fsync

    def counting(fd: int) -> None:
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return calls


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fd's file through /proc")
@pytest.mark.parametrize("workers", [1, 3])
def test_each_file_and_folder_is_flushed_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    c = open_checkpoint(FIXTURES / "s3_bf16_w3_subgroups" / "ckpt", check_master_copies=True)
    plan = plan_to_dcp(c.logical, tmp_path / "out" / "dcp")
    calls = _count_fsyncs(monkeypatch)
    result = run_to_dcp(plan, c.cache, workers=workers)
    files = sorted(p.name for p in plan.output.iterdir())
    assert files == [".metadata", *(f"__0_{k}.distcp" for k in range(workers))]  # one data file per worker
    assert [p.name for p in result.files] == files
    names = Counter(Path(p).name for p in calls)
    assert {n: names[n] for n in files} == dict.fromkeys(files, 1)  # every file once
    temp = [n for n in names if n not in files]  # the temp folder (renamed to OUT after) and OUT's parent
    assert names[plan.output.parent.name] == 1 and len(temp) == 2, calls
    assert len(calls) == len(files) + 2


def test_files_get_nearly_equal_bytes() -> None:
    """The tensors go to at most ``workers`` files, largest first onto the emptiest (as DCP's own writer splits a
    rank's items over its threads), each file in state-dict order; never an empty file."""
    from dsckpt.dcp_writer import _bins

    assert _bins([64, 4, 64, 4, 64, 0], 4) == [[0], [2], [4], [1, 3, 5]]
    assert _bins([10, 10, 10], 2) == [[0, 2], [1]]
    assert _bins([1, 2], 8) == [[1], [0]]
    assert _bins([], 4) == []
