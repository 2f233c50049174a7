"""Checks at save time (issue 39 item 3): the skip-ahead scheduler, the background scanner process, ``dsckpt watch``.

The scheduler is pure and tested alone; the scanner is tested with a fake worker (a few lines of Python that log
what they were asked and wait for a gate file, so "one at a time" and "only the newest next" are observed, not
timed) and with the real worker on real DeepSpeed 0.19.8 checkpoints copied into a run folder in stages, as a
training job writes them. ``dsckpt watch`` runs as a subprocess while the test grows the run under it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import FIXTURES

from dsckpt.scan_record import load_valid_record, record_path
from dsckpt.watch import BackgroundScanner, Outcome, Saved, SkipAhead, Status, watch_run

REPO = Path(__file__).resolve().parent.parent
CLEAN = FIXTURES / "ds0189_s2_fp16_w1" / "ckpt" / "global_step3"  # ZeRO-2 fp16, 1 rank, clean
BN_INF = FIXTURES / "s2_fp16_w1_bnoverflow" / "ckpt" / "global_step3"  # bn.running_var +inf at [1, 4]
MASTER_INF = FIXTURES / "s2_fp16_w1_masterinf" / "ckpt" / "global_step3"
TWO_RANKS = FIXTURES / "s2_fp16_w2_cpuforced" / "ckpt" / "global_step3"  # 2 optimizer files, BN inf
BN_LINE = ("nonfinite bn.running_var: buffer, float16, 2 +inf of 7 values; in mp_rank_00_model_states.pt "
           "['module']['bn.running_var']; first indices [1, 4]")
# a real run (tests/fixtures/runs/, DeepSpeed 0.19.8, ZeRO-2 bf16, 2 ranks): the batch of step 4 held an inf, the BN
# statistics of global_step4 on are non-finite; as a DeepSpeed save dir and as a Trainer output_dir
RUN_DS = FIXTURES / "runs" / "run_s2_bf16_w2_bnnan" / "run"
RUN_HF = FIXTURES / "runs" / "run_hf_s2_bf16_w2_bnnan" / "run"
NAN_LINES = ["nonfinite bn.running_mean: buffer, float32, 1 +inf of 7 values; in mp_rank_00_model_states.pt "
             "['module']['bn.running_mean']; first indices [0]",
             "nonfinite bn.running_var: buffer, float32, 1 NaN of 7 values; in mp_rank_00_model_states.pt "
             "['module']['bn.running_var']; first indices [0]"]


def _s(name: str, step: int | None = None) -> Saved:
    return Saved(Path(name), step)


# ---------------------------------------------------------------------------------------------------------------
# SkipAhead (pure)


def test_one_at_a_time_and_only_the_newest_waits():
    plan = SkipAhead()
    assert plan.offer(_s("a", 1)) == []
    assert plan.start() == _s("a", 1)
    assert plan.start() is None  # one runs: nothing else starts
    assert plan.offer(_s("b", 2)) == []
    assert plan.offer(_s("c", 3)) == [_s("b", 2)]  # b never scanned: c is newer
    assert plan.offer(_s("d", 4)) == [_s("c", 3)]
    assert plan.pending == _s("d", 4)
    assert plan.finish() == _s("a", 1)
    assert plan.start() == _s("d", 4)
    assert plan.finish() == _s("d", 4)
    assert plan.idle


def test_an_older_checkpoint_offered_late_is_skipped_and_a_repeat_ignored():
    plan = SkipAhead()
    plan.offer(_s("b", 20))
    plan.start()
    assert plan.offer(_s("a", 10)) == [_s("a", 10)]  # older than the one already started
    assert plan.offer(_s("c", 30)) == []
    assert plan.offer(_s("b2", 25)) == [_s("b2", 25)]  # older than the one waiting
    assert plan.offer(_s("c", 30)) == []  # offered before: ignored, still waiting once
    assert plan.pending == _s("c", 30)


def test_without_steps_later_offers_are_newer():
    plan = SkipAhead()
    plan.offer(_s("x"))
    plan.start()
    assert plan.offer(_s("y")) == []
    assert plan.offer(_s("z")) == [_s("y")]
    plan.finish()
    assert plan.start() == _s("z")


def test_every_offer_is_started_or_skipped_exactly_once():
    import random

    rng = random.Random(7)
    for _ in range(200):
        plan, started, skipped = SkipAhead(), [], []
        names = [_s(f"c{i}", rng.choice([None, rng.randrange(50)])) for i in range(rng.randrange(1, 12))]
        for s in names:
            skipped += plan.offer(s)
            if rng.random() < 0.5 and plan.running is not None:
                plan.finish()
            if (t := plan.start()) is not None:
                started.append(t)
        while not plan.idle:
            if plan.running is not None:
                plan.finish()
            if (t := plan.start()) is not None:
                started.append(t)
        assert sorted(map(str, started + skipped)) == sorted(map(str, dict.fromkeys(names)))
        assert not set(started) & set(skipped)


# ---------------------------------------------------------------------------------------------------------------
# BackgroundScanner with a fake worker

FAKE_WORKER = textwrap.dedent("""
    import json, pathlib, sys, time
    log = pathlib.Path(sys.argv[1])
    for line in sys.stdin:
        p = pathlib.Path(json.loads(line)["path"])
        with log.open("a") as f:
            f.write(f"start {p.name}\\n")
        if p.name == "crash":
            sys.exit(9)
        while not (log.parent / f"go.{p.name}").exists():
            time.sleep(0.01)
        with log.open("a") as f:
            f.write(f"end {p.name}\\n")
        bad = p.name.startswith("bad")
        sys.stdout.write(json.dumps({"status": "findings" if bad else "clean",
                                     "findings": ["nonfinite: x"] if bad else []}) + "\\n")
        sys.stdout.flush()
