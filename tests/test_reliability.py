"""Preemption, full disks, leftovers of killed runs, concurrent runs, inputs left byte-identical.

Signals and SIGKILL are tested on the real CLI in a subprocess whose ``os.fsync`` is slowed down by a
wrapper (no test hook in the product): when the first fsync starts, the temporary output exists.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from commands import COMMANDS, WRITING, Command, by_name
from conftest import FIXTURES, tree_digest

from dsckpt import atomic
from dsckpt.cli import main
from dsckpt.errors import NotEnoughSpaceError
from dsckpt.interrupts import Terminated, signals_as_exceptions, uninterrupted

FIXTURE = "s2_fp16_w1_bnoverflow"  # fp16 ZeRO-2 with an inf BN buffer: every writing command has work
ROOT = Path(__file__).resolve().parents[1]

_SLOW_FSYNC = """
import os, sys, time
ready, delay = sys.argv[1], float(sys.argv[2])
real = os.fsync
def slow(fd):
    if not os.path.exists(ready):
        open(ready, "w").close()
        time.sleep(delay)
    real(fd)
os.fsync = slow
from dsckpt.cli import main
main(sys.argv[3:], prog_name="dsckpt")
"""


def _prepare(tmp_path: Path, cmd: Command, fixture: str = FIXTURE) -> tuple[Path, Path, list[str]]:
    fx = tmp_path / "fx"
    shutil.copytree(FIXTURES / fixture, fx)
    out = tmp_path / "out"
    out.mkdir()
    ckpt = fx / "ckpt"
    if "deepspeed" not in cmd.accepts:
        res = CliRunner().invoke(main, ["to-fp32", "-q", str(ckpt), str(fx / "damaged.safetensors")])
        assert res.exit_code == 0, res.output
        ckpt = fx / "damaged.safetensors"
    return fx, out, cmd.argv(fx, ckpt, out)


def _start(argv: list[str], ready: Path, delay: float = 60) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", _SLOW_FSYNC, str(ready), str(delay), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_ready(proc: subprocess.Popen[str], ready: Path, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before writing: {proc.stderr.read()}")  # type: ignore[union-attr]
        assert time.monotonic() < end, "the command never started writing"
        time.sleep(0.05)


def _beside(out: Path) -> list[str]:
    """What is in the output's folder: only finished outputs may be there."""
    return sorted(p.name for p in out.iterdir())


