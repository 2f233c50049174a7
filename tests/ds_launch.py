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
"""
from __future__ import annotations

import json
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
    sys.exit(0 if all(r["ok"] for r in results) else 1)


def run_check_script(script: str, pairs: Sequence[str], *, world: int, cwd: Path, timeout: float,
                     args: Sequence[str] = (), launcher: Path = DEEPSPEED,
                     env: dict[str, str] | None = None) -> tuple[int, list[dict], str]:
    """Test side: run a check script (one that ends in :func:`report_checks`) on ``FIXTURE=DIR`` pairs.

    Returns its exit status, its JSON result list (empty if it wrote none) and a log: the PASS/FAIL lines, or
    the end of its output when there are none.
    """
    result = Path(cwd) / f"result_{world}.json"
    proc = run_deepspeed(script, ["--result", str(result), *args, *pairs], world=world, cwd=cwd, timeout=timeout,
                         launcher=launcher, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("PASS", "FAIL"))]
    results = json.loads(result.read_text()) if result.exists() else []
    return proc.returncode, results, "\n".join(lines) or proc.stdout[-3000:] + proc.stderr[-3000:]


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
    cmd = [str(launcher), "--num_gpus", str(world), "--master_port", str(free_port()),
           str(REPO / "tests" / script), *args]
    return run_in_session(cmd, cwd=cwd, timeout=timeout, env=env)


def run_in_session(cmd: list[str], *, cwd: Path, timeout: float,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (with ``DS_ACCELERATOR=cpu`` and the repo on ``PYTHONPATH``) in its own session; on timeout, or if
    interrupted, kill its whole process group (ranks a launcher or Lightning started included). A timeout returns
    returncode -9 and the output so far."""
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), **(env or {})}
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
