"""``dsckpt to-dcp`` against an fsync'd ``dd`` of the same bytes and against today's route (DeepSpeed's
``ds_to_universal``, then bench/dcp_from_universal.py: build the state dict, ``dcp.save``), one run each.

    python bench/dcp.py --ckpt CKPT --work WORK --out RESULTS_DIR [--workers 8] [--skip STEP ...]

CKPT comes from bench/make_checkpoints.py (a ZeRO-3 run: the optimizer files hold the fp32 masters and both Adam
moments, 12 bytes a parameter, which to-dcp writes out again). Steps, in this order (each result is appended to
RESULTS_DIR/dcp.jsonl as soon as it is known, so a run cut short still reports what it measured):

* ``to-dcp``: ``python -m dsckpt to-dcp -q --workers N CKPT WORK/dcp`` for each N of ``--dcp-workers``, then the
  output is listed (bytes, files) and removed;
* ``dd``: ``dd bs=64M conv=fsync`` of each optimizer-state file of CKPT into WORK/dd (the bytes to-dcp reads for the
  masters and moments, which are the bytes it writes), one shell running them in turn; removed after;
* ``ds_to_universal``: ``python -m deepspeed.checkpoint.ds_to_universal`` into WORK/univ;
* ``dcp_from_universal``: bench/dcp_from_universal.py WORK/univ WORK/dcp2.

Each step is one subprocess: wall time from ``perf_counter``, peak RSS from ``wait4``'s ``ru_maxrss`` (the largest
process of the step: a ``dd`` for the shell, a worker for ds_to_universal's pools). The page cache is dropped
before each step with ``--drop-caches`` (root, a host of one's own), so every step reads the checkpoint from disk;
else only ``sync``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PY = sys.executable


DROP = False  # --drop-caches: only on a host of one's own (it empties the page cache of everyone on it)


def drop_caches() -> str:
    subprocess.run(["sync"], check=True)
    if not DROP:
        return "sync only"
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "dropped"
    except OSError:
        return "sync only"


def run(argv: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of one subprocess, its output appended to ``log``."""
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(argv)}\n")
        f.flush()
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_maxrss * 1024, p.returncode


def tree_nbytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--workers", type=int, default=8, help="ds_to_universal's extract and merge workers")
    ap.add_argument("--skip", nargs="*", default=[], help="steps to leave out")
    ap.add_argument("--dcp-workers", nargs="+", type=int, default=[4], help="to-dcp --workers values, one run each")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each step (root; a "
                    "host of one's own only)")
    args = ap.parse_args()
    global DROP
    DROP = args.drop_caches
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    results, log = args.out / "dcp.jsonl", args.out / "dcp.log"
    tag = (args.ckpt / "latest").read_text().strip()
    optim_files = sorted((args.ckpt / tag).glob("*optim_states.pt"))

    def record(step: str, **fields: object) -> None:
        line = json.dumps({"step": step, **fields})
        with open(results, "a") as f:
            f.write(line + "\n")
        print(line, flush=True)

    record("host", node=platform.node(), cpus=os.cpu_count(), python=platform.python_version(),
           ckpt=str(args.ckpt), ckpt_nbytes=tree_nbytes(args.ckpt / tag),
           optim_nbytes=sum(f.stat().st_size for f in optim_files),
           disk=shutil.disk_usage(args.work)._asdict())
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}

    for workers in [] if "to-dcp" in args.skip else args.dcp_workers:
        out = args.work / "dcp"
        cache = drop_caches()
        wall, rss, code = run([PY, "-m", "dsckpt", "to-dcp", "-q", "--workers", str(workers), str(args.ckpt),
                               str(out)], log, env)
        record("to-dcp", workers=workers, wall_s=round(wall, 2), peak_rss=rss, code=code, cache=cache,
               out_nbytes=tree_nbytes(out) if out.exists() else None,
               out_files=sum(1 for _ in out.iterdir()) if out.exists() else None)
        shutil.rmtree(out, ignore_errors=True)
    if "dd" not in args.skip:
        dd = args.work / "dd"
        dd.mkdir(exist_ok=True)
        script = "set -e; " + "; ".join(f"dd if={f} of={dd / f.name} bs=64M conv=fsync status=none"
                                         for f in optim_files)
        cache = drop_caches()
        wall, rss, code = run(["bash", "-c", script], log)
        record("dd", wall_s=round(wall, 2), peak_rss=rss, code=code, cache=cache, out_nbytes=tree_nbytes(dd))
        shutil.rmtree(dd, ignore_errors=True)
    if "ds_to_universal" not in args.skip:
        univ = args.work / "univ"
        cache = drop_caches()
        wall, rss, code = run([PY, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                               str(args.ckpt / tag), "--output_folder", str(univ), "--num_extract_workers",
                               str(args.workers), "--num_merge_workers", str(args.workers)], log,
                              {"DS_ACCELERATOR": "cpu"})
        record("ds_to_universal", wall_s=round(wall, 2), peak_rss=rss, code=code, cache=cache,
               out_nbytes=tree_nbytes(univ) if univ.exists() else None)
        if "dcp_from_universal" not in args.skip and code == 0:
            out2 = args.work / "dcp2"
            cache = drop_caches()
            wall, rss, code = run([PY, str(HERE / "dcp_from_universal.py"), str(univ), str(out2)], log,
                                  {"DS_ACCELERATOR": "cpu"})
            record("dcp_from_universal", wall_s=round(wall, 2), peak_rss=rss, code=code, cache=cache,
                   out_nbytes=tree_nbytes(out2) if out2.exists() else None)
            shutil.rmtree(out2, ignore_errors=True)
        shutil.rmtree(univ, ignore_errors=True)


if __name__ == "__main__":
    main()