def _one_error_line(stderr: str, *phrases: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("dsckpt: error: "), stderr
    for p in phrases:
        assert p in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("cmd", WRITING, ids=[c.name for c in WRITING])
def test_sigterm_and_sighup_remove_the_temp_and_exit_128_plus_signal(tmp_path, cmd, sig):
    fx, out, argv = _prepare(tmp_path, cmd)
    before = tree_digest(fx)
    ready = tmp_path / "ready"
    proc = _start(argv, ready)
    _wait_ready(proc, ready)
    assert any(n.endswith(".tmp") for n in _beside(out)), _beside(out)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, stderr
    _one_error_line(stderr, f"terminated by {sig.name}", "no output was left behind")
    assert _beside(out) == []  # no temp, no lock file, no OUT
    assert tree_digest(fx) == before


@pytest.mark.parametrize("kind", ["atomic_dir", "atomic_dir-leased", "scratch_dir"])
def test_a_sigterm_during_cleanup_waits_for_the_whole_temp_to_be_removed(tmp_path, monkeypatch, kind):
    """Under torchrun, a rank that lost a peer is removing its temp output when torchrun's SIGTERM lands (CI saw
    half a temp folder left): the signal is held until the removal is done, then raised."""
    real_rmtree = shutil.rmtree

    def rmtree_signalled_first(path, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler right here, before the real removal
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(atomic.shutil, "rmtree", rmtree_signalled_first)
    out = tmp_path / "out"
    with pytest.raises(Terminated) as caught, signals_as_exceptions():
        if kind == "scratch_dir":
            with atomic.scratch_dir(out) as tmp:
                (tmp / "a").mkdir()
                (tmp / "a" / "f").write_bytes(b"x" * 100)
        else:
            with atomic.atomic_dir(out, leased=kind.endswith("leased")) as tmp:
                for i in range(20):
                    (tmp / f"f{i}").write_bytes(b"x" * 100)
                raise RuntimeError("a peer was lost")  # the unwinding the SIGTERM lands in
    assert caught.value.exit_code == 128 + signal.SIGTERM
    assert os.listdir(tmp_path) == []


def test_uninterrupted_holds_one_signal_to_its_end_and_drops_it_under_an_exception(monkeypatch):
    from dsckpt import interrupts

    monkeypatch.setattr(interrupts._State, "received", None)
    done = []
    with pytest.raises(Terminated), signals_as_exceptions():
        with uninterrupted():
            with uninterrupted():
                os.kill(os.getpid(), signal.SIGHUP)
                done.append("inner")
            done.append("outer")  # the held signal waits for the outermost block
    assert done == ["inner", "outer"]
    assert interrupts.received() == signal.SIGHUP
    with pytest.raises(ValueError), signals_as_exceptions():  # an exception on its way up is the one that propagates
        with uninterrupted():
            os.kill(os.getpid(), signal.SIGTERM)
            raise ValueError("first")
    with signals_as_exceptions(), uninterrupted():  # and the dropped signal is not raised later
        pass


@pytest.mark.parametrize("cmd", [by_name("to-fp32"), by_name("reshard"), by_name("repair")],
                         ids=["to-fp32", "reshard", "repair"])
def test_sigkill_leftovers_are_removed_by_the_next_run_which_says_so(tmp_path, cmd):
    _fx, out, argv = _prepare(tmp_path, cmd)
    ready = tmp_path / "ready"
    proc = _start(argv, ready)
    _wait_ready(proc, ready)
    proc.kill()
    proc.communicate(timeout=60)
    assert cmd.output is not None
    target = cmd.output(out)
    left = _beside(out)
    assert any(n.startswith(f".{target.name}.{proc.pid}@") and n.endswith(".tmp") for n in left), left
    assert not target.exists()  # never half-written
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 0, res.output
    assert f"left by a killed dsckpt run (pid {proc.pid})" in res.stderr
    assert "dsckpt: note: removed" in res.stderr
    assert _beside(out) == [target.name]


def test_leftovers_of_another_host_or_a_live_process_are_left_alone(tmp_path, caplog):
    target = tmp_path / "model.safetensors"
    other_host = tmp_path / ".model.safetensors.123@some-other-host.example.abcd1234.tmp"
    live = tmp_path / f".model.safetensors.{os.getppid()}@{atomic._HOST}.zz99yy88.tmp"
    dead = tmp_path / f".model.safetensors.{_dead_pid()}@{atomic._HOST}.q1w2e3r4.tmp"
    unrelated = tmp_path / ".model.safetensors.backup"
    for p in (other_host, live, dead, unrelated):
        p.write_bytes(b"x")
    with caplog.at_level("WARNING", logger="dsckpt"), atomic.claim_output(target):
        pass
    assert other_host.exists() and live.exists() and unrelated.exists()
    assert not dead.exists()
    text = caplog.text
    assert "some-other-host" in text and f"rm -rf '{other_host}'" in text
    assert "still running" in text


def test_a_killed_force_run_that_had_moved_the_old_output_aside_gets_it_back(tmp_path):
    target = tmp_path / "resharded"
    aside = tmp_path / f".resharded.{_dead_pid()}@{atomic._HOST}.old"
    aside.mkdir()
    (aside / "latest").write_text("global_step3")
    with atomic.claim_output(target, force=True):
        pass
    assert (target / "latest").read_text() == "global_step3"
    assert not aside.exists()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_run_is_left_alone_and_a_second_run_refuses(tmp_path):
    cmd = by_name("to-fp32")
    _fx, out, argv = _prepare(tmp_path, cmd)
    ready = tmp_path / "ready"
    proc = _start(argv, ready)
    try:
        _wait_ready(proc, ready)
        temps = _beside(out)
        res = CliRunner().invoke(main, argv)
        assert res.exit_code == 2, res.output
        _one_error_line(res.stderr, "another dsckpt is writing", "model.safetensors", f"pid {proc.pid}")
        assert _beside(out) == temps  # the live run's temp is untouched
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    assert proc.returncode == 143


def test_two_concurrent_runs_exactly_one_succeeds_and_out_is_whole(tmp_path):
    cmd = by_name("reshard")
    _fx, out, argv = _prepare(tmp_path, cmd)
    ready_a, ready_b = tmp_path / "ready_a", tmp_path / "ready_b"
    a = _start(argv, ready_a, delay=3)
    _wait_ready(a, ready_a)
    b = _start(argv, ready_b, delay=0)
    _, err_b = b.communicate(timeout=120)
    _, err_a = a.communicate(timeout=120)
    assert a.returncode == 0, err_a
    assert b.returncode == 2, err_b
    _one_error_line(err_b, "another dsckpt is writing")
    assert _beside(out) == ["resharded"]
    res = CliRunner().invoke(main, ["info", str(out / "resharded")])
    assert res.exit_code == 0 and "data 3" in res.stdout, res.output


def test_two_runs_started_together_one_succeeds_the_other_refuses(tmp_path):
    cmd = by_name("to-fp32")
    _fx, out, argv = _prepare(tmp_path, cmd)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "dsckpt.cli", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert "another dsckpt is writing" in loser or "already exists" in loser, loser
    assert _beside(out) == ["model.safetensors"]
    from safetensors.numpy import load_file

    assert len(load_file(str(out / "model.safetensors"))) == 13


# --------------------------------------------------------------------------------------------
# Disk space and write errors


@pytest.mark.parametrize("cmd", WRITING, ids=[c.name for c in WRITING])
def test_not_enough_free_space_is_refused_before_writing(tmp_path, cmd, monkeypatch):
    _fx, out, argv = _prepare(tmp_path, cmd)
    monkeypatch.setattr(atomic, "free_bytes", lambda d: 12_345)
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 3, res.output
    _one_error_line(res.stderr, "needs", f"at '{out}'", "12.3 KB free", "nothing was written")
    assert _beside(out) == []


@pytest.mark.parametrize("code", ["ENOSPC", "EDQUOT", "EROFS", "EACCES"])
@pytest.mark.parametrize("cmd", WRITING, ids=[c.name for c in WRITING])
def test_write_errors_midway_exit_3_naming_the_path_and_leave_nothing(tmp_path, cmd, code, monkeypatch):
    fx, out, argv = _prepare(tmp_path, cmd)
    before = tree_digest(fx)
    err = getattr(errno, code)

    def failing_fsync(fd: int) -> None:
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "fsync", failing_fsync)
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 3, res.output
    assert cmd.output is not None
    _one_error_line(res.stderr, f"cannot write '{cmd.output(out)}'", f"({code})", "nothing was written")
    assert _beside(out) == []
    assert tree_digest(fx) == before


def test_enospc_inside_the_safetensors_stream_names_the_file(tmp_path, monkeypatch):
    from dsckpt.writers import safetensors as st_writer

    _fx, out, argv = _prepare(tmp_path, by_name("to-fp32"))
    calls = []

    def full_after_one(fd, data):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.write(fd, data)

    monkeypatch.setattr(st_writer, "_write_all", full_after_one)
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 3, res.output
    target = out / "model.safetensors"
    _one_error_line(res.stderr, f"cannot write '{target}'", "No space left on device (ENOSPC)")
    assert _beside(out) == []


# --------------------------------------------------------------------------------------------
# A written file is checked under its temporary name: one that fails never becomes OUT

#: single-file outputs -> (module, verifier) that checks them before the rename
SINGLE_FILE_VERIFIERS = {"to-fp32": ("dsckpt.writers.safetensors", "verify_safetensors"),
                         "to-fp32-torch": ("dsckpt.writers.torch_stream", "verify_torch_file"),
                         "to-fp32-lightning": ("dsckpt.writers.torch_stream", "verify_torch_file")}


@pytest.mark.parametrize("damage", ["truncated", "other-tensors"])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "force-over-old"])
@pytest.mark.parametrize("name", list(SINGLE_FILE_VERIFIERS))
def test_a_written_file_failing_its_check_never_becomes_out(tmp_path, name, existing, damage, monkeypatch):
    """The real verifier runs on the temporary file, damaged first (cut to 8 bytes, or checked against a plan
    without its last tensor): exit 3, one line naming OUT, no OUT (or the old one, byte for byte), no temp."""
    import importlib

    cmd = by_name(name)
    _fx, out, argv = _prepare(tmp_path, cmd)
    assert cmd.output is not None
    target = cmd.output(out)
    if existing:
        target.write_bytes(b"the previous OUT")
        argv = [*argv[:1], "--force", *argv[1:]]
    module_name, attr = SINGLE_FILE_VERIFIERS[name]
    module = importlib.import_module(module_name)
    real = getattr(module, attr)
    seen: list[Path] = []

    def damaged_then_checked(path, specs, **kw):
        seen.append(path)
        assert path != target and path.parent == target.parent and kw["target"] == target
        assert target.exists() == existing and (not existing or target.read_bytes() == b"the previous OUT")
        if damage == "truncated":
            os.truncate(path, 8)
        else:
            specs = specs[:-1]
        return real(path, specs, **kw)

    monkeypatch.setattr(module, attr, damaged_then_checked)
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 3, res.output
    assert len(seen) == 1
    what = "cannot be reopened" if damage == "truncated" else "lists other tensors than planned"
    line = _one_error_line(res.stderr, f"verification failed: '{target}'", what, "nothing was moved into place")
    assert str(seen[0]) not in line  # named by OUT, not by the temporary file that was removed
    assert _beside(out) == ([target.name] if existing else [])
    if existing:
        assert target.read_bytes() == b"the previous OUT"


