"""Run ``dsckpt ARGS...`` in this process, counting its flushes: ``os.fsync``, ``os.fdatasync`` and ``os.sync``
calls from any thread (dsckpt's and torch's alike), written as JSON to COUNTS when it exits.

    python bench/fsync_count.py COUNTS to-dcp -q CKPT OUT

Used by bench/dcp.py. The dsckpt package is the one ``PYTHONPATH`` finds (this script's folder is bench/, so the
current directory's is not put first as ``python -m dsckpt`` would)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

counts = {"fsync": 0, "fdatasync": 0, "sync": 0}
lock = threading.Lock()


def counting(name: str, real):  # type: ignore[no-untyped-def]
    def call(*a):  # type: ignore[no-untyped-def]
        with lock:
            counts[name] += 1
        return real(*a)
    return call


for _name in counts:
    setattr(os, _name, counting(_name, getattr(os, _name)))

if __name__ == "__main__":
    path, argv = sys.argv[1], sys.argv[2:]
    t0 = time.perf_counter()
    try:
        from dsckpt.cli import main

        imported = time.perf_counter() - t0
        main(argv, prog_name="dsckpt")
    finally:
        with open(path, "w") as f:
            json.dump({**counts, "total": sum(counts.values()), "cli_import_s": round(imported, 3),
                       "torch_imported": "torch" in sys.modules,
                       "dcp_imported": "torch.distributed.checkpoint" in sys.modules}, f)
