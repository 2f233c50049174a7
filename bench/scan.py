"""`dsckpt scan` and `dsckpt verify` against `cat` of the same files, and what each check costs per byte.

    python bench/scan.py CKPT [CKPT ...] [--rounds 5] [--baseline-src bench/out/before-SHA] [--costs]
                         [--only scan-nf,scan,verify] [--report out.json]

For every checkpoint, in interleaved rounds (forward, then backward), each a fresh subprocess, with the checkpoint's
files read once at the start of each round (page cache warm): `cat` of every file in the tag folder (the floor), `dsckpt scan
--nonfinite`, `dsckpt scan` (every check) and `dsckpt verify`, and with ``--baseline-src DIR`` (a folder holding
another ``dsckpt/``, e.g. ``git archive <sha> dsckpt | tar -x -C DIR``) the same three commands run from that source
as ``[before]``; ``--block-variants 256:65536`` adds every command with 256 KiB blocks and 64K-element comparisons. Wall time from ``perf_counter``; CPU time (user + system) and peak RSS from ``os.wait4`` of the
child (this script imports nothing big, so the child's RSS high-water mark is its own). Each ``dsckpt/`` source runs
as ``pip install`` leaves a package, with its bytecode compiled first (``compileall``): a machine that sets
``PYTHONDONTWRITEBYTECODE=1`` (this project's 2-core machine does) would otherwise compile dsckpt's modules again in
every run, ~0.15 s of CPU that no installed copy pays; ``--no-bytecode`` measures that way. The table gives medians
and each command's ratio to the median `cat` of the same run. The commands run with ``python -P`` so that the
current folder's ``dsckpt/`` never shadows the one asked for.

``--costs`` measures, in this process and one thread, over the checkpoint's largest file in the page cache, what
each step of the scan loop costs per byte, for a few block sizes: the read (``preadv`` of each block into one
reused buffer), the CRC-32 (``dsckpt.crc.crc32``: ISA-L where installed), the inf/NaN check of fp32 (a max and a
min; they also answer the fp16-overflow check) and of 16-bit data (an AND and a max over the exponent bits), and
the master-vs-16-bit comparison (rounding a block of fp32 to bf16 and comparing; per byte of fp32 + bf16 read),
each in ns per byte of CPU time, next to `cat`'s. That is the floor where a ratio misses its target.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

COMMANDS = {
    "scan-nf": ["scan", "--nonfinite", "-q"],
    "scan": ["scan", "-q"],
    "verify": ["verify"],
}


def tag_files(ckpt: Path) -> list[Path]:
    latest = ckpt / "latest"
    tag = ckpt / latest.read_text().strip() if latest.is_file() else ckpt
    return sorted(p for p in tag.iterdir() if p.is_file())


def warm(files: list[Path]) -> None:
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass


def measure(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd="/")
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode() if proc.stderr else ""
    rc = os.waitstatus_to_exitcode(status)
    if rc not in (0, 1) or (rc and argv[0] == "sh"):
        raise SystemExit(f"{' '.join(argv)} exited {rc}:\n{err}")
    return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "maxrss_mb": ru.ru_maxrss / 1024, "rc": rc}


def compile_bytecode(src: Path) -> None:
    """``src/dsckpt``'s modules compiled to ``__pycache__`` (git-ignored), as ``pip install`` compiles them."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(src / "dsckpt")], check=True,
                   stdout=subprocess.DEVNULL, env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})


def _pythonpath(first: Path) -> str:
    rest = os.environ.get("PYTHONPATH", "")  # e.g. where the lent host's wheels were installed (isal)
    return f"{first}{os.pathsep}{rest}" if rest else str(first)


