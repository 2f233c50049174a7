"""Issue 20's speed target: a tensor-parallel checkpoint converts at the same bytes per second as a data-parallel-only
one of the same size. Same model, same ZeRO stage and dtype, written by bench/make_tp_checkpoints.py as TP 2 x DP 1
and TP 1 x DP 2; the anchors, timed in the same rounds, are DeepSpeed's own tools: ``ds_to_universal`` (the only
DeepSpeed tool that merges TP slices; it also writes the moments, so it does more work) on the TP checkpoint, and
``zero_to_fp32`` (which refuses TP folders) on the DP one.

    python bench/tp.py --tp bench/out/tp2-llama --dp bench/out/dp2-llama --rounds 3

Rounds are interleaved (TP, DP, anchors, then again), the page cache is warm for all (each input is read once
before the first round), and every output is removed after its run. Prints one row per case (median wall time,
output GB/s, peak RSS) and the ratios. ``--readers`` times ``scan``, ``verify`` and ``diff`` (of each checkpoint
against itself) instead, per input byte; DeepSpeed has no tool to anchor them to.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import timed, warm_cache

BIN = Path(sys.executable).parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=Path, required=True)
    ap.add_argument("--dp", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-anchors", action="store_true")
    ap.add_argument("--anchor-rounds", type=int, default=None, help="time the anchors in the first N rounds only")
    ap.add_argument("--ds-workers", type=int, default=2, help="ds_to_universal's extract/merge workers")
    ap.add_argument("--readers", action="store_true",
                    help="time scan, verify and diff (against itself) on both checkpoints instead of to-fp32, and "
                         "compare per input byte (no anchor: DeepSpeed has no such tool)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dsckpt-tp-bench-", dir=HERE / "out"))
    tag = {p: (p / "latest").read_text().strip() for p in (args.tp, args.dp)}
    dsckpt = [sys.executable, "-m", "dsckpt"]
    cases: dict[str, tuple[list[str], str | None]] = {}  # name -> (command, output name; None: writes nothing)
    if args.readers:  # in rounds of their own: to-fp32's fsync'd writes make the reads around them noisy
        for cmd in ("scan", "verify", "diff"):
            for label, ck in (("TP 2 x DP 1", args.tp), ("TP 1 x DP 2", args.dp)):
                cases[f"dsckpt {cmd}, {label}"] = (dsckpt + [cmd, str(ck)] + ([str(ck)] if cmd == "diff" else []), None)
    else:
        cases["dsckpt to-fp32, TP 2 x DP 1"] = (dsckpt + ["to-fp32", "-q", str(args.tp)], "tp.safetensors")
        cases["dsckpt to-fp32, TP 1 x DP 2"] = (dsckpt + ["to-fp32", "-q", str(args.dp)], "dp.safetensors")
    if not args.no_anchors and not args.readers:
        cases["ds_to_universal, TP 2 x DP 1 (anchor)"] = (
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
             str(args.tp / tag[args.tp]), "--num_extract_workers", str(args.ds_workers), "--num_merge_workers", str(args.ds_workers),
             "--output_folder"], "universal")
        cases["zero_to_fp32, TP 1 x DP 2 (anchor)"] = (
            [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(args.dp), "--safe_serialization"], "z2f")
    for p in (args.tp, args.dp):
        warm_cache(p)
    times: dict[str, list[float]] = {k: [] for k in cases}
    rss: dict[str, int] = {k: 0 for k in cases}
    out_nbytes = 0
    for r in range(args.rounds):
        for name, (cmd, out_name) in cases.items():
            if "(anchor)" in name and args.anchor_rounds is not None and r >= args.anchor_rounds:
                continue
            if out_name is None:  # a reading command: nothing written
                dt, kb = timed(cmd, tmp / "none")
                times[name].append(dt)
                rss[name] = max(rss[name], kb)
                continue
            out = tmp / out_name
            if name.startswith("dsckpt") and not out_nbytes:
                subprocess.run([*cmd, str(out)], check=True, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
                out_nbytes = out.stat().st_size
                out.unlink()
            dt, kb = timed([*cmd, str(out)], out)
            times[name].append(dt)
            rss[name] = max(rss[name], kb)
    shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    # reading commands: input bytes per second (the TP checkpoint also holds each replicated param once per TP rank)
    size = {p: sum(f.stat().st_size for f in (p / tag[p]).rglob("*") if f.is_file()) for p in (args.tp, args.dp)}
    print(f"fp32 model: {out_nbytes / 1e9:.2f} GB" if out_nbytes else
          f"input: TP {size[args.tp] / 1e9:.2f} GB, DP-only {size[args.dp] / 1e9:.2f} GB (GB/s: input read)")
    print(f"{args.rounds} interleaved rounds, medians (all rounds in brackets)")
    for name in cases:
        rounds = ", ".join(f"{t:.2f}" for t in times[name])
        nbytes = out_nbytes or size[args.tp if "TP 2" in name else args.dp]
        print(f"  {name:40s} {med[name]:7.2f} s  {nbytes / med[name] / 1e9:5.2f} GB/s  "
              f"{rss[name] / 1024:7.0f} MB  [{rounds}]")
    if args.readers:
        for cmd in ("scan", "verify", "diff"):
            t, d = med[f"dsckpt {cmd}, TP 2 x DP 1"], med[f"dsckpt {cmd}, TP 1 x DP 2"]
            print(f"{cmd:6s} TP / DP-only: {t / d:.2f}x the time, {(t / size[args.tp]) / (d / size[args.dp]):.2f}x "
                  f"the time per input byte")
        return
    tp, dp = med["dsckpt to-fp32, TP 2 x DP 1"], med["dsckpt to-fp32, TP 1 x DP 2"]
    print(f"TP / DP-only time: {tp / dp:.2f}x (target: the same bytes per second, <= 1.10x)")
    if not args.no_anchors:
        print(f"dsckpt TP vs ds_to_universal: {tp / med['ds_to_universal, TP 2 x DP 1 (anchor)']:.2f}x the time; "
              f"dsckpt DP vs zero_to_fp32: {dp / med['zero_to_fp32, TP 1 x DP 2 (anchor)']:.2f}x the time")


if __name__ == "__main__":
    main()
