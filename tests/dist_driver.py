"""Rank side of tests/test_distributed.py: run several dsckpt commands in one torchrun launch.

``python tests/dist_driver.py JOBS.json RESULTS_DIR``: JOBS is a list of argv lists (``--distributed`` already
in them). Every rank runs the real click ``main`` on each in turn, in the same process group; rank 0's stdout of
job i goes to ``RESULTS_DIR/out.<i>``; every rank writes its exit codes to ``RESULTS_DIR/codes.<rank>.json``.

Env ``DIST_SLOW_FSYNC_RANK=R``, ``DIST_READY=PATH``: rank R's first ``os.fsync`` writes its pid to PATH and sleeps
a minute (the temp output then exists), so the test can kill that rank mid-write.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

rank = int(os.environ["RANK"])
if os.environ.get("DIST_SLOW_FSYNC_RANK") == str(rank):
    real = os.fsync

    def slow(fd: int) -> None:
        ready = os.environ["DIST_READY"]
        if not os.path.exists(ready):
            with open(ready + ".part", "w") as f:
                f.write(str(os.getpid()))
            os.replace(ready + ".part", ready)
            time.sleep(60)
        real(fd)

    os.fsync = slow

from dsckpt.cli import main

jobs, results = json.load(open(sys.argv[1])), sys.argv[2]
codes = []
for i, argv in enumerate(jobs):
    sys.stdout.flush()
    with open(os.path.join(results, f"out.{i}") if rank == 0 else os.devnull, "w") as out, \
            contextlib.redirect_stdout(out):
        try:
            main(argv, prog_name="dsckpt", standalone_mode=False)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    codes.append(code)
with open(os.path.join(results, f"codes.{rank}.json"), "w") as f:
    json.dump(codes, f)
