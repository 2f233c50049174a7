"""Issue 32's benchmark: a pipeline-size change (2 -> 4 stages) of a PipelineModule checkpoint written by
bench/make_pipeline_checkpoint.py, against DeepSpeed's own route (``ds_to_universal``, whose output DeepSpeed then
loads at any stage count) and against ``cp -r`` of the same files (the floor: every byte read and written once).

    python bench/pipeline.py --ckpt bench/out/pp2 --rounds 1 --json bench/out/pipeline.json

Each case runs once per round with the page cache warm (the input is read once before), its output removed after
it; wall time and peak RSS come from bench/run.py's ``measure``. ``ds_to_universal`` needs ``--inject_missing_state``
on a plain PipelineModule run (it refuses one without Megatron's ``universal_checkpoint_info``). dsckpt runs with its default ``--verify quick``
and fsync; ``cp -r`` and ds_to_universal are followed by ``sync`` inside the timing, so all three reach the disk.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import measure


def _warm(path: Path) -> int:
    total = 0
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 24):
                    total += len(chunk)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--pp-size", type=int, default=4)
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--ds-workers", type=int, default=8, help="ds_to_universal's extract/merge workers")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    tag = (args.ckpt / "latest").read_text().strip()
    nbytes = _warm(args.ckpt)
    print(f"input {args.ckpt}: {nbytes / 1e9:.2f} GB warm in the page cache", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="dsckpt-pp-bench-", dir=args.ckpt.parent))
    py = sys.executable
    env = {"PYTHONPATH": str(HERE.parent), "DS_ACCELERATOR": "cpu"}
    cases = {
        f"dsckpt reshard --pp-size {args.pp_size} -n {args.world_size}": (
            [py, "-m", "dsckpt", "reshard", str(args.ckpt), str(tmp / "out"), "-q", "--pp-size", str(args.pp_size),
             "-n", str(args.world_size)], tmp / "out"),
        f"ds_to_universal (workers {args.ds_workers})": (
            ["sh", "-c", f'"{py}" -m deepspeed.checkpoint.ds_to_universal --input_folder "{args.ckpt / tag}" '
                         f'--output_folder "{tmp / "univ"}" --num_extract_workers {args.ds_workers} '
                         f'--num_merge_workers {args.ds_workers} --inject_missing_state >/dev/null && sync'], tmp / "univ"),
        "cp -r": (["sh", "-c", f'cp -r "{args.ckpt}" "{tmp / "copy"}" && sync'], tmp / "copy"),
    }
    results: dict[str, list[tuple[float, int]]] = {k: [] for k in cases}
    outputs: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, (cmd, out) in cases.items():
            s = measure(cmd, env)
            outputs[name] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
            results[name].append((s.wall_s, s.maxrss_bytes))
            print(f"  {name}: {s.wall_s:.1f} s, peak RSS {s.maxrss_bytes / 2**30:.2f} GiB, output "
                  f"{outputs[name] / 1e9:.2f} GB", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    print(f"input {args.ckpt}: {nbytes / 1e9:.2f} GB, {os.cpu_count()} cores, {args.rounds} round(s)")
    print(f"{'case':46s} {'wall s':>8s} {'GB/s in':>8s} {'peak RSS':>10s} {'output GB':>10s}")
    for name, samples in results.items():
        wall = statistics.median(w for w, _ in samples)
        rss = max(r for _, r in samples)
        rows.append({"case": name, "wall_s": wall, "walls": [w for w, _ in samples], "peak_rss_bytes": rss,
                     "output_bytes": outputs[name]})
        print(f"{name:46s} {wall:8.1f} {nbytes / wall / 1e9:8.2f} {rss / 2**30:8.2f} GiB {outputs[name] / 1e9:10.2f}")
    if args.json:
        args.json.write_text(json.dumps({"input_bytes": nbytes, "cores": os.cpu_count(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
