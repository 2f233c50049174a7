"""Benchmark dsckpt against DeepSpeed's own tools, on this machine, in one run.

    /work/venv/bin/python bench/run.py [--rounds 3] [--results bench/results/results.md]

Every measurement is one subprocess; its wall time comes from ``time.perf_counter`` around it and its
peak RSS from GNU ``/usr/bin/time -f %M`` (``ru_maxrss`` of that process). Rounds are interleaved
(round 1 runs the cases in order, round 2 in reverse, ...) so that noise from other work on the
machine spreads over every case; the table reports medians and ratios of medians measured in the
same run. Before each measurement the input checkpoint is read once (page cache warm) and the output
of the previous one is removed and ``sync`` ed, so no case pays for another's write-back.

Checkpoints come from ``bench/make_checkpoints.py`` (see bench/README.md). Cases whose command does
not exist yet (``dsckpt scan``, ``dsckpt reshard``) are reported as SKIP with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
WORK = OUT / "tmp"
BIN = Path(sys.executable).parent
DSCKPT = str(BIN / "dsckpt")
PY = sys.executable
TIME = "/usr/bin/time"  # GNU time, for peak RSS
PYDEPS = OUT / "pydeps"  # huggingface_hub for zero_to_fp32's sharding path, see bench/README.md

CKPTS = {
    "zero2-200m": OUT / "zero2-200m",
    "zero3-200m": OUT / "zero3-200m",
    "zero2-50m": OUT / "zero2-50m",
    "zero3-50m": OUT / "zero3-50m",
}
MiB = 1024 * 1024


@dataclass(frozen=True)
class Sample:
    wall_s: float
    maxrss_bytes: int
    cpu_s: float = 0.0  # user + system CPU time of the command


@dataclass
class Case:
    name: str
    argv: Callable[[], list[str]]
    warm: Path | None = None  # checkpoint to pull into the page cache first
    output: Path | None = None  # removed before and after each run
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    samples: list[Sample] = field(default_factory=list)
    skip: str | None = None

    @property
    def wall_s(self) -> float:
        return statistics.median(s.wall_s for s in self.samples)

    @property
    def maxrss_bytes(self) -> int:
        return int(statistics.median(s.maxrss_bytes for s in self.samples))

    @property
    def cpu_s(self) -> float:
        return statistics.median(s.cpu_s for s in self.samples)


def warm_cache(path: Path) -> None:
    buf = bytearray(16 * MiB)
    view = memoryview(buf)
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.readinto(view):
                    pass


def timed(cmd: list[str], out: Path) -> tuple[float, int]:
    """Wall seconds and peak RSS (KB) of ``cmd`` with this checkout's dsckpt (:func:`measure`: GNU time, or a small
    wait4 wrapper where GNU time is missing, as on the lent hosts); ``out`` is removed afterwards."""
    s = measure(cmd, {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    remove(out)
    return s.wall_s, s.maxrss_bytes // 1024


def remove(path: Path | None) -> None:
    if path is None:
        return
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


# Where GNU time is missing (the GPU hosts), a few lines of Python in a bare interpreter (``-S``, only ``os``;
# ~9 MB resident) fork the command and read its rusage from ``wait4``: the same small-parent argument holds.
_RUSAGE_WRAPPER = """
import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, ru = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{ru.ru_maxrss} {ru.ru_utime} {ru.ru_stime}")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def measure(argv: list[str], env: dict[str, str], cwd: Path | None = None) -> Sample:
    # Peak RSS comes from GNU time, not from os.wait4 here: Linux carries a process's RSS
    # high-water mark across fork+exec, so a child forked from this (large) Python process would
    # report at least this process's RSS. GNU time is small, so its child's figure is the command's.
    with tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r") as rss:
        full_env = {**os.environ, **env}
        if os.access(TIME, os.X_OK):
            wrapped = [TIME, "-f", "%M %U %S", "-o", rss.name, *argv]
        else:
            wrapped = [PY, "-S", "-c", _RUSAGE_WRAPPER, rss.name, *argv]
        t0 = time.perf_counter()
        p = subprocess.run(wrapped, stdout=subprocess.DEVNULL, stderr=err, env=full_env, cwd=cwd)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}:\n{err.read().decode()[-3000:]}")
        maxrss_kib, user_s, sys_s = rss.read().split()[-3:]
    return Sample(wall, int(maxrss_kib) * 1024, float(user_s) + float(sys_s))


