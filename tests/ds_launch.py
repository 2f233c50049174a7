"""Start real DeepSpeed on CPU ranks from the tests, and keep it from hanging CI.

Two things made the suite hang on a fresh machine (CI ran out of its 90 minutes):

* DeepSpeed JIT-compiles its CPU shared-memory all-reduce op (``deepspeed_shm_comm``) into
  ``TORCH_EXTENSIONS_DIR`` the first time a process group starts. On a fresh 2-core machine that is a C++ build
  of many minutes under a file lock, and a rank killed while holding the lock leaves every later launch waiting
  on it. Once built, every run leaves its ``deepspeed_allreduce_buffer_*`` files in /dev/shm (never removed;
  21 GB of RAM had piled up on the development machine). The check scripts call :func:`gloo_only` before
  DeepSpeed starts: collectives go through gloo, nothing is compiled, nothing is left in /dev/shm. The checks
  compare checkpoints, not all-reduce speed.
* ``subprocess.run(timeout=...)`` kills the launcher only; its rank processes lived on holding ports and locks.
  :func:`run_deepspeed` starts the launcher in its own session and kills the whole process group on timeout.

A check's verdict comes from what its ranks wrote, not from the launcher's exit status. DeepSpeed 0.19.8 on CPU
ranks sometimes crashes *after* every check has passed: a rank ends with ``terminate called without an active
exception`` during interpreter teardown and the launcher returns 250 (seen on a 2-core AMD EPYC machine, a ZeRO-3
load on 3 ranks, and outside the suite too). That crash is in DeepSpeed/torch teardown, not in the checkpoint under
test. So every rank writes a done marker (:func:`mark_rank_done`) after the final barrier, i.e. after every rank
has finished and reported every check; when the results and every rank's marker are there, they decide
(:func:`launch_verdict`) and a launcher exit status that disagrees is only noted in the log. When any of them is
missing, the launcher's exit status is the verdict, so a rank that died mid-check still fails the test. Nothing is
retried: a retry can hide a real failure.
"""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parent.parent
DEEPSPEED = Path(sys.executable).parent / "deepspeed"


def gloo_only() -> None:
    """Make DeepSpeed's torch backend skip building its shared-memory op (call before ``deepspeed.initialize``)."""
    import importlib

    # not ``import deepspeed.comm.torch as m``: ``deepspeed.comm`` re-exports the real ``torch`` under that name
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def jit_op_built(name: str) -> bool:
    """Whether DeepSpeed's JIT-compiled CPU op ``name`` (``fused_adam`` for FusedAdam, ``cpu_lion`` for
    DeepSpeedCPULion) is already built under ``TORCH_EXTENSIONS_DIR``, or ``DSCKPT_JIT_LIVE=1`` lets a launch build it
    on first use (8-10 minutes each on the shared 2-core machine, under a file lock): the live tests that need such an
    op run only then."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    return os.environ.get("DSCKPT_JIT_LIVE") == "1" or any(root.glob(f"*/{name}/{name}.so"))


def logits_slack(max_abs_logit: float, dtype: str) -> float:
    """How far logits the engine computes on this CPU may be from the recorded ones: fp32 kernels sum in another
    order (1e-5 for logits below ~3); bf16 / fp16 logits may land one rounding step either way (two ulps: 7 / 10
    mantissa bits)."""
    if dtype == "fp32":
        return 1e-5
    mantissa_bits = 10 if dtype == "fp16" else 7
    return 2 * 2.0 ** (math.floor(math.log2(max(max_abs_logit, 2.0 ** -126))) - mantissa_bits)


def report_checks(pairs: Sequence[str], check_one: Callable[[str, str], list[str]], result: str | None) -> NoReturn:
    """Rank side of a check script: ``check_one(fixture, dir)`` on every ``FIXTURE=DIR`` pair on every rank.

    The problems of all ranks are gathered; rank 0 prints ``PASS name`` / ``FAIL name: why`` and writes the
    JSON result list to ``result``. Exits 1 if anything failed (an exception in a check counts as a problem).
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for pair in pairs:
        name, ckpt_dir = pair.split("=", 1)
        try:
            problems = check_one(name, ckpt_dir)
        except Exception as e:  # noqa: BLE001 - report and continue with the next checkpoint
            problems = [f"{type(e).__name__}: {e}"]
            if rank == 0:
                traceback.print_exc()
        gathered: list[list[str] | None] = [None] * world
        dist.all_gather_object(gathered, problems)
        merged = sorted({f"rank {r}: {m}" for r, ps in enumerate(gathered) for m in ps or []})
        results.append({"fixture": name, "ckpt": ckpt_dir, "world_size": world, "ok": not merged,
                        "problems": merged})
        if rank == 0:
            print(("PASS " if not merged else "FAIL ") + f"{name} -> {world} ranks ({ckpt_dir})"
                  + ("" if not merged else ": " + "; ".join(merged[:6])), flush=True)
    if rank == 0 and result:
        with open(result, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    if result:
        mark_rank_done(result)
    sys.exit(0 if all(r["ok"] for r in results) else 1)


def mark_rank_done(result: str | os.PathLike[str]) -> None:
    """Rank side: write ``RESULT.rank{r}.done`` once this rank has passed the check's final barrier (so every
    rank has finished every check and rank 0 has written RESULT). Call it last, right before exiting."""
    import torch.distributed as dist

    Path(f"{os.fspath(result)}.rank{dist.get_rank()}.done").write_text(str(dist.get_world_size()))


def ranks_done(result: str | os.PathLike[str], world: int) -> list[int]:
    """Test side: the ranks of ``world`` that have not written their done marker for ``result``."""
    return [r for r in range(world) if not Path(f"{os.fspath(result)}.rank{r}.done").is_file()]


def launch_verdict(returncode: int, *, complete: bool, failed: bool) -> tuple[int, str]:
    """Test side: ``(verdict, note)`` of a launch. With ``complete`` results (rank 0's report and every rank's
    done marker), the verdict is 1 if a check ``failed``, else 0, whatever the launcher returned (a teardown crash
    after the last barrier, see the module docstring); ``note`` says when the launcher disagreed. Without them the
    launcher's status decides, and an incomplete run that still exited 0 is made a failure (-1)."""
    if complete:
        verdict = 1 if failed else 0
        note = "" if returncode == verdict else (
            f"[ds_launch] the launcher exited {returncode} after every rank had reported complete results; "
            f"the verdict ({verdict}) comes from those results")
        return verdict, note
    if returncode == 0:
        return -1, "[ds_launch] the launcher exited 0 but the ranks' results are incomplete"
    return returncode, ""


def run_check_script(script: str, pairs: Sequence[str], *, world: int, cwd: Path, timeout: float,
                     args: Sequence[str] = (), launcher: Path = DEEPSPEED,
                     env: dict[str, str] | None = None) -> tuple[int, list[dict], str]:
    """Test side: run a check script (one that ends in :func:`report_checks`) on ``FIXTURE=DIR`` pairs.

    Returns its verdict (:func:`launch_verdict`: 0 all passed, 1 a check failed, else the launcher's status when
    the results are incomplete), its JSON result list (empty if it wrote none) and a log: the PASS/FAIL lines and
    the ``*-EVIDENCE`` lines a script prints, or the end of its output when there are none, plus a note when the launcher's status was overruled.
    """
    result = Path(cwd) / f"result_{world}.json"
    proc = run_deepspeed(script, ["--result", str(result), *args, *pairs], world=world, cwd=cwd, timeout=timeout,
                         launcher=launcher, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("PASS", "FAIL")) or "-EVIDENCE " in ln]
    results = json.loads(result.read_text()) if result.exists() else []
    complete = ([r["fixture"] for r in results] == [p.split("=", 1)[0] for p in pairs]
                and all(r["world_size"] == world for r in results) and not ranks_done(result, world))
    verdict, note = launch_verdict(proc.returncode, complete=complete, failed=not all(r["ok"] for r in results))
    log = "\n".join(lines) or proc.stdout[-3000:] + proc.stderr[-3000:]
    return verdict, results, log + ("\n" + note if note else "")


