"""tests/ds_launch.run_deepspeed: a launch that outlives its timeout takes its rank processes down with it."""
from __future__ import annotations

import os
import time

from ds_launch import run_deepspeed


def test_timeout_kills_the_launcher_and_its_children(tmp_path):
    # a stand-in launcher that starts a "rank" (a long sleep in the background) and waits for it, like
    # DeepSpeed's launcher does; the rank's pid is written down so the test can look for it afterwards
    pidfile = tmp_path / "rank.pid"
    launcher = tmp_path / "fake-deepspeed"
    launcher.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nwait\n")
    launcher.chmod(0o755)
    t0 = time.monotonic()
    proc = run_deepspeed("no_such_script.py", [], world=1, cwd=tmp_path, timeout=2, launcher=launcher)
    assert time.monotonic() - t0 < 30
    assert proc.returncode == -9
    assert "killed after 2 s" in proc.stderr
    rank = int(pidfile.read_text())
    for _ in range(50):  # SIGKILL is delivered at once; reaping by init may take a moment
        try:
            os.kill(rank, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{rank}/stat") as f:  # a zombie waiting for init counts as gone
            if f.read().split(")")[-1].split()[0] == "Z":
                break
        time.sleep(0.1)
    else:
        raise AssertionError(f"rank process {rank} outlived the timeout")
