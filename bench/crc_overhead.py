"""The cost of the CRC-32 checks on to-fp32's streaming path, without DeepSpeed.

    python bench/crc_overhead.py [--params 200M] [--rounds 7] [--workers 1]

Writes a ``torch.save`` file (zip format, one record per tensor) of fp32 ``hidden x hidden`` layers
-- the same tensors as the fp32 master of ``bench/make_checkpoints.py``'s model -- and times
``run_to_fp32`` on it (the code path of ``dsckpt to-fp32`` into one .safetensors file: chunked reads
in reader threads, inf/NaN counting, os.write, fsync), each run in a fresh subprocess with the
records' CRC-32 checks on and off (``DSCKPT_NO_CRC=1``), interleaved. Only the conversion is timed
(no interpreter start-up, no torch import); wall and CPU (user + system, all threads) are reported.
Useful where DeepSpeed is not installed; ``bench/run.py`` times the whole command on real checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, os, sys, time
from dsckpt.convert import plan_to_fp32, run_to_fp32
from dsckpt.state_dict_files import open_state_dict
src, out, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
logical, cache = open_state_dict(src)
plan = plan_to_fp32(logical, out)
t0, c0 = time.perf_counter(), os.times()
run_to_fp32(plan, cache, force=True, workers=workers)
c1 = os.times()
print(json.dumps({"wall_s": time.perf_counter() - t0, "cpu_s": (c1.user - c0.user) + (c1.system - c0.system)}))
"""


def parse_count(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def make_source(path: Path, params: int, hidden: int) -> None:
    import torch

    torch.manual_seed(0)
    layers = max(1, round(params / (hidden * hidden + hidden)))
    state = {}
    for i in range(layers):
        state[f"{i}.weight"] = torch.randn(hidden, hidden)
        state[f"{i}.bias"] = torch.randn(hidden)
    torch.save(state, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="200M")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--dir", type=Path, default=None, help="where the source and output go (default: a temp dir)")
    args = ap.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="dsckpt-crc-"))
    work.mkdir(parents=True, exist_ok=True)
    src, out = work / "source.pt", work / "out.safetensors"
    if not src.exists():
        make_source(src, parse_count(args.params), args.hidden)
    samples: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for r in range(args.rounds):
        order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
        for mode in order:
            with open(src, "rb", buffering=0) as f:  # page cache warm
                while f.read(16 << 20):
                    pass
            env = {**os.environ, "DSCKPT_NO_CRC": "1" if mode == "off" else ""}
            res = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(out), str(args.workers)],
                                 env=env, capture_output=True, text=True, check=True)
            samples[mode].append(json.loads(res.stdout.strip().splitlines()[-1]))
            out.unlink()
            subprocess.run(["sync"], check=True)
            s = samples[mode][-1]
            print(f"round {r + 1}/{args.rounds}  CRC {mode:3s}  {s['wall_s']:.3f} s  CPU {s['cpu_s']:.2f} s",
                  file=sys.stderr, flush=True)
    med = {m: {k: statistics.median(s[k] for s in v) for k in ("wall_s", "cpu_s")} for m, v in samples.items()}
    nbytes = src.stat().st_size
    print(f"source {nbytes / 1e6:,.0f} MB, {os.cpu_count()} CPUs, workers {args.workers}, medians of {args.rounds}:")
    for m in ("on", "off"):
        print(f"  CRC {m:3s}: {med[m]['wall_s']:.3f} s wall, {med[m]['cpu_s']:.2f} s CPU")
    print(f"  overhead: {(med['on']['wall_s'] / med['off']['wall_s'] - 1) * 100:+.1f}% wall, "
          f"{med['on']['cpu_s'] - med['off']['cpu_s']:+.2f} s CPU")


if __name__ == "__main__":
    main()