def cases(ckpt: Path, only: list[str], baseline: Path | None,
          blocks: list[tuple[int, int]]) -> list[tuple[str, list[str], dict[str, str]]]:
    files = tag_files(ckpt)
    env = {**os.environ, "PYTHONPATH": _pythonpath(REPO)}
    out = [("cat", ["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, files)], env)]
    for name in only:
        out.append((name, [sys.executable, "-P", "-m", "dsckpt.cli", *COMMANDS[name], str(ckpt)], env))
        if baseline is not None:
            benv = {**os.environ, "PYTHONPATH": _pythonpath(baseline.resolve())}
            out.append((f"{name} [before]", [sys.executable, "-P", "-m", "dsckpt.cli", *COMMANDS[name], str(ckpt)],
                        benv))
    for kib, compare in blocks:  # the same code with other block sizes (scan_engine's), for every command
        code = (f"import sys, dsckpt.scan_engine as e; e.BLOCK_NBYTES = {kib << 10}; "
                f"e.COMPARE_BLOCK_NUMEL = {compare}; from dsckpt.cli import main; sys.argv[0] = 'dsckpt'; main()")
        for name in only:
            out.append((f"{name} [{kib} KiB, {compare >> 10}K]", [sys.executable, "-P", "-c", code, *COMMANDS[name],
                                                                  str(ckpt)], env))
    return out


def run(ckpt: Path, rounds: int, only: list[str], baseline: Path | None, blocks: list[tuple[int, int]],
        budget_s: float) -> dict[str, list[dict[str, float]]]:
    """Interleaved rounds (forward, backward, ...); no new round once ``budget_s`` has passed (two at least)."""
    cs = cases(ckpt, only, baseline, blocks)
    files = tag_files(ckpt)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in cs}
    t0 = time.perf_counter()
    for r in range(rounds):
        if r >= 2 and time.perf_counter() - t0 > budget_s:
            print(f"  budget of {budget_s:.0f} s spent: {r} rounds", file=sys.stderr, flush=True)
            break
        warm(files)  # once a round: nothing else runs that could evict them
        for name, argv, env in (cs if r % 2 == 0 else cs[::-1]):
            s = measure(argv, env)
            samples[name].append(s)
            print(f"  round {r + 1} {name:26s} {s['wall_s']:6.2f} s  cpu {s['cpu_s']:6.2f} s  "
                  f"{s['maxrss_mb']:6.0f} MB", file=sys.stderr, flush=True)
    return samples


def table(ckpt: Path, samples: dict[str, list[dict[str, float]]]) -> str:
    nbytes = sum(f.stat().st_size for f in tag_files(ckpt))
    cat = statistics.median(s["wall_s"] for s in samples["cat"])
    lines = [f"{ckpt.name}: {nbytes / 1e9:.2f} GB in the tag folder, {len(samples['cat'])} rounds (medians)", "",
             "| command | wall | CPU | peak RSS | × cat | per round (s) |", "|---|---|---|---|---|---|"]
    for name, ss in samples.items():
        wall = statistics.median(s["wall_s"] for s in ss)
        cpu = statistics.median(s["cpu_s"] for s in ss)
        rss = max(s["maxrss_mb"] for s in ss)
        rounds = " / ".join(f"{s['wall_s']:.2f}" for s in ss)
        lines.append(f"| {name} | {wall:.2f} s ({nbytes / wall / 1e9:.1f} GB/s) | {cpu:.2f} s | {rss:.0f} MB | "
                     f"{wall / cat:.2f}× | {rounds} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Per-check costs


def _cpu_ns_per_byte(fn: Callable[[], object], nbytes: int) -> float:
    t0 = time.thread_time()
    fn()
    return (time.thread_time() - t0) * 1e9 / nbytes


def costs(ckpt: Path, block_sizes: list[int]) -> dict[str, dict[str, float]]:
    """ns of CPU per byte of each step of the scan loop (one thread), per block size, and `cat`'s GB/s."""
    from dsckpt.crc import CRC32_IMPL

    path = max(tag_files(ckpt), key=lambda p: p.stat().st_size)
    size = path.stat().st_size
    size -= size % max(block_sizes)
    warm([path])
    out: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    subprocess.run(["cat", str(path)], stdout=subprocess.DEVNULL, check=True)
    cat_wall = time.perf_counter() - t0
    out["cat"] = {"wall_ns_per_byte": cat_wall * 1e9 / size, "GB/s": size / cat_wall / 1e9}
    fd = os.open(path, os.O_RDONLY)
    try:
        for bs in block_sizes:
            out[f"block {bs >> 10} KiB"] = {k: round(v, 4) for k, v in _block_costs(fd, size, bs).items()}
    finally:
        os.close(fd)
    out["crc_impl"] = {"isal": float(CRC32_IMPL == "isal")}
    return out


def _block_costs(fd: int, size: int, bs: int) -> dict[str, float]:
    import numpy as np

    from dsckpt import scan_engine
    from dsckpt.crc import crc32
    from dsckpt.dtypes import from_float32

    mx, mn = np.maximum.reduce, np.minimum.reduce
    buf = np.empty(bs, np.uint8)
    mv = memoryview(buf)
    f32, u16 = buf.view("<f4"), buf.view("<u2")
    tmp16 = np.empty(bs // 2, np.uint16)

    def loop(step: Callable[[], object]) -> None:
        for off in range(0, size, bs):
            os.preadv(fd, [mv], off)
            step()

    row: dict[str, float] = {}
    row["read"] = _cpu_ns_per_byte(lambda: loop(lambda: None), size)
    row["read+crc"] = _cpu_ns_per_byte(lambda: loop(lambda: crc32(mv)), size)
    row["read+fp32 check"] = _cpu_ns_per_byte(lambda: loop(lambda: (mx(f32), mn(f32))), size)
    row["read+16-bit check"] = _cpu_ns_per_byte(
        lambda: loop(lambda: (np.bitwise_and(u16, 0x7F80, out=tmp16), mx(tmp16))), size)
    row["read+crc+fp32 check"] = _cpu_ns_per_byte(lambda: loop(lambda: (crc32(mv), mx(f32), mn(f32))), size)
    row["crc"] = row["read+crc"] - row["read"]
    row["fp32 check (inf/NaN + fp16 overflow)"] = row["read+fp32 check"] - row["read"]
    row["16-bit check"] = row["read+16-bit check"] - row["read"]
    # master vs 16-bit: the engine's own comparison, on a block whose 16-bit copy is the rounded master
    n = scan_engine.COMPARE_BLOCK_NUMEL
    master = np.empty(n, np.float32)
    os.preadv(fd, [memoryview(master).cast("B")], 0)
    master[~np.isfinite(master)] = 0
    lowp = from_float32(master, "bfloat16")
    pool: dict = {}
    reps = max(1, size // (n * 4))
    row["compare (per byte of fp32 + bf16)"] = _cpu_ns_per_byte(
        lambda: [scan_engine._differ(master, lowp, "bfloat16", pool, n) for _ in range(reps)], reps * n * 6)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpts", nargs="+", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline-src", type=Path, default=None)
    ap.add_argument("--only", default="scan-nf,scan,verify")
    ap.add_argument("--costs", action="store_true", help="also measure the per-check costs (one thread)")
    ap.add_argument("--no-costs", dest="costs", action="store_false", help="(the default)")
    ap.add_argument("--blocks", default="256,1024,4096", help="block sizes for --costs, KiB")
    ap.add_argument("--block-variants", default="",
                    help="KIB:NUMEL,...: also time every command with scan_engine.BLOCK_NBYTES = KIB KiB and "
                         "COMPARE_BLOCK_NUMEL = NUMEL elements")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="per checkpoint: no new round after this")
    ap.add_argument("--no-bytecode", dest="bytecode", action="store_false",
                    help="do not compile the dsckpt sources first (every run compiles what it imports, unless cached)")
    ap.add_argument("--report", type=Path, default=None, help="write every sample here (JSON)")
    args = ap.parse_args()
    only = [c for c in args.only.split(",") if c]
    if args.bytecode:
        for src in (REPO, args.baseline_src):
            if src is not None:
                compile_bytecode(src.resolve())
    report: dict = {"host": {"cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
                             "python": platform.python_version(), "load": os.getloadavg(),
                             "bytecode": args.bytecode},
                    "checkpoints": {}}
    for ckpt in (c.resolve() for c in args.ckpts):
        if not (ckpt / "latest").is_file():
            print(f"{ckpt}: no checkpoint (skipped)", flush=True)
            continue
        print(f"{ckpt}:", file=sys.stderr, flush=True)
        samples = run(ckpt, args.rounds, only, args.baseline_src,
                      [(int(v.split(":")[0]), int(v.split(":")[1])) for v in args.block_variants.split(",") if v],
                      args.budget_s)
        entry: dict = {"samples": samples}
        print(table(ckpt, samples), flush=True)
        if args.costs:
            sys.path.insert(0, str(REPO))
            c = costs(ckpt, [int(k) << 10 for k in args.blocks.split(",")])
            entry["costs_ns_per_byte"] = c
            print(f"\nper-check CPU cost, ns per byte (one thread; cat: {c['cat']['GB/s']:.1f} GB/s, "
                  f"{c['cat']['wall_ns_per_byte']:.3f} ns/B wall):")
            for k, row in c.items():
                if k.startswith("block"):
                    print(f"  {k}: " + ", ".join(f"{n} {v:.3f}" for n, v in row.items()))
        report["checkpoints"][str(ckpt)] = entry
        print(flush=True)
        report["host"]["load_after"] = os.getloadavg()
        if args.report:  # after each checkpoint: a later one cut short leaves this one's
            args.report.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
