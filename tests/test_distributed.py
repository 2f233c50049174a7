"""``--distributed`` (issue 21): real ``torchrun`` launches of 2 and 3 local processes (gloo, CPU).

* the pure planner (split by bytes, byte ranges of one file) and the lease rule, without processes;
* same stdout, same exit code on every rank, same output bytes as the one-process run (scan, verify, to-fp32,
  reshard, diff, repair), over ZeRO-1/2/3,
  BF16_Optimizer, stage 0, pipeline, MoE, a universal folder and a Hugging Face Trainer folder
  (one launch runs every command through the real click ``main``: tests/dist_driver.py);
* the ``dsckpt`` console script under ``torchrun --no-python`` on 3 ranks (several ranks writing one file);
* a rank that fails names itself on every rank; a rank SIGKILLed mid-write, or rank 0 killed, or SIGTERM to the
  launcher: no OUT, non-zero, and the next run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import FIXTURES
from ds_launch import free_port

from dsckpt import atomic, distributed, errors
from dsckpt.cli import main
from dsckpt.convert import plan_file_ranges
from dsckpt.distributed import detect_env, digest, split_by_nbytes

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
DRIVER = ROOT / "tests" / "dist_driver.py"
TIMEOUT_S = 120

# fixture -> layout family it stands for
FAMILIES = {
    "s1_fp32_w2": "ZeRO-1",
    "s2_fp16_w1_masterinf": "ZeRO-2 fp16 with inf masters (findings)",
    "s3_bf16_w3_subgroups": "ZeRO-3",
    "s1_bf16_w2_bf16opt": "BF16_Optimizer",
    "s0_bf16_w2": "stage 0",
    "pp2_dp2_fp32": "pipeline",
    "moe_s2_bf16_w2_ep2": "MoE",
    "universal/s2_bf16_w2_2groups": "universal folder",
    "hf_llama_z2_bf16_w2": "Hugging Face Trainer folder",
    "autotp/autotp_z2_fp32_tp2_dp2": "tensor parallel (AutoTP), row-parallel slices",
    "autotp/megatron_z1_bf16_tp2_dp2_bf16opt": "tensor parallel (Megatron-style record), BF16_Optimizer",
    "tp_pipeline/megatron_pp2_tp2_z1_fp32": "tensor x pipeline parallel (Megatron-DeepSpeed layer files)",
}


# --------------------------------------------------------------------------------------------
# Pure parts


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_split_by_nbytes_is_balanced_complete_and_deterministic(world: int) -> None:
    sizes = [7, 100, 3, 3, 50, 50, 1, 0, 99, 12]
    split = split_by_nbytes(sizes, world)
    assert split == split_by_nbytes(list(sizes), world)
    assert sorted(i for items in split for i in items) == list(range(len(sizes)))
    assert all(list(items) == sorted(items) for items in split)
    loads = [sum(sizes[i] for i in items) for items in split]
    assert max(loads) <= sum(sizes) / world + max(sizes)


def test_split_by_nbytes_lpt_example() -> None:
    assert split_by_nbytes([5, 4, 3, 3, 3], 2) == ((0, 3), (1, 2, 4))


@pytest.mark.parametrize(("total", "world", "align"), [(10 << 20, 3, 1 << 20), (100, 3, 1 << 20), (1000, 4, 64),
                                                        (0, 2, 64), (129, 1, 64)])
def test_plan_file_ranges_cover_the_file_at_aligned_bounds(total: int, world: int, align: int) -> None:
    ranges = plan_file_ranges(total, world, align_nbytes=align)
    assert len(ranges) == world and ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(lo <= hi and (lo % align == 0 or lo == total) for lo, hi in ranges)


def test_digest_is_canonical() -> None:
    assert digest({"b": [1, 2], "a": Path("x")}) == digest({"a": Path("x"), "b": [1, 2]})
    assert digest({"a": 1}) != digest({"a": 2})


def test_detect_env() -> None:
    assert detect_env({}) is None
    env = detect_env({"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    assert env is not None and (env.rank, env.world_size, env.master_port) == (1, 3, 29500)


def test_distributed_outside_torchrun_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    res = CliRunner().invoke(main, ["scan", str(FIXTURES / "s1_fp32_w2" / "ckpt"), "--distributed"])
    assert res.exit_code == 2
    assert "torchrun --nproc-per-node 2 --no-python dsckpt" in res.output


def test_leased_leftover_of_another_host_is_removed_once_the_lease_expires(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSCKPT_LEASE_EXPIRY_S", "60")
    target = tmp_path / "out"
    dead = tmp_path / ".out.123@otherhost.cluster~lease.abc123.tmp"
    alive = tmp_path / ".out.124@otherhost.cluster~lease.def456.tmp"
    unleased = tmp_path / ".out.125@otherhost.cluster.ghi789.tmp"
    for p in (dead, alive, unleased):
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"x")
    old = time.time() - 600
    os.utime(dead, (old, old))
    os.utime(unleased, (old, old))
    removed = atomic.remove_leftovers(target)
    assert removed == [dead]
    assert alive.exists() and unleased.exists()  # a live lease; another host's pid cannot be checked


def test_same_hostname_other_pid_space_is_another_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two machines (or containers) with one hostname: a pid in a temp name is checked only where it is one of this
    process table's (same hostname *and* pid space: boot id + pid namespace). Another pid space's leased leftover goes
    by its lease, an unleased one is left alone -- even if that pid is dead here; this pid space's dead pid is removed,
    and names written before pid spaces were recorded keep the hostname rule."""
    monkeypatch.setenv("DSCKPT_LEASE_EXPIRY_S", "60")
    target = tmp_path / "out"
    dead_pid = 2 ** 22 + 17  # above pid_max's default: no such process here
    other = "0123abcd" if atomic._PID_SPACE != "0123abcd" else "fedc9876"
    h = atomic._HOST
    live_lease = tmp_path / f".out.{dead_pid}@{h}+{other}~lease.aaaa.tmp"
    dead_lease = tmp_path / f".out.{dead_pid + 1}@{h}+{other}~lease.bbbb.tmp"
    unleased = tmp_path / f".out.{dead_pid + 2}@{h}+{other}.cccc.tmp"
    mine_dead = tmp_path / f".out.{dead_pid + 3}@{h}+{atomic._PID_SPACE}~lease.dddd.tmp"
    old_style = tmp_path / f".out.{dead_pid + 4}@{h}.eeee.tmp"
    for p in (live_lease, dead_lease, unleased, mine_dead, old_style):
        p.mkdir()
    old = time.time() - 600
    for p in (dead_lease, unleased):
        os.utime(p, (old, old))
    removed = atomic.remove_leftovers(target)
    assert sorted(removed) == sorted([dead_lease, mine_dead, old_style])
    assert live_lease.exists() and unleased.exists()
    assert atomic._temp_prefix(target, leased=True) == f".out.{os.getpid()}@{h}+{atomic._PID_SPACE}~lease."
    assert re.fullmatch(r"[0-9a-f]{8}", atomic._PID_SPACE)


