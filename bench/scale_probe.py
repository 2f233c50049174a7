"""Probes behind the scale numbers (issue 12), run on the host right after ``scale.py run`` wrote a checkpoint.

    python3 bench/scale_probe.py CKPT --report probe.json [--baseline-src DIR]

* the host: CPU model and caches, NUMA nodes, the memory cgroup's limit, transparent huge pages;
* ``scan --nonfinite --workers 0`` (one thread does everything) with this code and with ``--baseline-src``:
  CPU seconds per GB, to compare the work one byte costs at ZeRO-2 and ZeRO-3;
* one ``reshard`` to half the ranks with its phases timed: writing the files, verifying, and the
  background fsync that overlaps the verification (``dsckpt.atomic.background_fsync``).

Each measurement is a fresh subprocess with the checkpoint read into the page cache first (``run.py``'s
``measure``). The JSON goes to ``--report``; ``bench/README.md`` ("Scale") quotes what it showed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import DSCKPT, PY, measure, remove, warm_cache

_TIMED_RESHARD = """
import json, sys, time, contextlib
import dsckpt.atomic, dsckpt.reshard
t0 = time.perf_counter()
marks = {}
real_verify, real_bg = dsckpt.reshard._verify, dsckpt.atomic.background_fsync
def verify(*a, **k):
    marks["written_s"] = time.perf_counter() - t0
    try:
        return real_verify(*a, **k)
    finally:
        marks["verified_s"] = time.perf_counter() - t0
@contextlib.contextmanager
def background(*a, **k):
    with real_bg(*a, **k):
        yield
        marks["block_done_s"] = time.perf_counter() - t0
    marks["fsynced_s"] = time.perf_counter() - t0
dsckpt.reshard._verify, dsckpt.atomic.background_fsync = verify, background
from dsckpt.cli import main
try:
    main(sys.argv[2:], prog_name="dsckpt")
finally:
    marks["total_s"] = time.perf_counter() - t0
    with open(sys.argv[1], "w") as f:
        json.dump(marks, f)
"""


def host_facts() -> dict[str, object]:
    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return "?"

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    keep = ("Model name", "Thread(s) per core", "Socket(s)", "L1d", "L2", "L3", "NUMA node")
    meminfo = {ln.split(":")[0]: ln.split(":")[1].strip() for ln in read("/proc/meminfo").splitlines() if ":" in ln}
    return {"lscpu": [ln.strip() for ln in lscpu.splitlines() if ln.strip().startswith(keep)],
            "cgroup_memory_max": read("/sys/fs/cgroup/memory.max"),
            "thp": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "meminfo": {k: meminfo.get(k, "?") for k in ("MemTotal", "MemFree", "Cached", "Dirty")},
            "loadavg": read("/proc/loadavg")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--report", type=Path, required=True)
    ap.add_argument("--baseline-src", type=Path, default=None)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--no-one-thread", dest="one_thread", action="store_false", help="skip the --workers 0 scans")
    args = ap.parse_args()
    ckpt = args.ckpt.resolve()
    out: dict[str, object] = {"host": host_facts(), "date": time.strftime("%Y-%m-%d %H:%M %Z"), "samples": {}}
    samples: dict[str, list[dict]] = out["samples"]  # type: ignore[assignment]

    def once(name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        subprocess.run(["sync"], check=True)
        warm_cache(ckpt)
        s = measure(argv, env or {})
        samples.setdefault(name, []).append(asdict(s))
        args.report.write_text(json.dumps(out, indent=1) + "\n")
        print(f"[probe] {name:44s} {s.wall_s:7.2f} s {s.cpu_s:7.2f} s CPU {s.maxrss_bytes / 1e6:6.0f} MB",
              file=sys.stderr, flush=True)

    scan = ["scan", "--nonfinite", "-q", str(ckpt)]
    if args.one_thread:
        once("scan --workers 0", [DSCKPT, *scan, "--workers", "0"])
    if args.one_thread and args.baseline_src is not None:
        once("scan --workers 0 [before]", [DSCKPT, *scan, "--workers", "0"],
             {"PYTHONPATH": str(args.baseline_src.resolve())})
    resh = ckpt.parent / "probe-resharded"
    marks_file = ckpt.parent / "probe-marks.json"
    remove(resh)
    # -P: not the current folder first on sys.path (a source checkout there would shadow the installed dsckpt)
    once("reshard, phases timed", [PY, "-P", "-c", _TIMED_RESHARD, str(marks_file), "reshard", str(ckpt), str(resh),
                                   "-n", str(max(1, args.ranks // 2)), "-q"])
    out["reshard_phases"] = json.loads(marks_file.read_text())
    remove(resh)
    os.unlink(marks_file)
    args.report.write_text(json.dumps(out, indent=1) + "\n")
    print(f"[probe] reshard phases: {out['reshard_phases']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