""")


def _fake_scanner(tmp_path: Path, **kw) -> tuple[BackgroundScanner, Path]:
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    log = tmp_path / "log"
    return BackgroundScanner(is_complete=lambda p: True, poll_s=0.01, command=[sys.executable, str(script), str(log)],
                             env=dict(os.environ), **kw), log


def _wait_for(cond, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def _log(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_a_slow_scan_is_skipped_ahead_not_queued(tmp_path):
    scanner, log = _fake_scanner(tmp_path)
    with scanner:
        scanner.offer(tmp_path / "a", 1)
        _wait_for(lambda: _log(log) == ["start a"])
        for i, name in enumerate("bcd", start=2):  # three saves complete while a is scanned
            scanner.offer(tmp_path / name, i)
        assert _log(log) == ["start a"]  # a still runs alone
        (tmp_path / "go.d").touch()
        (tmp_path / "go.a").touch()
        assert scanner.wait_idle(30)
        got = scanner.outcomes()
    assert _log(log) == ["start a", "end a", "start d", "end d"]
    assert [(o.path.name, o.status) for o in got] == [
        ("b", Status.SKIPPED), ("c", Status.SKIPPED), ("a", Status.CLEAN), ("d", Status.CLEAN)]
    assert got[0].message.startswith("the newer c was complete before its turn")


def test_offer_never_waits_for_the_scan(tmp_path):
    scanner, log = _fake_scanner(tmp_path)
    with scanner:
        scanner.offer(tmp_path / "a", 1)
        _wait_for(lambda: _log(log) == ["start a"])
        got = []
        for i in range(2, 200):  # would hang here if offer() or outcomes() waited: a cannot end before go.a exists
            scanner.offer(tmp_path / f"x{i}", i)
            got += scanner.outcomes()
        assert _log(log) == ["start a"]  # and a is still running: nothing above waited for it (no clock involved)
        assert not scanner.idle
        (tmp_path / "go.a").touch()
        (tmp_path / "go.x199").touch()
        assert scanner.wait_idle(30)
        got += scanner.outcomes()
    assert sum(o.status is Status.SKIPPED for o in got) == 197
    assert [o.path.name for o in got if o.status is Status.CLEAN] == ["a", "x199"]


def test_a_dead_scanner_process_is_one_unreadable_line_and_the_next_is_served(tmp_path):
    seen: list[Outcome] = []
    scanner, log = _fake_scanner(tmp_path, on_outcome=seen.append)
    (tmp_path / "go.bad").touch()
    with scanner:
        scanner.offer(tmp_path / "crash", 1)
        _wait_for(lambda: len(seen) == 1)
        scanner.offer(tmp_path / "bad", 2)
        assert scanner.wait_idle(30)
    assert seen[0].status is Status.UNREADABLE
    assert seen[0].message == "the scanner process ended (exit status 9) while scanning it"
    assert (seen[1].status, seen[1].findings) == (Status.FINDINGS, ("nonfinite: x",))


def test_a_checkpoint_deleted_before_it_was_complete_is_dropped(tmp_path):
    scanner = BackgroundScanner(is_complete=lambda p: False, poll_s=0.01, command=[sys.executable, "-c", "1/0"])
    with scanner:
        scanner.offer(tmp_path / "gone", 5)
        assert scanner.wait_idle(10)
        [o] = scanner.outcomes()
    assert (o.status, o.message) == (Status.UNREADABLE, "deleted before it was complete")


# ---------------------------------------------------------------------------------------------------------------
# The real worker on real checkpoints written in stages


def _save_tag(run: Path, src: Path, tag: str, *, files: list[str] | None = None, latest: bool = True) -> Path:
    """Copy the fixture tag ``src`` into ``run/tag`` (only ``files`` when given), then write ``latest`` as
    DeepSpeed does once every rank has saved."""
    dst = run / tag
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if files is None or f.name in files:
            shutil.copy2(f, dst / f.name)
            os.utime(dst / f.name)  # written now, as a save writes them
    if latest:
        (run / "latest").write_text(tag)
    return dst


def test_an_incomplete_checkpoint_is_never_scanned(tmp_path):
    run = tmp_path / "run"
    ranks = sorted(p.name for p in TWO_RANKS.iterdir())
    assert ranks == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                     "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    tag = _save_tag(run, TWO_RANKS, "global_step3", files=ranks[:2])  # rank 1 still writing
    with BackgroundScanner(poll_s=0.02) as scanner:
        scanner.offer(tag, 3)
        time.sleep(1.0)
        assert scanner.outcomes() == []
        assert not scanner.idle  # the scanner process waits for rank 1's file
        assert not record_path(tag).exists()
        _save_tag(run, TWO_RANKS, "global_step3", files=ranks[2:])
        assert scanner.wait_idle(120)
        [o] = scanner.outcomes()
    assert (o.path, o.step, o.status, o.findings, o.reused) == (tag, 3, Status.FINDINGS, (BN_LINE,), False)
    rec = load_valid_record(tag)
    assert rec is not None and (rec["status"], rec["details"]) == ("findings", [BN_LINE])


def test_watch_run_reuses_a_valid_record_and_rescans_a_changed_checkpoint(tmp_path):
    run = tmp_path / "run"
    _save_tag(run, CLEAN, "global_step1")
    [o] = list(watch_run(run, once=True, timeout_s=120))
    assert (o.status, o.reused) == (Status.CLEAN, False)
    [o] = list(watch_run(run, once=True, timeout_s=120))
    assert (o.status, o.reused) == (Status.CLEAN, True)
    _save_tag(run, BN_INF, "global_step1")  # saved again under the same tag (the files rewritten in place)
    [o] = list(watch_run(run, once=True, timeout_s=120))
    assert (o.status, o.reused, o.findings) == (Status.FINDINGS, False, (BN_LINE,))


# ---------------------------------------------------------------------------------------------------------------
# dsckpt watch on a run that grows while it watches


def _watch(run: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "dsckpt", "watch", str(run), "--interval", "0.05", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _save_trainer_checkpoint(run: Path, src: Path, *, trainer_state: bool = True) -> Path:
    """Copy the Trainer checkpoint ``src`` into ``run`` as the Trainer writes one: DeepSpeed's files first,
    ``trainer_state.json`` last."""
    dst = run / src.name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("trainer_state.json"))
    if trainer_state:
        shutil.copy2(src / "trainer_state.json", dst / "trainer_state.json")
    return dst


@pytest.mark.parametrize("layout", ["deepspeed", "trainer"])
def test_watch_exits_on_the_first_checkpoint_with_findings(tmp_path, layout):
    run = tmp_path / "run"
    run.mkdir()
    proc = _watch(run, "--exit-on-finding", "--timeout", "120")
    try:
        if layout == "deepspeed":
            step3 = _save_tag(run, RUN_DS / "global_step3", "global_step3")
            _wait_for(lambda: record_path(step3).exists(), 120)
            step4 = _save_tag(run, RUN_DS / "global_step4", "global_step4", latest=False)  # 'latest' not yet
            time.sleep(0.5)
            assert not record_path(step4).exists() and proc.poll() is None
            (run / "latest").write_text("global_step4")
        else:
            step3 = _save_trainer_checkpoint(run, RUN_HF / "checkpoint-3")
            _wait_for(lambda: record_path(step3).exists(), 120)
            step4 = _save_trainer_checkpoint(run, RUN_HF / "checkpoint-4", trainer_state=False)
            time.sleep(0.5)
            assert not record_path(step4).exists() and proc.poll() is None
            shutil.copy2(RUN_HF / "checkpoint-4" / "trainer_state.json", step4 / "trainer_state.json")
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert out.splitlines() == [f"{step3} (step 3): clean", f"{step4} (step 4): 2 finding(s)",
                                *(f"  {ln}" for ln in NAN_LINES)]
    assert err.splitlines()[-1] == f"dsckpt: findings in {step4}; stopped watching (--exit-on-finding)"
    # the records are scan --all's entries: it reuses them
    assert (load_valid_record(step3)["status"], load_valid_record(step4)["findings"]) == ("clean", 2)
    from dsckpt.scan_run import scan_run

    report = scan_run(run)
    assert [(e.step, e.status.value, e.reused_record) for e in report.checkpoints] == [
        (3, "clean", True), (4, "findings", True)]


def test_watch_goes_on_after_findings_and_ends_at_its_timeout(tmp_path):
    run = tmp_path / "run"
    _save_tag(run, BN_INF, "global_step2")
    proc = _watch(run, "--timeout", "60", "--json")
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        _wait_for(lambda: len(out) == 1, 60)
        _save_tag(run, MASTER_INF, "global_step3")
        _wait_for(lambda: len(out) == 2, 60)
        proc.terminate()  # as a job's end would
        proc.wait(60)
        reader.join(10)
    finally:
        proc.kill()
    lines = [json.loads(ln) for ln in out]
    assert [(d["path"], d["status"], len(d["findings"])) for d in lines] == [
        (str(run / "global_step2"), "findings", 1), (str(run / "global_step3"), "findings", 2)]
    assert proc.returncode == 143


def test_watch_once_on_an_empty_run_exits_0(tmp_path):
    from click.testing import CliRunner

    from dsckpt.cli import main

    r = CliRunner().invoke(main, ["watch", str(tmp_path), "--once"])
    assert (r.exit_code, r.stdout) == (0, "")


@pytest.mark.parametrize("bad", ["--interval=0", "--timeout=-1"])
def test_watch_usage_errors(tmp_path, bad):
    from click.testing import CliRunner

    from dsckpt.cli import main

    r = CliRunner().invoke(main, ["watch", str(tmp_path), bad])
    assert r.exit_code == 2


# ---------------------------------------------------------------------------------------------------------------
# The callbacks, driven by hand (the live tier runs them in real training: tests/test_watch_live.py)


def test_importing_dsckpt_and_the_callbacks_module_imports_no_framework():
    code = ("import sys, dsckpt, dsckpt.cli, dsckpt.callbacks; "
            "print(sorted(m for m in ('torch', 'transformers', 'lightning', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(("name", "package"), [("TrainerScanCallback", "transformers"),
                                               ("LightningScanCallback", "lightning")])
def test_a_callback_without_its_framework_is_a_clear_import_error(name, package):
    code = (f"import sys; sys.modules[{package!r}] = None\n"
            f"try:\n    from dsckpt.callbacks import {name}\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
    assert out.strip() == f"dsckpt.callbacks.{name} needs {package} (pip install {package})"


def test_trainer_callback_offers_saves_logs_findings_and_stops(tmp_path):
    from transformers import TrainerControl, TrainerState

    from dsckpt.callbacks import TrainerScanCallback

    scanner, log = _fake_scanner(tmp_path)
    cb = TrainerScanCallback(on_finding="stop", scanner=scanner)
    args = type("Args", (), {"output_dir": str(tmp_path), "device": "cpu"})()
    state, control = TrainerState(is_world_process_zero=True), TrainerControl()
    (tmp_path / "go.checkpoint-3").touch()
    state.global_step = 3
    cb.on_save(args, state, control)
    assert scanner.wait_idle(30)
    state.global_step = 4
    cb.on_step_end(args, state, control)
    assert not control.should_training_stop
    state.global_step = 6
    cb.session.offer(tmp_path / "bad", 6)  # the fake worker finds something in a checkpoint named bad*
    (tmp_path / "go.bad").touch()
    assert scanner.wait_idle(30)
    state.global_step = 7
    cb.on_step_end(args, state, control)
    assert control.should_training_stop
    cb.on_train_end(args, state, control)
    assert state.log_history == [
        {"dsckpt/findings": 0.0, "dsckpt/checkpoint": str(tmp_path / "checkpoint-3"), "dsckpt/checkpoint_step": 3,
         "step": 4},
        {"dsckpt/findings": 1.0, "dsckpt/checkpoint": str(tmp_path / "bad"), "dsckpt/checkpoint_step": 6, "step": 7}]
    assert _log(log) == ["start checkpoint-3", "end checkpoint-3", "start bad", "end bad"]


def test_trainer_callback_on_another_rank_scans_nothing(tmp_path):
    from transformers import TrainerControl, TrainerState

    from dsckpt.callbacks import TrainerScanCallback

    cb = TrainerScanCallback(on_finding="stop")
    args = type("Args", (), {"output_dir": str(tmp_path), "device": "cpu"})()
    state, control = TrainerState(is_world_process_zero=False, global_step=3), TrainerControl()
    cb.on_save(args, state, control)
    cb.on_step_end(args, state, control)
    cb.on_train_end(args, state, control)
    assert cb.session._scanner is None and not cb.session.offered and not control.should_training_stop


def test_on_finding_is_checked():
    from dsckpt.callbacks import _ScanSession

    with pytest.raises(ValueError, match="on_finding must be one of"):
        _ScanSession(on_finding="halt", nonfinite_only=False, wait_at_end_s=None, scanner=None)


# ---------------------------------------------------------------------------------------------------------------
# live: a real Trainer + DeepSpeed run on 2 CPU ranks with the callback (tests/hf_watch_check.py)


@pytest.mark.live
@pytest.mark.deepspeed
def test_trainer_run_flags_the_right_checkpoint_and_stops(tmp_path):
    from ds_launch import DEEPSPEED, launch_verdict, ranks_done, run_in_session

    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    out, report = tmp_path / "run", tmp_path / "report.json"
    proc = run_in_session([str(DEEPSPEED), "--num_gpus", "2", "--master_port", "29851",
                           str(REPO / "tests" / "hf_watch_check.py"), "--out", str(out), "--report", str(report),
                           "--on-finding", "stop", "--max-steps", "60"], cwd=tmp_path, timeout=540)
    complete = report.is_file() and not ranks_done(report, 2)
    verdict, note = launch_verdict(proc.returncode, complete=complete, failed=False)
    assert verdict == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + note
    rep = json.loads(report.read_text())
    # checkpoint-3 was scanned clean before the inf went in (after step 4); checkpoint-6 is the first with it
    first = load_valid_record(out / "checkpoint-3")
    assert first is not None and (first["status"], first["findings"]) == ("clean", 0)
    flagged = load_valid_record(out / "checkpoint-6")
    assert flagged is not None and (flagged["status"], flagged["findings"]) == ("findings", 1)
    # DeepSpeed's bf16 engine keeps float buffers in fp32
    assert flagged["details"] == ["nonfinite health: buffer, float32, 1 +inf of 4 values; in "
                                  "mp_rank_00_model_states.pt ['module']['health']; first indices [1]"]
    log = rep["dsckpt_log"]
    assert [(e["dsckpt/checkpoint"], e["dsckpt/findings"]) for e in log[:2]] == [
        (str(out / "checkpoint-3"), 0.0), (str(out / "checkpoint-6"), 1.0)]
    # stopped at the step boundary after the finding was known, long before max_steps, with no save after it
    assert log[1]["step"] <= rep["final_global_step"] < rep["max_steps"]
    assert rep["final_global_step"] == log[1]["step"]
    # only global rank 0 offered checkpoints to a scanner
    assert rep["offered"][1] == [] and str(out / "checkpoint-6") in rep["offered"][0]


def test_the_worker_answers_a_checkpoint_never_completed_as_unreadable(tmp_path):
    from dsckpt.scan_worker import handle

    tag = _save_tag(tmp_path / "run", TWO_RANKS, "global_step3", files=["mp_rank_00_model_states.pt",
                                                                        "zero_pp_rank_0_mp_rank_00_optim_states.pt"])
    got = handle({"path": str(tag), "complete_timeout_s": 0.3})
    assert got["status"] == "unreadable"
    assert got["message"].startswith("not completely written after 0.3 s: ")
    assert "rank 1" in got["message"]
    assert not record_path(tag).exists()


@pytest.mark.live
@pytest.mark.deepspeed
def test_lightning_run_flags_the_right_checkpoint_and_stops(tmp_path):
    from ds_launch import run_in_session

    out, report = tmp_path / "out", tmp_path / "report.json"
    proc = run_in_session([sys.executable, str(REPO / "tests" / "lightning_watch_check.py"), str(out), str(report)],
                          cwd=tmp_path, timeout=540, env={"MASTER_PORT": "29853"})
    reports = [Path(f"{report}.rank{r}.json") for r in range(2)]
    assert all(r.is_file() for r in reports), proc.stdout[-3000:] + proc.stderr[-3000:]
    rank0, rank1 = (json.loads(r.read_text()) for r in reports)
    ckpts = out / "ckpts"
    first = load_valid_record(ckpts / "epoch=0-step=3.ckpt")
    assert first is not None and (first["status"], first["findings"]) == ("clean", 0)
    flagged = load_valid_record(ckpts / "epoch=1-step=6.ckpt")
    assert flagged is not None and (flagged["status"], flagged["findings"]) == ("findings", 1)
    assert flagged["details"] == ["nonfinite bn.running_var: buffer, float32, 1 +inf of 8 values; in "
                                  "mp_rank_00_model_states.pt ['module']['bn.running_var']; first indices [1]"]
    # saves come every ~0.1 s here, faster than scans: later ones may be skipped ahead, but never these two
    seen = [(o["path"], o["step"], o["status"]) for o in rank0["outcomes"] if o["status"] != "skipped"]
    assert seen[:2] == [(str(ckpts / "epoch=0-step=3.ckpt"), 3, "clean"),
                        (str(ckpts / "epoch=1-step=6.ckpt"), 6, "findings")]
    # stopped soon after the finding was known, every rank at the same step; only rank 0 scanned
    assert 6 < rank0["global_step"] == rank1["global_step"] < rank0["max_steps"]
    assert rank1["offered"] == [] and rank1["outcomes"] == []
    # the findings went to the run's logger (CSVLogger) as metrics
    import csv

    rows = list(csv.DictReader((out / "logs" / "version_0" / "metrics.csv").open()))
    logged = [(r["dsckpt/checkpoint_step"], r["dsckpt/findings"]) for r in rows if r.get("dsckpt/findings")]
    assert logged[:2] == [("3.0", "0.0"), ("6.0", "1.0")]


def test_a_finished_save_without_deepspeed_is_answered_at_once(tmp_path):
    """The callbacks check DeepSpeed saves; a Trainer save without DeepSpeed is named as such, not waited for."""
    from dsckpt.scan_worker import handle

    ckpt = tmp_path / "checkpoint-3"  # model.safetensors and friends, no DeepSpeed files
    ckpt.mkdir()
    shutil.copy2(FIXTURES / "s2_fp16_w1_bnoverflow" / "source_fp32.safetensors", ckpt / "model.safetensors")
    t0 = time.monotonic()
    got = handle({"path": str(ckpt), "complete_timeout_s": 60, "finished_save": True})
    assert time.monotonic() - t0 < 30
    assert got["status"] == "unreadable" and "is not a DeepSpeed checkpoint" in got["message"]
    assert not record_path(ckpt).exists() if ckpt.is_file() else not (ckpt / "dsckpt-scan.json").exists()


RUN_LIGHTNING = FIXTURES / "runs" / "run_lightning_s2_fp32_w2_bnnan" / "ckpts"
LAYOUTS = [("deepspeed", RUN_DS, "global_step3", "global_step4"),
           ("trainer", RUN_HF, "checkpoint-3", "checkpoint-4"),
           ("lightning", RUN_LIGHTNING, "epoch=0-step=3.ckpt", "epoch=1-step=4.ckpt")]


@pytest.mark.parametrize(("layout", "src", "clean", "bad"), LAYOUTS, ids=[lt[0] for lt in LAYOUTS])
def test_watch_run_on_each_run_layout(tmp_path, layout, src, clean, bad):
    """The real run (BN statistics non-finite from step 4) saved as each framework saves it, one save at a time."""
    run = tmp_path / "run"
    run.mkdir()

    def save(name: str) -> None:
        shutil.copytree(src / name, run / name)
        if layout == "deepspeed":
            (run / "latest").write_text(name)

    save(clean)
    [o] = list(watch_run(run, once=True, timeout_s=120))
    assert (o.path, o.step, o.status) == (run / clean, 3, Status.CLEAN)
    save(bad)
    got = list(watch_run(run, once=True, timeout_s=120))
    assert [(o.path.name, o.step, o.status, o.n_findings) for o in got] == [
        (clean, 3, Status.SKIPPED, 0), (bad, 4, Status.FINDINGS, 2)]
    assert [ln.split(":")[0] for ln in got[1].findings] == ["nonfinite bn.running_mean", "nonfinite bn.running_var"]
    assert load_valid_record(run / clean)["status"] == "clean"
    assert load_valid_record(run / bad)["status"] == "findings"


def test_a_garbled_answer_is_one_unreadable_line_and_the_scanner_goes_on(tmp_path):
    script = tmp_path / "garble.py"
    script.write_text("import sys\nfor line in sys.stdin:\n"
                      "    print('not json' if 'a' in line.rsplit('/', 1)[-1] else '{\"status\": \"clean\"}', flush=True)\n")
    seen: list[Outcome] = []
    with BackgroundScanner(is_complete=lambda p: True, poll_s=0.01, on_outcome=seen.append,
                           command=[sys.executable, str(script)], env=dict(os.environ)) as scanner:
        scanner.offer(tmp_path / "a", 1)
        assert scanner.wait_idle(30)
        scanner.offer(tmp_path / "b", 2)
        assert scanner.wait_idle(30)
    assert [(o.path.name, o.status, o.message) for o in seen] == [
        ("a", Status.UNREADABLE, "the scanner process answered 'not json'"), ("b", Status.CLEAN, None)]


def test_the_scanner_process_runs_at_lower_priority(tmp_path):
    from dsckpt.watch import WORKER_NICE

    run = tmp_path / "run"
    _save_tag(run, CLEAN, "global_step1")
    with BackgroundScanner(poll_s=0.02) as scanner:
        scanner.offer(run / "global_step1", 1)
        assert scanner.wait_idle(120)
        [o] = scanner.outcomes()
        worker_nice = os.getpriority(os.PRIO_PROCESS, scanner._proc.pid)  # still alive, waiting for the next one
    assert o.status is Status.CLEAN
    assert worker_nice == min(19, os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICE)