@pytest.mark.parametrize("existing", [False, True], ids=["new", "force-over-old"])
def test_a_shard_failing_its_check_leaves_no_folder(tmp_path, existing, monkeypatch):
    """A folder OUT: each shard is checked inside the temporary folder; one that fails removes the folder."""
    from dsckpt.writers import safetensors as st_writer

    cmd = by_name("to-fp32-sharded")
    _fx, out, argv = _prepare(tmp_path, cmd)
    assert cmd.output is not None
    target = cmd.output(out)
    if existing:
        target.mkdir()
        (target / "old.txt").write_text("the previous OUT")
        argv = [*argv[:1], "--force", *argv[1:]]
    real = st_writer.verify_safetensors

    def damaged_then_checked(path, specs, **kw):
        assert path.parent.parent == out and path.parent != target  # inside the temporary folder
        os.truncate(path, 8)
        return real(path, specs, **kw)

    monkeypatch.setattr(st_writer, "verify_safetensors", damaged_then_checked)
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 3, res.output
    _one_error_line(res.stderr, "verification failed: '", "model-00001-of-", "cannot be reopened")
    assert _beside(out) == ([target.name] if existing else [])
    if existing:
        assert [p.name for p in target.iterdir()] == ["old.txt"]


@pytest.mark.parametrize("name", list(SINGLE_FILE_VERIFIERS))
def test_a_written_file_is_checked_before_the_rename_and_passes(tmp_path, name, monkeypatch):
    """Without damage the same check passes on the temporary file and OUT appears (the check is not a no-op
    that only the damaged runs reach)."""
    import importlib

    cmd = by_name(name)
    _fx, out, argv = _prepare(tmp_path, cmd)
    assert cmd.output is not None
    module_name, attr = SINGLE_FILE_VERIFIERS[name]
    module = importlib.import_module(module_name)
    real = getattr(module, attr)
    seen: list[Path] = []
    monkeypatch.setattr(module, attr, lambda path, specs, **kw: (seen.append(path), real(path, specs, **kw))[1])
    res = CliRunner().invoke(main, argv)
    assert res.exit_code == 0, res.output
    assert len(seen) == 1 and not seen[0].exists()  # the checked temp is what became OUT
    assert _beside(out) == [cmd.output(out).name]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders; permissions do not bite")