def run_case(case: Case) -> None:
    remove(case.output)
    subprocess.run(["sync"], check=True)
    if case.warm is not None:
        warm_cache(case.warm)
    case.samples.append(measure(case.argv(), case.env, case.cwd))
    remove(case.output)
    subprocess.run(["sync"], check=True)


def dsckpt_commands() -> set[str]:
    out = subprocess.run([DSCKPT, "--help"], capture_output=True, text=True, check=True).stdout
    commands, in_commands = set(), False
    for line in out.splitlines():
        if line.startswith("Commands:"):
            in_commands = True
        elif in_commands and line.startswith("  ") and line.strip():
            commands.add(line.split()[0])
    return commands


def command_help(command: str) -> str:
    return subprocess.run([DSCKPT, command, "--help"], capture_output=True, text=True).stdout


# ------------------------------------------------------------------------------------------
# Facts about the checkpoints (read in this process with dsckpt itself)


def checkpoint_facts(path: Path) -> dict[str, int]:
    from dsckpt import parsed_tree
    from dsckpt.checkpoint import open_checkpoint

    c = open_checkpoint(path)
    storages: dict[tuple[Path, str], int] = {}
    for f in c.logical.files:
        if f.suffix == ".pt":
            for _, ref in parsed_tree.walk_tensors(c.cache.tree(f)):
                storages[(ref.storage.path, ref.storage.key)] = ref.storage.nbytes
    return {
        "params": sum(e.numel for e in c.logical.params if e.tied_to is None),
        "largest_fp32_bytes": max(e.numel for e in c.logical.entries) * 4,
        "output_bytes": sum(e.numel for e in c.logical.entries) * 4,
        "tensor_bytes": sum(storages.values()),
        "file_bytes": sum(p.stat().st_size for p in c.logical.tag_dir.rglob("*") if p.is_file()),
    }


def compare_outputs(ours: Path, theirs: Path) -> str:
    """Bitwise comparison of two safetensors files: 'identical' or what differs."""
    import torch
    from safetensors import safe_open

    with safe_open(str(ours), "pt") as a, safe_open(str(theirs), "pt") as b:
        if set(a.keys()) != set(b.keys()):
            return f"different names: {sorted(set(a.keys()) ^ set(b.keys()))[:5]}"
        for k in a.keys():
            ta, tb = a.get_tensor(k), b.get_tensor(k)
            same = ta.dtype == tb.dtype and ta.shape == tb.shape and bool(
                torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8)))
            if not same:
                return f"tensor {k} differs"
    return "identical"


# ------------------------------------------------------------------------------------------


