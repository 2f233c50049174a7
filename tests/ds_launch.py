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

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEEPSPEED = Path(sys.executable).parent / "deepspeed"


def gloo_only() -> None:
    """Make DeepSpeed's torch backend skip building its shared-memory op (call before ``deepspeed.initialize``)."""
    import importlib

    # not ``import deepspeed.comm.torch as m``: ``deepspeed.comm`` re-exports the real ``torch`` under that name
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


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
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), **(env or {})}
    cmd = [str(launcher), "--num_gpus", str(world), "--master_port", str(free_port()),
           str(REPO / "tests" / script), *args]
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
