"""scan/verify in worker processes (issue 35): the same reports as in threads, CRC-32s combined in the parent
(a flipped bit still fails its record's check, named as with threads), results applied in task order."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from conftest import all_fixtures
from scan_helpers import copy_fixture, flip_record_bit, plant

from dsckpt import scan_engine
from dsckpt.errors import CorruptCheckpointError
from dsckpt.model import Role
from dsckpt.scan import prepare_scan, scan
from dsckpt.verify import Area, verify

FIXTURES = {f.name: f for f in all_fixtures()}


def _reports(ckpt, monkeypatch, mode: str) -> str:
    """``scan`` (all checks and --nonfinite) and ``verify`` of ``ckpt``, as JSON, with DSCKPT_SCAN_PROCESSES=mode."""
    monkeypatch.setenv(scan_engine.PROCESSES_ENV, mode)
    pools = []
    run = scan_engine.run_processes
    monkeypatch.setattr(scan_engine, "run_processes", lambda *a: pools.append(1) or run(*a))
    out = {}
    for name, fn in (("scan", lambda: scan(ckpt)), ("scan-nf", lambda: scan(ckpt, nonfinite_only=True)),
                     ("verify", lambda: verify(ckpt))):
        try:
            out[name] = fn().to_dict()
        except CorruptCheckpointError as e:
            out[name] = str(e)
    assert bool(pools) == (mode == "1")  # the mode asked for ran
    return json.dumps(out, sort_keys=True, default=str)


@pytest.mark.parametrize("name", ["s2_bf16_w2_2groups", "ds0189_s3_bf16_w2", "moe_s1_bf16_w4_ep2"])
def test_processes_give_the_reports_threads_give(tmp_path, monkeypatch, name):
    """Findings (inf/NaN in several copies, a master/16-bit mismatch), counts, first indices, bytes read and
    records verified are identical, with blocks of 8 bytes (the parent's block sizes reach the workers)."""
    ckpt = copy_fixture(FIXTURES[name], tmp_path)
    entry = prepare_scan(ckpt)[0].entries[0].name
    plant(ckpt, entry, Role.MASTER, 1, math.nan)
    plant(ckpt, entry, Role.MASTER, 3, 1e30)  # its bf16 copy now disagrees
    plant(ckpt, entry, "exp_avg", 2, -math.inf)
    monkeypatch.setattr(scan_engine, "BLOCK_NBYTES", 8)
    monkeypatch.setattr(scan_engine, "COMPARE_BLOCK_NUMEL", 3)
    threads = _reports(ckpt, monkeypatch, "0")
    assert _reports(ckpt, monkeypatch, "1") == threads
    doc = json.loads(threads)
    compared = "_s3_" not in name  # a stage-3 checkpoint keeps no 16-bit copy to compare
    assert {f["check"] for f in doc["scan"]["findings"]} == {"nonfinite", *(["mismatch"] if compared else [])}
    assert not doc["verify"]["ok"]


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_processes_add_every_crc_the_threads_add(tmp_path, monkeypatch, start):
    """Each range's CRC-32 comes back from the worker and is chained onto the parent's record check: after the
    value pass, the same records are verified (or partly covered, by the same bytes) as with threads; with
    workers forked or started by a fork server (the start used where the caller runs other threads)."""
    monkeypatch.setattr(scan_engine, "_start_method", lambda: start)
    ckpt = copy_fixture(FIXTURES["ds0189_s2_bf16_w2"], tmp_path)

    def coverage(processes: bool):
        plan, cache = prepare_scan(ckpt)
        plan = dataclasses.replace(plan, chunk_numel=5)
        scan_engine.scan_pass(plan, cache, on_progress=None, workers=2, processes=processes)
        checks = [r.storage.check for r in cache.tensor_refs() if r.storage.check is not None]
        return sorted((str(c.path), c.record, c.done, c.result, c.covered_nbytes()) for c in checks)

    threads = coverage(False)
    assert sum(done for _, _, done, _, _ in threads) > 0
    assert coverage(True) == threads


def test_a_flipped_bit_is_caught_and_named_in_processes(tmp_path, monkeypatch):
    """A flipped bit in a record of an optimizer file: ``scan`` raises the thread mode's error, naming the file
    and record, and ``verify`` reports that record (the chained CRC is completed in the parent)."""
    ckpt = copy_fixture(FIXTURES["ds0189_s2_bf16_w2"], tmp_path)
    path, record = flip_record_bit(ckpt)
    monkeypatch.setattr(scan_engine, "BLOCK_NBYTES", 64)
    threads = _reports(ckpt, monkeypatch, "0")
    assert _reports(ckpt, monkeypatch, "1") == threads
    doc = json.loads(threads)
    assert "fails its CRC32 check" in doc["scan"] and f"record '{record}'" in doc["scan"] and path.name in doc["scan"]
    monkeypatch.setenv(scan_engine.PROCESSES_ENV, "1")
    records = [p for p in verify(ckpt).problems if p.area is Area.RECORDS]
    assert [p.where for p in records] == [f"{path.name} {record}"]
    assert "fails its CRC32 check" in records[0].message


class _Boom(Exception):
    pass


@pytest.mark.parametrize("fail_at", [None, 23])
def test_process_pool_applies_in_task_order_and_raises_after_earlier_tasks(monkeypatch, fail_at):
    """Tasks go to the workers in batches (BATCH_TASKS here 5); every task is applied once, in order, and an
    error raised while planning comes after every task before it."""
    monkeypatch.setattr(scan_engine, "BATCH_TASKS", 5)
    plan, cache = prepare_scan(FIXTURES["s2_bf16_w2_2groups"].ckpt)
    tasks = list(scan_engine._tasks(plan, cache, 7, set()))
    assert len(tasks) > 40

    def planned():
        for i, t in enumerate(tasks):
            if i == fail_at:
                raise _Boom
            yield t

    applied = []
    if fail_at is None:
        scan_engine.run_processes(planned(), lambda t, u: applied.append(t), 3)
    else:
        with pytest.raises(_Boom):
            scan_engine.run_processes(planned(), lambda t, u: applied.append(t), 3)
    assert applied == tasks[:fail_at]


def test_the_mode_rule(monkeypatch):
    """Processes from PROCESS_MIN_WORKERS workers and PROCESS_MIN_NBYTES planned; the environment or the caller
    can force either; ``workers=0`` is this thread only."""
    monkeypatch.delenv(scan_engine.PROCESSES_ENV, raising=False)
    plan, _ = prepare_scan(FIXTURES["s2_bf16_w2_2groups"].ckpt)
    small = dataclasses.replace(plan, entries=plan.entries[:1], raw=())
    monkeypatch.setattr(scan_engine, "PROCESS_MIN_NBYTES", scan_engine.plan_nbytes(plan))
    assert scan_engine.plan_nbytes(small) < scan_engine.plan_nbytes(plan)
    assert not scan_engine.use_processes(small, 8)
    assert not scan_engine.use_processes(plan, scan_engine.PROCESS_MIN_WORKERS - 1)
    assert scan_engine.use_processes(plan, scan_engine.PROCESS_MIN_WORKERS)
    assert scan_engine.use_processes(small, 2, True) and not scan_engine.use_processes(plan, 8, False)
    assert not scan_engine.use_processes(plan, 0, True)
    monkeypatch.setenv(scan_engine.PROCESSES_ENV, "1")
    assert scan_engine.use_processes(small, 2)
    monkeypatch.setenv(scan_engine.PROCESSES_ENV, "0")
    assert not scan_engine.use_processes(plan, 8)


def test_a_killed_worker_is_one_clear_error(monkeypatch):
    """A worker process killed by the system (the out-of-memory killer sends SIGKILL) ends the run with
    WorkerLostError (exit 70, one line saying how to rerun), not the pool's BrokenProcessPool."""
    import os
    import signal

    from dsckpt.errors import EXIT_INTERNAL, WorkerLostError

    monkeypatch.setattr(scan_engine, "_start_method", lambda: "fork")  # the child inherits the patch below
    monkeypatch.setattr(scan_engine, "_run_task", lambda *a: os.kill(os.getpid(), signal.SIGKILL))
    plan, cache = prepare_scan(FIXTURES["s2_bf16_w2_2groups"].ckpt)
    with pytest.raises(WorkerLostError, match=r"worker process ended without a result .*DSCKPT_SCAN_PROCESSES=0") as e:
        scan_engine.run_processes(scan_engine._tasks(plan, cache, 7, set()), lambda t, u: None, 2)
    assert e.value.exit_code == EXIT_INTERNAL


def test_a_work_batch_is_unpickled_under_its_allow_list():
    """Worker processes unpickle their task batches through dsckpt.safe_load (the one place dsckpt unpickles): the
    task classes load, any other global is refused before it is called."""
    import os
    import pickle

    from dsckpt.errors import UnsafeCheckpointError
    from dsckpt.safe_load import load_work_batch
    from dsckpt.scan_plan import StoredKind

    assert load_work_batch(pickle.dumps([StoredKind.PARAM]), lambda pid: pid) == [StoredKind.PARAM]
    with pytest.raises(UnsafeCheckpointError, match="only dsckpt.s own classes"):
        load_work_batch(pickle.dumps(os.system), lambda pid: pid)


def test_a_work_batch_may_not_reach_past_dsckpt_classes():
    """A name a dsckpt module imports (``dsckpt.scan_engine.os``) or a dotted path through it is no dsckpt class."""
    from dsckpt.errors import UnsafeCheckpointError
    from dsckpt.safe_load import load_work_batch

    for module, name in (("dsckpt.scan_engine", "os"), ("dsckpt.scan_engine", "os.system")):
        # protocol 4: two short strings and a STACK_GLOBAL of them
        data = (b"\x80\x04\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)])
                + name.encode() + b"\x93.")
        with pytest.raises(UnsafeCheckpointError, match="only dsckpt's own classes"):
            load_work_batch(data, lambda pid: pid)