def build_cases(commands: set[str], workers: int | None, baseline: Path | None) -> list[Case]:
    cases: list[Case] = []
    if baseline is not None:
        # An older dsckpt (a `git archive` of its dsckpt/ folder) run from source: before/after numbers
        # measured in the same run as everything else.
        for key in ("zero2-200m", "zero3-200m"):
            ckpt, out = CKPTS[key], WORK / f"{key}-before.safetensors"
            cases.append(Case(f"to-fp32 {key} [before]", lambda c=ckpt, o=out: [
                PY, "-m", "dsckpt.cli", "to-fp32", str(c), str(o), "-q"], warm=ckpt, output=out,
                env={"PYTHONPATH": str(baseline)}, cwd=baseline))
            rout = WORK / f"resharded-{key}-before"
            cases.append(Case(f"reshard {key} 2->4 [before]", lambda c=ckpt, o=rout: [
                PY, "-m", "dsckpt.cli", "reshard", str(c), str(o), *reshard_args()], warm=ckpt, output=rout,
                env={"PYTHONPATH": str(baseline)}, cwd=baseline))
            if key == "zero3-200m":  # the 2->4 reshard of the other layout, by this dsckpt, to compare with
                rnow = WORK / f"resharded-{key}"
                cases.append(Case(f"reshard {key} 2->4", lambda c=ckpt, o=rnow: [
                    DSCKPT, "reshard", str(c), str(o), *reshard_args()], warm=ckpt, output=rnow))
    wflag = ["--workers", str(workers)] if workers is not None else []
    ds_env = {"PYTHONPATH": str(PYDEPS)} if PYDEPS.exists() else {}
    for key in ("zero2-200m", "zero3-200m", "zero2-50m", "zero3-50m"):
        ckpt = CKPTS[key]
        if not ckpt.exists():
            continue
        ours = WORK / f"{key}.safetensors"
        theirs = WORK / f"{key}-ds"
        cases.append(Case(f"to-fp32 {key}", lambda c=ckpt, o=ours: [DSCKPT, "to-fp32", str(c), str(o), "-q",
                                                                     *wflag], warm=ckpt, output=ours))
        if key.endswith("-200m"):  # the same command with the CRC-32 checks of the records read turned off
            nocrc = WORK / f"{key}-nocrc.safetensors"
            cases.append(Case(f"to-fp32 {key} [no CRC]", lambda c=ckpt, o=nocrc: [
                DSCKPT, "to-fp32", str(c), str(o), "-q", *wflag], warm=ckpt, output=nocrc,
                env={"DSCKPT_NO_CRC": "1"}))
        cases.append(Case(f"zero_to_fp32 {key}", lambda c=ckpt, o=theirs: [
            PY, "-m", "deepspeed.utils.zero_to_fp32", str(c), str(o), "--safe_serialization"],
            warm=ckpt, output=theirs, env=ds_env))
    scan_ckpt = CKPTS["zero2-200m"]
    scan = Case("scan zero2-200m", lambda: [DSCKPT, "scan", str(scan_ckpt), "-q"], warm=scan_ckpt)
    scan3 = Case("scan zero3-200m", lambda: [DSCKPT, "scan", str(CKPTS["zero3-200m"]), "-q"],
                 warm=CKPTS["zero3-200m"])
    for c in (scan, scan3):
        if "scan" not in commands:
            c.skip = "'dsckpt scan' does not exist yet (not in 'dsckpt --help')"
    cases += [scan, scan3]
    if baseline is not None:  # scan and verify before/after, in the same rounds
        before = {"PYTHONPATH": str(baseline)}
        for key in ("zero2-200m", "zero3-200m"):
            ckpt = CKPTS[key]
            cases.append(Case(f"scan {key} [before]", lambda c=ckpt: [PY, "-m", "dsckpt.cli", "scan", str(c), "-q"],
                              warm=ckpt, env=before, cwd=baseline))
            cases.append(Case(f"verify {key}", lambda c=ckpt: [DSCKPT, "verify", str(c)], warm=ckpt))
            cases.append(Case(f"verify {key} [before]", lambda c=ckpt: [PY, "-m", "dsckpt.cli", "verify", str(c)],
                              warm=ckpt, env=before, cwd=baseline))

    reshard_out = WORK / "resharded"
    cp_out = WORK / "copied"
    reshard = Case("reshard zero2-200m 2->4", lambda: [DSCKPT, "reshard", str(scan_ckpt), str(reshard_out),
                                                       *reshard_args()], warm=scan_ckpt, output=reshard_out)
    if "reshard" not in commands:
        reshard.skip = "'dsckpt reshard' does not exist yet (not in 'dsckpt --help')"
    cases.append(reshard)
    cases.append(Case("cp -r zero2-200m", lambda: ["cp", "-r", str(scan_ckpt), str(cp_out)], warm=scan_ckpt,
                      output=cp_out))
    for i in range(5):
        cases.append(Case(f"dsckpt --help #{i}", lambda: [DSCKPT, "--help"]))
    cases.append(Case("python -c 'import torch'", lambda: [PY, "-c", "import torch"]))
    return cases


def reshard_args() -> list[str]:
    """2 -> 4 ranks: a real re-partition, writing about as many bytes as the source holds. The
    command's default verification (re-reading the output) is part of what is timed."""
    return ["--world-size", "4", "-q"]


def fmt_s(x: float) -> str:
    return f"{x:.2f} s" if x >= 0.1 else f"{x * 1000:.0f} ms"


def fmt_mb(x: float) -> str:
    return f"{x / 1e6:,.0f} MB"


def verdict(ok: bool) -> str:
    return "**PASS**" if ok else "**FAIL**"


def machine_facts(path: Path) -> dict:
    """What the results tables say about the machine (``path``: where the outputs were written)."""
    import socket

    import torch

    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except Exception:  # noqa: BLE001 - any failure to import it: report "?"
        ds_version = "?"
    disk = shutil.disk_usage(path)
    return {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "disk_gb": round(disk.total / 1e9), "disk_free_gb": round(disk.free / 1e9), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "deepspeed": ds_version,
            "host": socket.gethostname()}


