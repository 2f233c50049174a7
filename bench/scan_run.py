"""`dsckpt scan --all` of a run of N checkpoints against `cat` of the same files, and against `scan` of one checkpoint.

    python bench/scan_run.py BASE_CKPT --out bench/out/run10 [--copies 10] [--rounds 3] [--report out.json]

The run is made from ``BASE_CKPT`` (a DeepSpeed save dir with one tag, e.g. from ``bench/make_checkpoints.py``):
``--copies`` tag folders ``global_step1`` ... ``global_stepN`` in ``--out``, each a byte-for-byte copy of the base
tag's files (real copies, not links: each is its own file in the page cache, as a run's saves are), and ``latest``
naming the last. The same run of half as many copies (``--out``-half) tells whether memory grows with the run.

Measured, in interleaved rounds (forward, then backward), each command a fresh subprocess, every file of the run
read once at the start of each round (page cache warm), wall time from ``perf_counter``, CPU time and peak RSS from
``os.wait4``:

* ``cat`` of every file of every tag (the floor);
* ``dsckpt scan --all -q RUN`` and ``--nonfinite``;
* ``dsckpt scan -q TAG`` of one tag and ``cat`` of that tag's files (the one-checkpoint ratio the run's must match);
* ``dsckpt scan --all -q`` of the half-length run (peak RSS: flat whatever the run's length).

The table gives medians and each command's ratio to the median ``cat`` of the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
from pathlib import Path

from scan import measure as scan_measure  # bench/scan.py, beside this script
from scan import warm

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def make_run(base: Path, out: Path, copies: int) -> Path:
    latest = base / "latest"
    tag = base / latest.read_text().strip() if latest.is_file() else base
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for n in range(1, copies + 1):
        dest = out / f"global_step{n}"
        dest.mkdir()
        for f in sorted(tag.iterdir()):
            if f.is_file():
                shutil.copy2(f, dest / f.name)
    (out / "latest").write_text(f"global_step{copies}")
    return out


def files_of(run: Path) -> list[Path]:
    return sorted(p for p in run.rglob("*.pt"))


def measure(argv: list[str]) -> dict[str, float]:
    """``scan.measure`` with this checkout on ``PYTHONPATH`` (a ``cat`` that fails is an error there too)."""
    return scan_measure(argv, {**os.environ, "PYTHONPATH": str(REPO)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--copies", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", default=None, help="passed to dsckpt scan --workers")
    ap.add_argument("--report", type=Path)
    args = ap.parse_args()

    run = make_run(args.base, args.out, args.copies)
    half = make_run(args.base, args.out.with_name(args.out.name + "-half"), max(1, args.copies // 2))
    one = run / f"global_step{args.copies}"
    all_files, one_files = files_of(run), files_of(one)
    dsckpt = [sys.executable, "-P", "-m", "dsckpt.cli"]
    workers = ["--workers", args.workers] if args.workers is not None else []
    cases = [
        ("cat run", ["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, all_files)], "run"),
        ("scan --all", [*dsckpt, "scan", "--all", "-q", *workers, str(run)], "run"),
        ("scan --all --nonfinite", [*dsckpt, "scan", "--all", "--nonfinite", "-q", *workers, str(run)], "run"),
        ("cat one", ["sh", "-c", 'cat "$@" > /dev/null', "cat", *map(str, one_files)], "one"),
        ("scan one", [*dsckpt, "scan", "-q", *workers, str(one)], "one"),
        ("scan --all (half run)", [*dsckpt, "scan", "--all", "-q", *workers, str(half)], "half"),
    ]
    samples: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in cases}
    for r in range(args.rounds):
        warm(all_files + files_of(half))
        for name, argv, _ in (cases if r % 2 == 0 else cases[::-1]):
            s = measure(argv)
            samples[name].append(s)
            print(f"  round {r + 1} {name:24s} {s['wall_s']:7.2f} s  cpu {s['cpu_s']:7.2f} s  {s['maxrss_mb']:6.0f} MB",
                  file=sys.stderr, flush=True)
    nbytes = {"run": sum(f.stat().st_size for f in all_files), "one": sum(f.stat().st_size for f in one_files),
              "half": sum(f.stat().st_size for f in files_of(half))}
    med = {name: {k: statistics.median(s[k] for s in ss) for k in ("wall_s", "cpu_s", "maxrss_mb")}
           for name, ss in samples.items()}
    cat_of = {"run": med["cat run"]["wall_s"], "one": med["cat one"]["wall_s"],
              "half": med["cat run"]["wall_s"] * nbytes["half"] / nbytes["run"]}
    lines = [f"run of {args.copies} checkpoints ({nbytes['run'] / 1e9:.2f} GB; one checkpoint "
             f"{nbytes['one'] / 1e6:.0f} MB), {args.rounds} rounds (medians), {platform.node()}, "
             f"{os.cpu_count()} cores", "",
             "| command | bytes | wall | CPU | peak RSS | × cat of the same bytes |", "|---|---|---|---|---|---|"]
    for name, _, which in cases:
        m = med[name]
        lines.append(f"| {name} | {nbytes[which] / 1e6:.0f} MB | {m['wall_s']:.2f} s | {m['cpu_s']:.2f} s | "
                     f"{m['maxrss_mb']:.0f} MB | {m['wall_s'] / cat_of[which]:.2f} |")
    ratio_run = med["scan --all"]["wall_s"] / cat_of["run"]
    ratio_one = med["scan one"]["wall_s"] / cat_of["one"]
    lines += ["", f"scan --all / cat = {ratio_run:.2f}; scan of one checkpoint / cat = {ratio_one:.2f}; "
              f"per byte, scan --all / scan one = "
              f"{(med['scan --all']['wall_s'] / nbytes['run']) / (med['scan one']['wall_s'] / nbytes['one']):.2f}",
              f"peak RSS: {args.copies} checkpoints {med['scan --all']['maxrss_mb']:.0f} MB, "
              f"{max(1, args.copies // 2)} checkpoints {med['scan --all (half run)']['maxrss_mb']:.0f} MB, "
              f"one {med['scan one']['maxrss_mb']:.0f} MB"]
    print("\n".join(lines))
    if args.report:
        args.report.write_text(json.dumps({"nbytes": nbytes, "samples": samples, "medians": med}, indent=1))


if __name__ == "__main__":
    main()
