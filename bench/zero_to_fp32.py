"""``python -m dsckpt.zero_to_fp32`` against DeepSpeed's own ``zero_to_fp32`` (0.19.8), same arguments, same run.

    /work/venv/bin/python bench/zero_to_fp32.py [--rounds 3] [--ckpt bench/out/zero2-50m ...] \\
        [--results bench/results/zero_to_fp32.md]

Checkpoints come from ``bench/make_checkpoints.py`` (bench/README.md, step 1). For each checkpoint and each
output kind (``pytorch_model.bin``, and ``model.safetensors`` with ``--safe_serialization``), both commands
run once first and their outputs are compared tensor by tensor (names, dtypes, bytes); then every case is timed
in interleaved rounds (forward, reverse, ...), one subprocess per measurement: wall time from
``time.perf_counter`` around it, peak RSS from GNU ``/usr/bin/time -f %M``. Before each measurement the input
is read once (page cache warm) and the previous output is removed and ``sync`` ed. The table reports medians
and dsckpt / DeepSpeed ratios of medians from the same run. The machine may be shared: single runs vary.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
OUT = HERE / "out" / "z2f"
PY = sys.executable
TIME = "/usr/bin/time"
MiB = 1024 * 1024


def tool_argv(tool: str, ckpt: Path, out: Path, safe: bool) -> list[str]:
    module = {"deepspeed": "deepspeed.utils.zero_to_fp32", "dsckpt": "dsckpt.zero_to_fp32"}[tool]
    return [PY, "-m", module, str(ckpt), str(out), *(["--safe_serialization"] if safe else [])]


def warm(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(16 * MiB):
                    pass


def measure(argv: list[str], out: Path, ckpt: Path) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(["sync"], check=True)
    warm(ckpt)
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    t0 = time.perf_counter()
    r = subprocess.run([TIME, "-f", "%M", *argv], capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return wall, int(r.stderr.strip().splitlines()[-1]) * 1024


def load(out: Path) -> dict:
    """Both tools' outputs, read back to compare them. Deliberately torch's own reader (``weights_only=True``), not
    dsckpt's ``safe_load`` (dsckpt's one unpickling choke point): a check of dsckpt's output must not go through
    dsckpt's reader."""
    import torch
    from safetensors.torch import load_file

    sd: dict = {}
    for p in sorted(out.iterdir()):
        if p.suffix == ".safetensors":
            sd.update(load_file(str(p)))
        elif p.suffix == ".bin":
            sd.update(torch.load(p, map_location="cpu", weights_only=True))
    return sd


def same_output(ckpt: Path, safe: bool) -> str:
    import torch

    outs = {}
    for tool in ("deepspeed", "dsckpt"):
        out = OUT / f"check-{tool}"
        measure(tool_argv(tool, ckpt, out, safe), out, ckpt)
        outs[tool] = (sorted(p.name for p in out.iterdir()), load(out))
    (names_a, a), (names_b, b) = outs["deepspeed"], outs["dsckpt"]
    if names_a != names_b or list(a) != list(b):
        raise SystemExit(f"{ckpt}: the files differ: {names_a} vs {names_b}")
    for k in a:
        if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]):
            raise SystemExit(f"{ckpt}: '{k}' differs")
    return f"identical: {', '.join(names_a)}, {len(a)} tensors"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ckpt", nargs="+", type=Path,
                    default=[HERE / "out" / "zero2-50m", HERE / "out" / "zero3-50m"])
    ap.add_argument("--results", type=Path, default=HERE / "results" / "zero_to_fp32.md")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    cases = [(ckpt, safe, tool) for ckpt in args.ckpt for safe in (False, True) for tool in ("deepspeed", "dsckpt")]
    checks = {(ckpt, safe): same_output(ckpt, safe) for ckpt in args.ckpt for safe in (False, True)}
    samples: dict[tuple, list[tuple[float, int]]] = {c: [] for c in cases}
    for r in range(args.rounds):
        for case in cases if r % 2 == 0 else list(reversed(cases)):
            ckpt, safe, tool = case
            samples[case].append(measure(tool_argv(tool, ckpt, OUT / "timed", safe), OUT / "timed", ckpt))
            print(f"round {r + 1}: {ckpt.name} {'safetensors' if safe else 'bin'} {tool}: "
                  f"{samples[case][-1][0]:.2f} s", file=sys.stderr)
    shutil.rmtree(OUT, ignore_errors=True)
    lines = [
        "# `python -m dsckpt.zero_to_fp32` vs DeepSpeed's `zero_to_fp32` (bench/zero_to_fp32.py)",
        "",
        (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node()}, {os.cpu_count()} CPUs, "
         f"Python {platform.python_version()}, {args.rounds} rounds interleaved, medians; same arguments for both "
         "(`CKPT OUT [--safe_serialization]`, default `--max_shard_size 5GB`: one file)."),
        "",
        ("| checkpoint | output | DeepSpeed s | dsckpt s | time ratio | DeepSpeed peak RSS | dsckpt peak RSS "
         "| RSS ratio | outputs |"),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for ckpt in args.ckpt:
        for safe in (False, True):
            ds = samples[(ckpt, safe, "deepspeed")]
            ours = samples[(ckpt, safe, "dsckpt")]
            t_ds, t_us = statistics.median(s[0] for s in ds), statistics.median(s[0] for s in ours)
            m_ds, m_us = statistics.median(s[1] for s in ds), statistics.median(s[1] for s in ours)
            lines.append(f"| {ckpt.name} | {'model.safetensors' if safe else 'pytorch_model.bin'} | {t_ds:.2f} | "
                         f"{t_us:.2f} | {t_us / t_ds:.2f} | {m_ds / MiB:.0f} MiB | {m_us / MiB:.0f} MiB | "
                         f"{m_us / m_ds:.2f} | {checks[(ckpt, safe)]} |")
    text = "\n".join(lines) + "\n"
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