def write_section(results: Path, key: str, text: str) -> None:
    """Replace this script's part of results.md (between its markers), keeping the rest."""
    begin, end = f"<!-- {key}: begin -->", f"<!-- {key}: end -->"
    old = results.read_text() if results.exists() else ""
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    if begin in old and end in old:
        new = old[:old.index(begin)] + block + old[old.index(end) + len(end) + 1:]
    else:
        new = old.rstrip() + ("\n\n" if old else "") + block
    results.write_text(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--results", type=Path, default=HERE / "results" / "results.md")
    ap.add_argument("--workers", type=int, default=None, help="pass --workers N to dsckpt to-fp32")
    ap.add_argument("--only", default=None, help="comma-separated substrings of case names to run")
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="folder holding an older dsckpt package (e.g. from `git archive`), timed as [before]")
    args = ap.parse_args()

    missing = [k for k in ("zero2-200m", "zero3-200m") if not CKPTS[k].exists()]
    if missing:
        sys.exit(f"missing checkpoints {missing}; generate them first (see bench/README.md)")
    WORK.mkdir(parents=True, exist_ok=True)
    commands = dsckpt_commands()
    cases = build_cases(commands, args.workers, args.baseline_src)
    if args.only:
        keys = args.only.split(",")
        cases = [c for c in cases if any(k in c.name for k in keys)]
    active = [c for c in cases if c.skip is None]

    facts = {k: checkpoint_facts(p) for k, p in CKPTS.items() if p.exists()}
    # One untimed run of each pair first: warms disk/page cache and checks both outputs agree.
    checks: dict[str, str] = {}
    for key in facts:
        ours, theirs = WORK / f"{key}.safetensors", WORK / f"{key}-ds"
        pair = [c for c in active if c.output in (ours, theirs)]
        if len(pair) == 2:
            for c in pair:
                remove(c.output)
                measure(c.argv(), c.env, c.cwd)
            checks[key] = compare_outputs(ours, theirs / "model.safetensors")
            remove(ours)
            remove(theirs)
            print(f"check {key}: dsckpt output vs zero_to_fp32 output: {checks[key]}", file=sys.stderr)

    scan_bytes: dict[str, int] = {}
    for c in active:
        if c.name.startswith("scan ") and not c.name.endswith("[before]"):
            key = c.name.split()[1]
            rep = subprocess.run([DSCKPT, "scan", str(CKPTS[key]), "--json", "-q"], capture_output=True, text=True)
            scan_bytes[key] = int(json.loads(rep.stdout)["nbytes_read"])

    t_start = time.time()
    for r in range(args.rounds):
        order = active if r % 2 == 0 else list(reversed(active))
        for c in order:
            run_case(c)
            s = c.samples[-1]
            print(f"round {r + 1}/{args.rounds}  {c.name:32s} {s.wall_s:8.3f} s  {s.cpu_s:6.2f} s CPU  "
                  f"{s.maxrss_bytes / 1e6:8.0f} MB",
                  file=sys.stderr, flush=True)
    shutil.rmtree(WORK, ignore_errors=True)
    elapsed = time.time() - t_start

    by = {c.name: c for c in cases}
    rows: list[tuple[str, str, str, str, str, str]] = []

    def have(*names: str) -> bool:
        return all(n in by and by[n].samples for n in names)

    for key in ("zero2-200m", "zero3-200m"):
        a, b = f"to-fp32 {key}", f"zero_to_fp32 {key}"
        if have(a, b):
            ours, theirs = by[a], by[b]
            speed = theirs.wall_s / ours.wall_s
            rss = ours.maxrss_bytes / theirs.maxrss_bytes
            rows.append((f"to-fp32 vs zero_to_fp32, {key} time", fmt_s(ours.wall_s), fmt_s(theirs.wall_s),
                         f"{speed:.1f}× faster", "≥ 4× faster", verdict(speed >= 4)))
            rows.append((f"to-fp32 vs zero_to_fp32, {key} peak RSS", fmt_mb(ours.maxrss_bytes),
                         fmt_mb(theirs.maxrss_bytes), f"{rss:.2f}×", "≤ 0.25×", verdict(rss <= 0.25)))
    for key in ("zero2-200m", "zero3-200m"):
        a, b = f"to-fp32 {key}", f"to-fp32 {key} [before]"
        if have(a, b):
            rows.append((f"  to-fp32 {key}: now vs before ({args.baseline_src.name if args.baseline_src else ''})",
                         f"{fmt_s(by[a].wall_s)}, {fmt_mb(by[a].maxrss_bytes)}",
                         f"{fmt_s(by[b].wall_s)}, {fmt_mb(by[b].maxrss_bytes)}",
                         f"{by[b].wall_s / by[a].wall_s:.1f}× faster, {by[a].maxrss_bytes / by[b].maxrss_bytes:.2f}× RSS",
                         "", ""))
    for key in ("zero2-200m", "zero3-200m"):
        a, b = f"reshard {key} 2->4", f"reshard {key} 2->4 [before]"
        if have(a, b):
            rows.append((f"  reshard {key} 2->4: now vs before ({args.baseline_src.name if args.baseline_src else ''})",
                         f"{fmt_s(by[a].wall_s)}, {fmt_mb(by[a].maxrss_bytes)}",
                         f"{fmt_s(by[b].wall_s)}, {fmt_mb(by[b].maxrss_bytes)}",
                         f"{by[a].wall_s / by[b].wall_s:.2f}× the time", "not slower", verdict(
                             by[a].wall_s <= 1.1 * by[b].wall_s)))
    for key in ("zero2-200m", "zero3-200m"):
        a, b = f"to-fp32 {key}", f"to-fp32 {key} [no CRC]"
        if have(a, b):
            ratio = by[a].wall_s / by[b].wall_s
            rows.append((f"to-fp32 {key}: CRC-32 checks on vs off (`DSCKPT_NO_CRC=1`)",
                         f"{fmt_s(by[a].wall_s)} (CPU {fmt_s(by[a].cpu_s)})",
                         f"{fmt_s(by[b].wall_s)} (CPU {fmt_s(by[b].cpu_s)})",
                         f"{(ratio - 1) * 100:+.0f}% time, {by[a].cpu_s - by[b].cpu_s:+.2f} s CPU", "≤ +10% time",
                         verdict(ratio <= 1.10)))
    torch_rss = by["python -c 'import torch'"].maxrss_bytes if have("python -c 'import torch'") else None
    for stage in ("zero2", "zero3"):
        small, big = f"to-fp32 {stage}-50m", f"to-fp32 {stage}-200m"
        if have(small, big):
            s, b = by[small].maxrss_bytes, by[big].maxrss_bytes
            largest = facts[f"{stage}-200m"]["largest_fp32_bytes"]
            grow = facts[f"{stage}-200m"]["output_bytes"] - facts[f"{stage}-50m"]["output_bytes"]
            # Flat: the 4x larger model (same largest tensor) may cost at most a quarter of its largest
            # tensor more, i.e. noise; anything proportional to the model would be ~grow.
            ok = b - s <= largest / 4
            rows.append((f"to-fp32 peak RSS 50M → 200M params ({stage})", f"{fmt_mb(s)} → {fmt_mb(b)}",
                         f"output {fmt_mb(facts[f'{stage}-50m']['output_bytes'])} → "
                         f"{fmt_mb(facts[f'{stage}-200m']['output_bytes'])}",
                         f"{(b - s) / 1e6:+,.0f} MB for +{grow / 1e6:,.0f} MB of output",
                         f"growth ≤ ¼ largest tensor ({fmt_mb(largest / 4)})", verdict(ok)))
            ds_s, ds_b = f"zero_to_fp32 {stage}-50m", f"zero_to_fp32 {stage}-200m"
            if have(ds_s, ds_b):
                rows.append((f"  zero_to_fp32 peak RSS 50M → 200M ({stage}), for reference", "",
                             f"{fmt_mb(by[ds_s].maxrss_bytes)} → {fmt_mb(by[ds_b].maxrss_bytes)}", "", "", ""))
    for name, key in (("scan zero2-200m", "zero2-200m"), ("scan zero3-200m", "zero3-200m")):
        c = by.get(name)
        if c is None:
            continue
        if c.skip:
            rows.append((f"scan {key} throughput (page cache)", "SKIP", "", c.skip, "≥ 1 GB/s", "SKIP"))
        elif c.samples:
            nbytes = scan_bytes[key]
            gbps = nbytes / c.wall_s / 1e9
            rows.append((f"scan {key} throughput (page cache, whole command)", fmt_s(c.wall_s),
                         f"{fmt_mb(nbytes)} of tensors read", f"{gbps:.2f} GB/s", "≥ 1 GB/s",
                         verdict(gbps >= 1)))
    rc = by.get("reshard zero2-200m 2->4")
    if rc is not None and rc.skip:
        rows.append(("reshard zero2-200m vs cp -r", "SKIP", fmt_s(by["cp -r zero2-200m"].wall_s)
                     if have("cp -r zero2-200m") else "", rc.skip, "≤ 2× cp -r", "SKIP"))
    elif have("reshard zero2-200m 2->4", "cp -r zero2-200m"):
        ratio = rc.wall_s / by["cp -r zero2-200m"].wall_s  # type: ignore[union-attr]
        rows.append(("reshard zero2-200m vs cp -r", fmt_s(rc.wall_s), fmt_s(by["cp -r zero2-200m"].wall_s),  # type: ignore[union-attr]
                     f"{ratio:.2f}× cp -r", "≤ 2× cp -r", verdict(ratio <= 2)))
    for a in ("scan zero2-200m", "scan zero3-200m", "verify zero2-200m", "verify zero3-200m"):
        b = f"{a} [before]"
        if have(a, b):
            rows.append((f"  {a}: now vs before ({args.baseline_src.name if args.baseline_src else ''})",
                         f"{fmt_s(by[a].wall_s)} (CPU {fmt_s(by[a].cpu_s)}), {fmt_mb(by[a].maxrss_bytes)}",
                         f"{fmt_s(by[b].wall_s)} (CPU {fmt_s(by[b].cpu_s)}), {fmt_mb(by[b].maxrss_bytes)}",
                         f"{by[a].wall_s / by[b].wall_s:.2f}× time", "not slower", ""))
    helps = [s.wall_s for c in cases if c.name.startswith("dsckpt --help") for s in c.samples]
    if helps:
        med = statistics.median(helps)
        rows.append(("`dsckpt --help` start-up", fmt_s(med), "", f"median of {len(helps)}", "< 0.3 s",
                     verdict(med < 0.3)))
    if torch_rss is not None:
        rows.append(("baseline: `python -c 'import torch'`", fmt_s(by["python -c 'import torch'"].wall_s),
                     fmt_mb(torch_rss), "peak RSS of the import alone", "", ""))

    m = machine_facts(OUT)
    machine = (f"{m['cpus']} CPU cores ({m['processor']}), {m['mem_gib']} GiB RAM, "
               f"disk {m['disk_gb']} GB ({m['disk_free_gb']} GB free), Linux {m['kernel']}, "
               f"Python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}; shared with other jobs")
    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M %Z')} by `bench/run.py --rounds {args.rounds}"
        + (f" --only '{args.only}'" if args.only else "")
        + (f" --baseline-src {args.baseline_src}" if args.baseline_src else "") + "`"
        + (f" (to-fp32 with `--workers {args.workers}`)" if args.workers is not None else "")
        + f": medians of {args.rounds} interleaved rounds, {elapsed:.0f} s in all.",
        "",
        f"Machine: {machine}.",
        "",
        "Checkpoints (bf16, Adam, 2 ranks, written by DeepSpeed on CPU with `bench/make_checkpoints.py`): "
        + "; ".join(f"{k}: {v['params'] / 1e6:.0f}M params, {v['file_bytes'] / 1e9:.2f} GB on disk"
                    for k, v in facts.items()) + ".",
        "",
        "Output check (one untimed run each): "
        + ("; ".join(f"{k}: dsckpt vs zero_to_fp32 safetensors {v}" for k, v in checks.items()) or "not run")
        + ".",
        "",
        "| measurement | dsckpt | reference | ratio | target | result |",
        "|---|---|---|---|---|---|",
        *[f"| {' | '.join(r)} |" for r in rows],
        "",
    ]
    paired = [c for c in cases if c.samples and (f"{c.name} [before]" in by or c.name.endswith("[before]"))]
    if paired:  # every round of the before/after pairs, in the order they ran
        lines += ["Every round (wall time):", "", "| case | rounds | median |", "|---|---|---|",
                  *[f"| {c.name} | {' / '.join(f'{x.wall_s:.2f}' for x in c.samples)} s | {fmt_s(c.wall_s)} |"
                    for c in sorted(paired, key=lambda c: c.name)], ""]
    text = "\n".join(lines)
    write_section(args.results, "run", text)  # bench/scale.py owns another section of the file
    print(text)


if __name__ == "__main__":
    main()
