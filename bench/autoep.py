"""Issue 27's speed target: exporting an AutoEP checkpoint costs the same per byte as a dense checkpoint of the same
size (<= 1.1x), and far less than ``ds_to_universal``. Both written by bench/make_autoep_checkpoints.py (the same
Mixtral-shaped model, 8 experts: AutoEP EP 2 x expert-DP 1, and data-parallel only DP 2; ZeRO-2 bf16, one step).

    python bench/autoep.py --autoep bench/out/autoep-mixtral --dense bench/out/dense-mixtral --rounds 3

Cases, interleaved per round with a warm page cache (each input read once first), outputs removed after each run:
``dsckpt to-fp32 CKPT OUT.safetensors`` (AutoEP's names) and ``dsckpt to-fp32 CKPT OUT/`` (HF names: experts fused
back into ``gate_up_proj``) on the AutoEP checkpoint, ``dsckpt to-fp32`` to a file and to a folder on the dense one, and the anchor
``ds_to_universal`` (DeepSpeed's only tool that consolidates AutoEP; it also writes the moments) on the AutoEP one.
Prints the median wall time, output GB/s and peak RSS per case, and the ratios per output byte.
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
from run import remove, timed, warm_cache


def _nbytes(out: Path) -> int:
    return sum(f.stat().st_size for f in out.rglob("*.safetensors")) if out.is_dir() else out.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--autoep", type=Path, required=True)
    ap.add_argument("--dense", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--anchor-rounds", type=int, default=1, help="time ds_to_universal in the first N rounds only")
    args = ap.parse_args()
    (HERE / "out").mkdir(exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="dsckpt-autoep-bench-", dir=HERE / "out"))
    tag = (args.autoep / "latest").read_text().strip()
    dsckpt = [sys.executable, "-m", "dsckpt", "to-fp32", "-q"]
    cases = {
        "dsckpt to-fp32 .safetensors, AutoEP EP 2": (dsckpt + [str(args.autoep)], "ae.safetensors"),
        "dsckpt to-fp32 OUT/ (HF names), AutoEP": (dsckpt + [str(args.autoep)], "ae_hf/"),
        "dsckpt to-fp32 .safetensors, dense DP 2": (dsckpt + [str(args.dense)], "dense.safetensors"),
        "dsckpt to-fp32 OUT/, dense DP 2": (dsckpt + [str(args.dense)], "dense_hf/"),
        "ds_to_universal, AutoEP EP 2 (anchor)": (
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(args.autoep / tag),
             "--num_extract_workers", "2", "--num_merge_workers", "2", "--output_folder"], "universal"),
    }
    for p in (args.autoep, args.dense):
        warm_cache(p)
    out_nbytes: dict[str, int] = {}
    times: dict[str, list[float]] = {k: [] for k in cases}
    rss: dict[str, int] = {k: 0 for k in cases}
    for r in range(args.rounds):
        for name, (cmd, out_name) in cases.items():
            if "(anchor)" in name and r >= args.anchor_rounds:
                continue
            out = tmp / out_name
            if name.startswith("dsckpt") and name not in out_nbytes:
                subprocess.run([*cmd, str(out) + ("/" if out_name.endswith("/") else "")], check=True,
                               env={**os.environ, "PYTHONPATH": str(HERE.parent)})
                out_nbytes[name] = _nbytes(out)
                remove(out)
            dt, kb = timed([*cmd, str(out) + ("/" if out_name.endswith("/") else "")], out)
            times[name].append(dt)
            rss[name] = max(rss[name], kb)
    shutil.rmtree(tmp, ignore_errors=True)
    cases = {k: v for k, v in cases.items() if times[k]}  # --anchor-rounds 0: the anchor was not run
    med = {k: statistics.median(v) for k, v in times.items() if v}
    size = {p: sum(f.stat().st_size for f in (p / tag).rglob("*") if f.is_file()) for p in (args.autoep, args.dense)}
    print(f"input: AutoEP {size[args.autoep] / 1e9:.2f} GB, dense {size[args.dense] / 1e9:.2f} GB; fp32 model: "
          + ", ".join(f"{k.split(',')[0][7:]}{k.split(',')[1]} {v / 1e9:.3f} GB" for k, v in out_nbytes.items()))
    print(f"{args.rounds} interleaved rounds (anchor: {args.anchor_rounds}), medians (all rounds in brackets)")
    ref = next(iter(out_nbytes.values()))
    for name in cases:
        rounds = ", ".join(f"{t:.2f}" for t in times[name])
        nb = out_nbytes.get(name, ref)
        print(f"  {name:44s} {med[name]:7.2f} s  {nb / med[name] / 1e9:5.2f} GB/s  {rss[name] / 1024:7.0f} MB  "
              f"[{rounds}]")
    a, h, d, dh = (med[k] / out_nbytes[k] for k in list(cases)[:4])
    print(f"AutoEP / dense, per output byte: {a / d:.2f}x (.safetensors), {h / dh:.2f}x (HF folder vs dense folder); "
          "target <= 1.10x")
    if len(cases) > 4:
        print(f"AutoEP to-fp32 vs ds_to_universal: {med[next(iter(cases))] / med[list(cases)[4]]:.2f}x the time")


if __name__ == "__main__":
    main()