def passed_except_controls(results: list[dict], log: str) -> tuple[list[dict], list[dict]]:
    """Test side: ``(results, controls)`` of a :func:`run_check_script` run, asserting that it reported
    something and that every result passed except the tampered controls (``ckpt`` ending in
    ``tampered``), which the caller checks failed as they must."""
    assert results, log
    controls = [r for r in results if r["ckpt"].endswith("tampered")]
    results = [r for r in results if r not in controls]
    failed = [r for r in results if not r["ok"]]
    assert not failed, "\n".join(f"{r['fixture']}: {r['problems']}" for r in failed)
    return results, controls


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_deepspeed(script: str, args: list[str], *, world: int, cwd: Path, timeout: float,
                  launcher: Path = DEEPSPEED, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``DS_ACCELERATOR=cpu deepspeed --num_gpus WORLD --master_port P tests/SCRIPT ARGS`` with a hard timeout.

    On timeout the launcher and its ranks are killed together and a CompletedProcess with returncode -9 and
    the output so far is returned, so the test fails with the log instead of hanging.
    """
    proc = _launch(script, args, world=world, cwd=cwd, timeout=timeout, launcher=launcher, env=env)
    if proc.returncode != 0 and "EADDRINUSE" in proc.stderr + proc.stdout:
        # free_port() closes its socket before the launcher binds the port, so another process can take it in
        # between; the rendezvous then fails before any rank has run a check. Only that failure is retried, once,
        # on a new port.
        proc = _launch(script, args, world=world, cwd=cwd, timeout=timeout, launcher=launcher, env=env)
        proc.stderr += "\n[ds_launch] retried once on a new port: the first master port was taken (EADDRINUSE)"
    return proc


def _launch(script: str, args: list[str], *, world: int, cwd: Path, timeout: float, launcher: Path,
            env: dict[str, str] | None) -> subprocess.CompletedProcess[str]:
    cmd = [str(launcher), "--num_gpus", str(world), "--master_port", str(free_port()),
           str(REPO / "tests" / script), *args]
    return run_in_session(cmd, cwd=cwd, timeout=timeout, env=env)


def run_in_session(cmd: list[str], *, cwd: Path, timeout: float,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (with ``DS_ACCELERATOR=cpu`` and the repo on ``PYTHONPATH``) in its own session; on timeout, or if
    interrupted, kill its whole process group (ranks a launcher or Lightning started included). A timeout returns
    returncode -9 and the output so far."""
    # the repo first, then whatever PYTHONPATH the test run had (packages installed with --target, say)
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": pythonpath, **(env or {})}
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[ds_launch] killed after {timeout:.0f} s: {' '.join(cmd)}"
        return subprocess.CompletedProcess(cmd, -9, out, err)
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C, pytest timeout): take the ranks down too
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