def test_atomic_dir_holds_its_lease_through_the_final_fsync_and_rename(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A leased folder's lease is renewed until it is renamed into place: the final fsync of many shards on a
    slow shared filesystem must not let another host's run take the folder for a dead run's."""
    held: list[bool] = []
    real_lease, real_replace = atomic.lease, atomic.replace_into_place
    active = {"n": 0}

    @contextlib.contextmanager
    def counting_lease(path, **kw):
        active["n"] += 1
        try:
            with real_lease(path, **kw):
                yield
        finally:
            active["n"] -= 1

    def replace(tmp, target, **kw):
        held.append(active["n"] > 0)
        real_replace(tmp, target, **kw)

    monkeypatch.setattr(atomic, "lease", counting_lease)
    monkeypatch.setattr(atomic, "replace_into_place", replace)
    with atomic.atomic_dir(tmp_path / "out", leased=True) as tmp:
        assert "~lease." in tmp.name and active["n"] == 1
        (tmp / "a").write_bytes(b"x")
    assert held == [True] and active["n"] == 0 and (tmp_path / "out" / "a").read_bytes() == b"x"


def test_lease_renews_mtime(tmp_path: Path) -> None:
    p = tmp_path / "t"
    p.mkdir()
    os.utime(p, (0, 0))
    with atomic.lease(p, renew_s=0.05):
        time.sleep(0.3)
    assert p.stat().st_mtime > time.time() - 60


# --------------------------------------------------------------------------------------------
# torchrun launches


def _torchrun(nproc: int, argv: list[str], *, env: dict[str, str] | None = None,
              cwd: Path = ROOT) -> subprocess.Popen[str]:
    cmd = [str(TORCHRUN), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), "--no-python", *argv]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait(proc: subprocess.Popen[str], timeout: float = TIMEOUT_S) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"torchrun did not finish in {timeout} s: {err[-3000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out, err


def _one_process(argv: list[str]) -> tuple[int, str]:
    res = CliRunner().invoke(main, argv)
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), res.output
    return res.exit_code, res.stdout


def _jobs(fx_root: Path, out: Path) -> list[list[str]]:
    jobs = []
    for name in FAMILIES:
        ckpt = str(fx_root / name / "ckpt")
        jobs += [["scan", ckpt], ["scan", "--json", ckpt], ["verify", ckpt], ["verify", "--json", ckpt]]
        slug = name.replace("/", "_")
        jobs += [["to-fp32", "-q", ckpt, str(out / f"{slug}.safetensors")],
                 ["to-fp32", "-q", ckpt, str(out / f"{slug}_shards"), "--max-shard-size", "2KB"]]
    for name, args in (("s2_fp32_w4", ["-n", "3"]), ("s3_bf16_w3_subgroups", ["-n", "2", "--zero-stage", "1"]),
                       ("s1_bf16_w2_bf16opt", ["-n", "1"]), ("hf_llama_z2_bf16_w2", ["-n", "3", "--verify", "full"]),
                       ("moe_s2_bf16_w2_ep2", ["-n", "4"]),
                       ("autotp/autotp_z2_fp32_tp2_dp2", ["-n", "2"]),
                       ("autotp/autotp_z3_bf16_tp2_dp1", ["-n", "2", "--tp-size", "1"]),
                       ("autotp/autotp_z1_bf16_tp2_dp1_kv6", ["-n", "4", "--tp-size", "4"]),  # AutoTP's width rule
                       ("autotp/megatron_z2_fp32_tp2_dp2", ["-n", "2"])):  # padding rows carried
        jobs.append(["reshard", "-q", str(fx_root / name / "ckpt"), str(out / f"reshard_{name.replace('/', '_')}"),
                     *args])
    for name in ("s2_fp32_w4", "s3_bf16_w3_subgroups", "autotp/megatron_z1_bf16_tp2_dp1"):
        jobs.append(["reshard", "-q", "--universal", str(fx_root / name / "ckpt"),
                     str(out / f"universal_{name.replace('/', '_')}")])
    fx = fx_root
    jobs += [["diff", str(fx / "s2_fp32_w4" / "ckpt"), str(fx / "s2_fp32_w4" / "ckpt"), "--role", "all"],
             ["diff", "--json", str(fx / "s2_fp16_w1_masterinf" / "ckpt"), str(fx / "s2_fp16_w1_bnoverflow" / "ckpt")],
             ["diff", "-v", str(fx / "s3_bf16_w3_subgroups" / "ckpt"), str(fx / "s1_bf16_w3" / "ckpt")]]
    for name in ("s2_fp16_w1_bnoverflow", "s3_fp16_w1_bnoverflow"):
        jobs.append(["repair", "-q", str(fx / name / "ckpt"), str(out / f"repair_{name}"),
                     "--policy", "reset-bn-stats"])
    jobs.append(["repair", "--json", str(fx / "s0_fp16_w1_bnoverflow" / "ckpt"), str(out / "repair_s0"),
                 "--policy", "reset-bn-stats"])
    run = fx / "lossfloor" / "s2_fp16_w2" / "ckpt"  # another checkpoint of the run as source, and the loss scaler reset
    jobs.append(["repair", "-q", str(run), str(out / "repair_lossfloor"), "--from", str(run / "global_step3"),
                 "--loss-scale", "32"])
    # a failure on a rank: --strict on a checkpoint with inf values (exit 1 everywhere, nothing written)
    jobs.append(["to-fp32", "--strict", str(fx / "s2_fp16_w1_bnoverflow" / "ckpt"),
                 str(out / "strict.safetensors")])
    return jobs


def test_same_stdout_exit_codes_and_bytes_as_one_process(tmp_path: Path) -> None:
    """Every family, every supported command, on 2 ranks in one launch: rank 0's stdout and every rank's
    exit code equal the one-process run's, and every output file is byte-identical."""
    single, dist = tmp_path / "single", tmp_path / "dist"
    single.mkdir()
    dist.mkdir()
    one = [_one_process(job) for job in _jobs(FIXTURES, single)]
    jobs = [[*job, "--distributed"] for job in _jobs(FIXTURES, dist)]
    results = tmp_path / "results"
    results.mkdir()
    (results / "jobs.json").write_text(json.dumps(jobs))
    # 64-byte range boundaries: both ranks write into each (small) single .safetensors file
    code, _, err = _wait(_torchrun(2, [sys.executable, str(DRIVER), str(results / "jobs.json"), str(results)],
                                   env={"DSCKPT_DIST_ALIGN_NBYTES": "64"}))
    assert code == 0, err[-3000:]
    codes = [json.loads((results / f"codes.{r}.json").read_text()) for r in range(2)]
    assert codes[0] == codes[1] == [c for c, _ in one]
    for i, (job, (_, stdout)) in enumerate(zip(jobs, one)):
        got = (results / f"out.{i}").read_text()
        # repair --json names the temporary folder it re-scanned (pid and random part): not the same in two runs
        temp = re.compile(r"/\.repair_s0\.[^\"]*\.tmp")
        assert temp.sub("TMP", got) == temp.sub("TMP", stdout.replace(str(single), str(dist))), \
            f"stdout differs for {job}"
    assert sorted(p.relative_to(single) for p in single.rglob("*")) == \
        sorted(p.relative_to(dist) for p in dist.rglob("*"))
    for p in single.rglob("*"):
        if p.is_file():
            assert (dist / p.relative_to(single)).read_bytes() == p.read_bytes(), p
    assert not (dist / "strict.safetensors").exists()
    # the failing rank is named on every rank: two error lines, the same one
    lines = [ln for ln in err.splitlines() if ln.startswith("dsckpt: error:")]
    assert len(lines) == 2 and lines[0] == lines[1], err[-3000:]
    assert "failed during writing OUT: non-finite values in" in lines[0] and "nothing was written" in lines[0]


def test_console_script_on_three_ranks(tmp_path: Path) -> None:
    """``torchrun --no-python dsckpt ...`` on 3 ranks: 3 ranks write disjoint ranges of one file; stdout and bytes
    equal the one-process run's."""
    ckpt = str(FIXTURES / "s3_bf16_w3_subgroups" / "ckpt")
    code1, stdout1 = _one_process(["to-fp32", "-q", ckpt, str(tmp_path / "one.safetensors")])
    assert code1 == 0
    dsckpt = str(Path(sys.executable).parent / "dsckpt")
    out = tmp_path / "three" / "one.safetensors"
    code, stdout, err = _wait(_torchrun(3, [dsckpt, "to-fp32", "-q", ckpt, str(out), "--distributed"],
                                        env={"DSCKPT_DIST_ALIGN_NBYTES": "4096"}))
    assert code == 0, err[-3000:]
    assert stdout == stdout1.replace(str(tmp_path / "one.safetensors"), str(out))
    assert out.read_bytes() == (tmp_path / "one.safetensors").read_bytes()
    assert sorted(p.name for p in out.parent.iterdir()) == ["one.safetensors"]


WRITES = {  # command -> its argv without OUT's folder; every one of them fsyncs what it wrote
    "to-fp32-shards": lambda out: ["to-fp32", "-q", str(FIXTURES / "s2_fp32_w4" / "ckpt"), str(out),
                                   "--max-shard-size", "1KB"],
    "to-fp32-file": lambda out: ["to-fp32", "-q", str(FIXTURES / "s2_fp32_w4" / "ckpt"), str(out) + ".safetensors"],
    "reshard": lambda out: ["reshard", "-q", str(FIXTURES / "s2_fp32_w4" / "ckpt"), str(out), "-n", "3"],
}


def _start_slow(tmp_path: Path, slow_rank: int, out: Path,
                command: str = "to-fp32-shards") -> tuple[subprocess.Popen[str], Path]:
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    jobs = [[*WRITES[command](out), "--distributed"]]
    (results / "jobs.json").write_text(json.dumps(jobs))
    ready = tmp_path / f"ready.{slow_rank}"
    proc = _torchrun(2, [sys.executable, str(DRIVER), str(results / "jobs.json"), str(results)],
                     env={"DIST_SLOW_FSYNC_RANK": str(slow_rank), "DIST_READY": str(ready),
                          "DSCKPT_DIST_ALIGN_NBYTES": "64"})
    end = time.monotonic() + TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before writing: {proc.communicate()[1][-3000:]}")
        assert time.monotonic() < end, "no rank started writing"
        time.sleep(0.05)
    return proc, ready


def _next_run_leaves_nothing(out: Path, command: str = "to-fp32-shards") -> None:
    res = CliRunner().invoke(main, WRITES[command](out))
    assert res.exit_code == 0, res.output
    assert len(list(out.parent.iterdir())) == 1


@pytest.mark.parametrize(("command", "killed"), [("to-fp32-shards", 1), ("to-fp32-shards", 0), ("to-fp32-file", 1),
                                                 ("reshard", 1)],
                         ids=["shards-worker", "shards-rank0", "file-worker", "reshard-worker"])
def test_rank_sigkilled_mid_write_leaves_no_output(tmp_path: Path, command: str, killed: int) -> None:
    out = tmp_path / "out" / "model"
    out.parent.mkdir()
    proc, ready = _start_slow(tmp_path, killed, out, command)
    assert any(p.name.startswith(".model") and p.name.endswith(".tmp") for p in out.parent.iterdir())  # temp exists
    os.kill(int(ready.read_text()), signal.SIGKILL)
    code, _, err = _wait(proc)
    assert code != 0
    assert not [p for p in out.parent.iterdir() if not p.name.startswith(".")]  # no OUT
    if killed != 0:  # rank 0 lived to remove its temp folder
        time.sleep(0.5)
        assert [p.name for p in out.parent.iterdir() if not p.name.endswith(".dsckpt-lock")] == [], err[-2000:]
    _next_run_leaves_nothing(out, command)


def test_sigterm_to_launcher_leaves_no_output(tmp_path: Path) -> None:
    out = tmp_path / "out" / "model"
    out.parent.mkdir()
    proc, _ = _start_slow(tmp_path, 1, out)
    proc.send_signal(signal.SIGTERM)
    code, _, err = _wait(proc)
    assert code != 0
    assert not out.exists()
    _next_run_leaves_nothing(out)


@pytest.mark.parametrize("value, want", [("0", 30.0), ("-5", 30.0), ("29", 30.0), ("45", 45.0), ("junk", 120.0)])
def test_lease_expiry_is_never_shorter_than_three_renewals(monkeypatch: pytest.MonkeyPatch, value: str,
                                                           want: float) -> None:
    # DSCKPT_LEASE_EXPIRY_S=0 would make every other host's live --distributed output look dead
    monkeypatch.setenv("DSCKPT_LEASE_EXPIRY_S", value)
    assert atomic.lease_expiry_s() == want == max(want, 3 * atomic.LEASE_RENEW_S)


class _FakeGroup(distributed.Group):
    """A Group whose collectives return what the test says the other ranks sent (no process group)."""

    def __init__(self, rank: int, others: list) -> None:
        super().__init__(rank, len(others))
        self.others = others

    def all_gather(self, obj):
        return [obj if r == self.rank else o for r, o in enumerate(self.others)]


def test_ranks_that_disagree_exit_4_naming_them() -> None:
    """Different plans on different ranks (the nodes see different files) are the environment's problem, not a dsckpt
    bug: exit 4 (README 'Exit codes'), never 70, naming the ranks that differ."""
    plan = {"a": 1}
    group = _FakeGroup(0, [distributed.digest(plan), distributed.digest(plan), distributed.digest({"a": 2})])
    with pytest.raises(distributed.DistributedError, match=r"rank\(s\) 2 computed another one") as e:
        group.agree(plan, "the plan")
    assert e.value.exit_code == 4 == errors.EXIT_DISTRIBUTED
    lost = distributed._lost_peer(1, RuntimeError("[a/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                                                  "[10.0.0.2]:36227. This is typically caused by ..."))
    assert lost.exit_code == 4
    assert str(lost) == ("rank 1: lost contact with another rank (Connection closed by peer [10.0.0.2]:36227); a rank "
                         "died or was stopped (torchrun's summary names it); nothing was written")
