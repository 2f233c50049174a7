"""``dsckpt to-dcp`` against an fsync'd ``dd`` of the same bytes and ``to-fp32`` of the same checkpoint, in one run
(issue 42); optionally against another dsckpt source (A/B) and today's route (DeepSpeed's ``ds_to_universal``, then
bench/dcp_from_universal.py: build the state dict, ``dcp.save``; issue 33).

    python bench/dcp.py --ckpt CKPT --work WORK --out RESULTS_DIR [--dcp-workers 2 4 8] [--rounds 2]
        [--baseline-src DIR] [--pycache DIR] [--check] [--drop-caches] [--skip STEP ...]

CKPT comes from bench/make_checkpoints.py (a ZeRO-3 run: the optimizer files hold the fp32 masters and both Adam
moments, 12 bytes a parameter, which to-dcp writes out again). Each round runs, in this order (each result is
appended to RESULTS_DIR/dcp.jsonl as soon as it is known, so a run cut short still reports what it measured):

* ``to-dcp``: ``dsckpt to-dcp -q --workers N CKPT WORK/dcp`` for each N of ``--dcp-workers``; then ``to-dcp
  [before]``, the same from the dsckpt package in ``--baseline-src`` (e.g. ``git archive main dsckpt``) at its
  default workers. Each records the files written and the flushes (``os.fsync``/``fdatasync``/``sync`` calls,
  counted by bench/fsync_count.py, which runs the command in-process), and the output is removed after;
* ``dd``: ``dd bs=64M conv=fsync`` of each optimizer-state file of CKPT into WORK/dd (the bytes to-dcp reads for the
  masters and moments, which are the bytes it writes), one shell running them in turn; removed after;
* ``to-fp32``: ``dsckpt to-fp32 -q CKPT WORK/fp32.safetensors`` (the fp32 weights: a third of to-dcp's bytes).

Before the rounds, the cost of ``import torch`` and of ``import torch.distributed.checkpoint`` (what to-dcp imports;
to-fp32 imports neither) is timed in fresh processes, twice each. ``--pycache DIR`` sets ``PYTHONPYCACHEPREFIX`` for
every step and fills it first (the first import, compiling, is timed too): on a host whose torch install keeps no
bytecode every import compiles Python source, which is not what a pip-installed torch costs. ``--check``: the last
round keeps the outputs of to-dcp and to-dcp [before] and compares them (every key, dtype, shape and value, through
``dcp.load``). ``ds_to_universal`` and ``dcp_from_universal`` run once at the end unless skipped (DeepSpeed needed).

Each step is one subprocess: wall time from ``perf_counter``, peak RSS from ``wait4``'s ``ru_maxrss`` (the largest
process of the step). The page cache is dropped before each step with ``--drop-caches`` (root, a host of one's own),
so every step reads the checkpoint from disk; else only ``sync``.
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
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                             cwd="/")  # not the repo: `python -m` would put the cwd's dsckpt first
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
    ap.add_argument("--skip", nargs="*", default=[], help="steps to leave out (to-dcp, before, dd, to-fp32, "
                    "imports, ds_to_universal, dcp_from_universal)")
    ap.add_argument("--dcp-workers", nargs="+", type=int, default=[4], help="to-dcp --workers values, one run each")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--baseline-src", type=Path, help="a folder holding another dsckpt/ package: to-dcp [before]")
    ap.add_argument("--pycache", type=Path, help="PYTHONPYCACHEPREFIX for every step, filled first")
    ap.add_argument("--check", action="store_true", help="compare the last round's to-dcp output with [before]'s")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each step (root; a "
                    "host of one's own only)")
    args = ap.parse_args()
    for k in ("ckpt", "work", "out", "baseline_src", "pycache"):  # the steps run in /
        if getattr(args, k) is not None:
            setattr(args, k, getattr(args, k).resolve())
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

    # torch's version from a child: importing it here would make every step's peak RSS at least this process's
    # (Linux keeps the high-water mark across fork and exec)
    torch_version = subprocess.run([PY, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                   text=True, check=False).stdout.strip()
    record("host", node=platform.node(), cpus=os.cpu_count(), python=platform.python_version(),
           torch=torch_version, ckpt=str(args.ckpt), ckpt_nbytes=tree_nbytes(args.ckpt / tag),
           optim_nbytes=sum(f.stat().st_size for f in optim_files), optim_files=len(optim_files),
           disk=shutil.disk_usage(args.work)._asdict())
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    if args.pycache is not None:  # and bytecode written there, even where the host's environment forbids it
        env.update(PYTHONPYCACHEPREFIX=str(args.pycache), PYTHONDONTWRITEBYTECODE="")

    if "imports" not in args.skip:
        for what, code in (("torch", "import torch"),
                           ("torch + DCP", "import torch, torch.distributed.checkpoint")):
            for i in range(3 if args.pycache is not None else 2):
                wall, rss, rc = run([PY, "-c", code], log, env)
                record("import", what=what, wall_s=round(wall, 2), code=rc,
                       note="first, compiling into --pycache" if args.pycache is not None and i == 0 else "")

    counter = HERE / "fsync_count.py"

    def to_dcp(label: str, workers: int | None, src_env: dict[str, str], keep: bool = False) -> Path:
        out = args.work / f"dcp-{label}-w{workers}"
        shutil.rmtree(out, ignore_errors=True)
        counts = args.work / "flushes.json"
        counts.unlink(missing_ok=True)
        cache = drop_caches()
        argv = [PY, str(counter), str(counts), "to-dcp", "-q", str(args.ckpt), str(out)]
        if workers is not None:
            argv += ["--workers", str(workers)]
        wall, rss, code = run(argv, log, src_env)
        flushes = json.loads(counts.read_text()) if counts.exists() else None
        files = sum(1 for p in out.rglob("*") if p.is_file()) if out.exists() else None
        record("to-dcp", label=label, workers=workers, wall_s=round(wall, 2), peak_rss=rss, code=code, cache=cache,
               out_nbytes=tree_nbytes(out) if out.exists() else None, out_files=files, flushes=flushes)
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
        return out

    for rnd in range(args.rounds):
        last = rnd == args.rounds - 1
        kept: list[Path] = []
        for workers in [] if "to-dcp" in args.skip else args.dcp_workers:
            keep = args.check and last and workers == args.dcp_workers[0]
            out = to_dcp("new", workers, env, keep=keep)
            if keep:
                kept.append(out)
        if args.baseline_src is not None and "before" not in args.skip:
            before_env = {**env, "PYTHONPATH": str(args.baseline_src.resolve())}
            out = to_dcp("before", None, before_env, keep=args.check and last)
            if args.check and last:
                kept.append(out)
        if "dd" not in args.skip:
            dd = args.work / "dd"
            dd.mkdir(exist_ok=True)
            script = "set -e; " + "; ".join(f"dd if={f} of={dd / f.name} bs=64M conv=fsync status=none"
                                             for f in optim_files)
            cache = drop_caches()
            wall, rss, code = run(["bash", "-c", script], log)
            record("dd", wall_s=round(wall, 2), peak_rss=rss, code=code, cache=cache, out_nbytes=tree_nbytes(dd),
                   out_files=len(optim_files))
            shutil.rmtree(dd, ignore_errors=True)
        if "to-fp32" not in args.skip:
            out = args.work / "fp32.safetensors"
            out.unlink(missing_ok=True)
            counts = args.work / "flushes.json"
            counts.unlink(missing_ok=True)
            cache = drop_caches()
            wall, rss, code = run([PY, str(counter), str(counts), "to-fp32", "-q", str(args.ckpt), str(out)], log,
                                  env)
            record("to-fp32", wall_s=round(wall, 2), peak_rss=rss, code=code, cache=cache,
                   out_nbytes=out.stat().st_size if out.exists() else None,
                   flushes=json.loads(counts.read_text()) if counts.exists() else None)
            out.unlink(missing_ok=True)
        if len(kept) == 2:
            wall, rss, code = run([PY, str(HERE / "dcp_compare.py"), str(kept[0]), str(kept[1])], log, env)
            record("check", a=str(kept[0]), b=str(kept[1]), equal=code == 0, wall_s=round(wall, 2), code=code)
        for k in kept:
            shutil.rmtree(k, ignore_errors=True)

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