def test_read_only_output_folder_is_a_one_line_exit_3(tmp_path):
    _fx, out, argv = _prepare(tmp_path, by_name("to-fp32"))
    out.chmod(0o555)
    try:
        res = CliRunner().invoke(main, argv)
    finally:
        out.chmod(0o755)
    assert res.exit_code == 3, res.output
    _one_error_line(res.stderr, "cannot write", "model.safetensors")
    assert _beside(out) == []


def test_space_check_counts_the_plan_and_a_margin(monkeypatch):
    from dsckpt.checkpoint import open_checkpoint
    from dsckpt.convert import plan_to_fp32

    c = open_checkpoint(FIXTURES / FIXTURE / "ckpt")
    plan = plan_to_fp32(c.logical, "x.safetensors")
    assert plan.total_nbytes < plan.output_nbytes_bound < plan.total_nbytes + (64 << 10)
    monkeypatch.setattr(atomic, "free_bytes", lambda d: atomic.SPACE_MARGIN_NBYTES + 999)
    atomic.check_free_space(Path("."), 999)
    with pytest.raises(NotEnoughSpaceError, match="needs 1.0 MB at '.', 1.0 MB free"):
        atomic.check_free_space(Path("."), 1000)


# --------------------------------------------------------------------------------------------
# Inputs are never modified


INPUT_FIXTURES = ["s2_fp16_w1_bnoverflow", "s2_fp32_w2_legacy", "s3_fp16_w2_cpuforced", "pp2_dp2_fp32"]


@pytest.mark.parametrize("fixture", INPUT_FIXTURES)
@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.name for c in COMMANDS])
def test_every_command_leaves_every_input_byte_identical(tmp_path, cmd, fixture):
    fx, _out, argv = _prepare(tmp_path, cmd, fixture)
    before = tree_digest(fx)
    res = CliRunner().invoke(main, argv)
    # 3: a layout the command refuses; 2: a world size the pipeline fixture's 2 stages do not divide
    assert res.exit_code in (0, 1, 3) or (res.exit_code == 2 and "pipeline size" in res.output), res.output
    assert "Traceback" not in res.output
    assert tree_digest(fx) == before


@pytest.mark.parametrize("argv", [["info", "--json", "--tensors"], ["verify", "--json"], ["scan", "--json"]],
                         ids=["info", "verify", "scan"])
def test_a_closed_stdout_is_a_quiet_exit_141_not_an_error(argv):
    """`dsckpt ... | head`: the reader of stdout went away before the command wrote."""
    ckpt = FIXTURES / "s3_bf16_w3_subgroups" / "ckpt"
    r, w = os.pipe()
    os.close(r)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-m", "dsckpt.cli", *argv, str(ckpt)], stdout=w,
                          stderr=subprocess.PIPE, env=env, timeout=120)
    os.close(w)
    assert proc.returncode == 141
    assert proc.stderr == b""
