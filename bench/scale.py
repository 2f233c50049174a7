"""Scale benchmark: dsckpt on a 1B-parameter checkpoint against DeepSpeed's tools and the machine's floors.

One command per ZeRO stage on a many-core host (the lent GPU machines: 16 cores, 128 GB RAM, local disk), with
DeepSpeed installed there from wheels (see bench/README.md, "Scale"):

    python3 bench/scale.py run --stage 2 --params 1B --small 200M --ranks 8 --rounds 3 --report zero2.json
    python3 bench/scale.py run --stage 3 ...                                             --report zero3.json
    python3 bench/scale.py report zero2.json zero3.json --results bench/results/results.md

``run`` writes both checkpoints with real DeepSpeed on ``--ranks`` CPU ranks (``bench/make_checkpoints.py``),
then times, with one subprocess per measurement and interleaved rounds (medians reported):

* dsckpt ``to-fp32``, ``scan --nonfinite``, ``verify`` and ``reshard`` to half the ranks;
* the anchor: DeepSpeed's ``zero_to_fp32`` (once; its output is compared with dsckpt's bit for bit);
* the floors: an fsync'd write of the output's size (``dd conv=fsync``), a page-cache read of every file the
  command reads (``cat``), and ``cp -r`` of the checkpoint;
* ``--workers`` curves (one round each) and the same commands on the ``--small`` checkpoint, for the
  flat-memory check.

Peak RSS and CPU time come from ``bench/run.py``'s ``measure`` (GNU time, or a small fork/wait4 wrapper).
Before every measurement the input is read once (page cache warm), the previous output is removed and
``sync`` ed. ``report`` turns the JSON files into the table in ``bench/results/results.md`` with the targets' verdicts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import (
    DSCKPT,
    PY,
    Sample,
    checkpoint_facts,
    compare_outputs,
    fmt_mb,
    fmt_s,
    machine_facts,
    measure,
    remove,
    verdict,
    warm_cache,
    write_section,
)

MiB = 1024 * 1024
SECTION = "scale"  # the part of bench/results/results.md this script owns

# Targets (issue 12), as ratios measured in one run on one machine
TO_FP32_VS_WRITE = 1.2
SCAN_GBPS, SCAN_RSS = 4.0, 150e6
VERIFY_GBPS = 3.0
RESHARD_VS_CP = 1.3


def log(msg: str) -> None:
    print(f"[scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def generate(params: str, stage: int, ranks: int, out: Path) -> float:
    """Write a checkpoint with real DeepSpeed on ``ranks`` CPU ranks; returns the seconds it took."""
    if (out / "latest").exists():
        return 0.0
    remove(out)
    launcher = Path(PY).parent / "deepspeed"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    t0 = time.perf_counter()
    proc = subprocess.run([str(launcher) if launcher.exists() else "deepspeed", "--num_gpus", str(ranks),
                           "--master_port", str(free_port()), str(HERE / "make_checkpoints.py"), "--params", params,
                           "--stage", str(stage), "--out", str(out)], env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not (out / "latest").exists():
        raise SystemExit(f"DeepSpeed could not write {out}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    took = time.perf_counter() - t0
    log(f"wrote {out.name} in {took:.0f} s: " + next((ln for ln in proc.stdout.splitlines() if "wrote" in ln), ""))
    return took


def tag_files(ckpt: Path) -> list[Path]:
    tag = (ckpt / "latest").read_text().strip()
    return sorted(p for p in (ckpt / tag).rglob("*") if p.is_file() and p.suffix == ".pt")


def json_of(argv: list[str]) -> dict:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


class Bench:
    """Runs measurements and rewrites the JSON report after each one, so a run cut short keeps what it measured."""

    def __init__(self, report: Path, header: dict):
        self.report, self.header = report, header
        self.samples: dict[str, list[Sample]] = {}

    def save(self, **extra: object) -> None:
        self.header.update(extra)
        data = {**self.header, "samples": {k: [asdict(s) for s in v] for k, v in self.samples.items()}}
        self.report.write_text(json.dumps(data, indent=1) + "\n")

    def once(self, name: str, argv: list[str], *, warm: Path | None = None, output: Path | None = None,
             env: dict[str, str] | None = None, keep: bool = False) -> Sample:
        remove(output)
        subprocess.run(["sync"], check=True)
        if warm is not None:
            warm_cache(warm)
        s = measure(argv, env or {})
        if not keep:
            remove(output)
            subprocess.run(["sync"], check=True)
        self.samples.setdefault(name, []).append(s)
        self.save()
        log(f"{name:44s} {s.wall_s:8.2f} s  {s.cpu_s:7.2f} s CPU  {s.maxrss_bytes / 1e6:8.0f} MB")
        return s


def main_cases(args: argparse.Namespace, big: Path, facts: dict, work: Path,
               to_half: int) -> list[tuple[str, list[str], Path | None, Path | None, dict[str, str] | None]]:
    """(name, argv, checkpoint to warm first, output to remove, environment) of the measurements taken in
    every round. With ``--baseline-src``, ``scan`` also runs from that dsckpt source (``[before]``),
    interleaved with the others; ``[zlib CRC]`` cases run this code with ``DSCKPT_CRC=zlib``."""
    files = [str(p) for p in tag_files(big)]
    out_blocks = math.ceil(facts["big"]["output_bytes"] / (16 * MiB))
    streams = 8
    per_stream = math.ceil(facts["big"]["pt_bytes"] / streams / (16 * MiB))
    floor_out, floor_dir = work / "floor.bin", work / "floor"
    ours, resh, copied = work / "ours.safetensors", work / "resharded", work / "copied"
    reshard = [DSCKPT, "reshard", str(big), str(resh), "-n", str(to_half), "-q"]
    scan = [DSCKPT, "scan", "--nonfinite", "-q", str(big)]
    before = {"PYTHONPATH": str(Path(args.baseline_src).resolve())} if args.baseline_src else None
    zlib = {"DSCKPT_CRC": "zlib"}  # the standard library's CRC-32 instead of isal's (dsckpt/crc.py)
    cases = [
        ("to-fp32", [DSCKPT, "to-fp32", str(big), str(ours), "-q"], big, ours, None),
        ("write floor (dd conv=fsync, output size)", ["dd", "if=/dev/zero", f"of={floor_out}", "bs=16M",
                                                      f"count={out_blocks}", "conv=fsync", "status=none"], None,
         floor_out, None),
        ("scan --nonfinite", scan, big, None, None),
        ("scan --nonfinite [zlib CRC]", scan, big, None, zlib),
        ("scan --nonfinite [before]", scan, big, None, before),
        ("verify", [DSCKPT, "verify", str(big)], big, None, None),
        ("verify [zlib CRC]", [DSCKPT, "verify", str(big)], big, None, zlib),
        ("read floor (cat, page cache)", ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files], big, None, None),
        (f"reshard {args.ranks}->{to_half}", reshard, big, resh, None),
        # atomic (rename) but not crash-durable: what cp -r gives
        (f"reshard {args.ranks}->{to_half} --no-fsync", [*reshard, "--no-fsync"], big, resh, None),
        ("cp -r", ["cp", "-r", str(big), str(copied)], big, copied, None),
        # the durable copy: what reshard promises (every file fsync'd before the rename)
        ("cp -r + sync", ["sh", "-c", 'cp -r "$1" "$2" && sync', "sh", str(big), str(copied)], big, copied, None),
    ]
    if args.write_streams:
        cases.append((f"write floor ({streams} dd streams, checkpoint size)",
                      ["sh", "-c", (f'mkdir -p "$1" && for i in $(seq {streams}); do dd if=/dev/zero of="$1/$i" '
                       f'bs=16M count={per_stream} conv=fsync status=none & done; wait'), "sh", str(floor_dir)],
                      None, floor_dir, None))
    return [c for c in cases if not c[0].endswith("[before]") or before is not None]


def run_cases(b: Bench, cases: list, only: tuple[str, ...] | None, rounds: int) -> None:
    """Every case once per round, the order reversed every other round (noise spreads over all cases)."""
    def wanted(name: str) -> bool:  # a prefix, or an exact name ending in "$"
        return only is None or any(name == o[:-1] if o.endswith("$") else name.startswith(o) for o in only)

    cases = [c for c in cases if wanted(c[0])]
    for r in range(rounds):
        for name, argv, warm, output, env in (cases if r % 2 == 0 else cases[::-1]):
            if name == "to-fp32" and r == 0 and name in b.samples:
                continue  # round 1's sample is the one taken beside zero_to_fp32
            b.once(name, argv, warm=warm, output=output, env=env)


def run(args: argparse.Namespace) -> None:
    out = Path(args.out).resolve()
    work = out / "tmp"
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    st = args.stage
    big, small = out / f"zero{st}-{args.params.lower()}", out / f"zero{st}-{args.small.lower()}"
    only = tuple(args.only.split(",")) if args.only else None  # a partial run: these main cases, nothing else
    gen = {"big": generate(args.params, st, args.ranks, big)}
    facts = {"big": checkpoint_facts(big)}
    if only is None:
        gen["small"] = generate(args.small, st, args.ranks, small)
        facts["small"] = checkpoint_facts(small)
    for k, f in facts.items():
        f["pt_bytes"] = sum(p.stat().st_size for p in tag_files(big if k == "big" else small))
    log(f"facts: {facts}")
    b = Bench(Path(args.report), {
        "stage": st, "ranks": args.ranks, "rounds": args.rounds, "params": args.params, "small": args.small,
        "generate_s": gen, "facts": facts, "machine": machine_facts(out), "date": time.strftime("%Y-%m-%d %H:%M %Z")})
    to_half = max(1, args.ranks // 2)

    ours, theirs = work / "ours.safetensors", work / "zero_to_fp32"
    if only is not None:
        b.save(to_half=to_half, partial=list(only))  # a run cut short still merges with the stage's full one
        run_cases(b, main_cases(args, big, facts, work, to_half), only, args.rounds)
        b.save(complete=True)
        shutil.rmtree(work, ignore_errors=True)
        return
    # the anchor, once (it is the slow side): timed, and its output compared with dsckpt's bit for bit
    b.once("to-fp32", [DSCKPT, "to-fp32", str(big), str(ours), "-q"], warm=big, output=ours, keep=True)
    # --safe_serialization (like for like) imports huggingface_hub: bench/scale_gpu.sh installs it
    ds_out = theirs / "model.safetensors"
    b.once("zero_to_fp32", [PY, "-m", "deepspeed.utils.zero_to_fp32", str(big), str(theirs), "--safe_serialization"],
           warm=big, output=theirs, keep=True)
    check = compare_outputs(ours, ds_out)
    remove(ours)
    remove(theirs)
    log(f"dsckpt vs zero_to_fp32 ({ds_out.name}): {check}")
    b.save(check=check, anchor_output=ds_out.name, to_half=to_half)

    t0 = time.time()
    run_cases(b, main_cases(args, big, facts, work, to_half), None, args.rounds)
    nbytes = {"scan": json_of([DSCKPT, "scan", "--nonfinite", "--json", "-q", str(big)])["nbytes_read"],
              "verify": json_of([DSCKPT, "verify", "--json", str(big)])["nbytes_read"]}
    b.save(nbytes=nbytes)

    resh = work / "resharded"
    curve = set(args.curve.split(",")) if args.curve else set()
    for w in [0, 1, 2, 4, 8, 16] if curve - {"reshard"} else []:
        if "to-fp32" in curve:
            b.once(f"to-fp32 --workers {w}", [DSCKPT, "to-fp32", str(big), str(ours), "-q", "--workers", str(w)],
                   warm=big, output=ours)
        if "scan" in curve:
            b.once(f"scan --workers {w}", [DSCKPT, "scan", "--nonfinite", "-q", "--workers", str(w), str(big)],
                   warm=big)
        if "verify" in curve:
            b.once(f"verify --workers {w}", [DSCKPT, "verify", "--workers", str(w), str(big)], warm=big)
    for w in ([1, 2, 4, 8, 16] if "reshard" in curve else []):
        b.once(f"reshard --workers {w}", [DSCKPT, "reshard", str(big), str(resh), "-n", str(to_half), "-q",
                                          "--workers", str(w)], warm=big, output=resh)
    # the same commands on the small checkpoint: does memory grow with the model?
    s_ours, s_resh = work / "small.safetensors", work / "small-resharded"
    b.once("small: to-fp32", [DSCKPT, "to-fp32", str(small), str(s_ours), "-q"], warm=small, output=s_ours)
    b.once("small: scan --nonfinite", [DSCKPT, "scan", "--nonfinite", "-q", str(small)], warm=small)
    b.once("small: verify", [DSCKPT, "verify", str(small)], warm=small)
    b.once(f"small: reshard {args.ranks}->{to_half}", [DSCKPT, "reshard", str(small), str(s_resh), "-n",
                                                        str(to_half), "-q"], warm=small, output=s_resh)
    elapsed = time.time() - t0
    shutil.rmtree(work, ignore_errors=True)

    b.save(to_half=to_half, check=check, anchor_output=ds_out.name, nbytes=nbytes, elapsed_s=elapsed,
           complete=True)
    log(f"report: {args.report}")


# ------------------------------------------------------------------------------------------


def med(rep: dict, name: str, key: str = "wall_s") -> float:
    return statistics.median(s[key] for s in rep["samples"][name])


def render(reports: list[dict], note: str = "") -> str:
    m = reports[0]["machine"]
    rows: list[tuple[str, ...]] = []
    for rep in reports:
        st, f = f"ZeRO-{rep['stage']}", rep["facts"]["big"]
        to, wr = med(rep, "to-fp32"), med(rep, "write floor (dd conv=fsync, output size)")
        rows.append((f"{st} to-fp32 vs fsync'd write of its {f['output_bytes'] / 1e9:.2f} GB", fmt_s(to), fmt_s(wr),
                     f"{to / wr:.2f}×", f"≤ {TO_FP32_VS_WRITE}×", verdict(to / wr <= TO_FP32_VS_WRITE)))
        zt = med(rep, "zero_to_fp32")
        rows.append((f"{st} to-fp32 vs zero_to_fp32 (output {rep['check']})",
                     f"{fmt_s(to)}, {fmt_mb(med(rep, 'to-fp32', 'maxrss_bytes'))}",
                     f"{fmt_s(zt)}, {fmt_mb(med(rep, 'zero_to_fp32', 'maxrss_bytes'))}",
                     f"{zt / to:.1f}× faster", "identical output", verdict(rep["check"] == "identical")))
        sc, rd = med(rep, "scan --nonfinite"), med(rep, "read floor (cat, page cache)")
        gbps, rss = rep["nbytes"]["scan"] / sc / 1e9, med(rep, "scan --nonfinite", "maxrss_bytes")
        rows.append((f"{st} scan --nonfinite, {rep['nbytes']['scan'] / 1e9:.1f} GB of tensors",
                     f"{fmt_s(sc)}, {fmt_mb(rss)}", f"cat {fmt_s(rd)} ({f['pt_bytes'] / rd / 1e9:.1f} GB/s)",
                     f"{gbps:.1f} GB/s", f"≥ {SCAN_GBPS:.0f} GB/s, RSS ≤ {SCAN_RSS / 1e6:.0f} MB",
                     verdict(gbps >= SCAN_GBPS and rss <= SCAN_RSS)))
        for case, what in (("scan --nonfinite [zlib CRC]", "with zlib's CRC-32 (`DSCKPT_CRC=zlib`)"),
                           ("scan --nonfinite [before]", "with the code before this change (`[before]`)")):
            if case in rep["samples"]:
                sb = med(rep, case)
                same = rep.get("source", {}).get(case) == rep.get("source", {}).get("scan --nonfinite")
                rows.append((f"{st}   the same {what}, " + ("same rounds" if same else
                             f"in the run of {rep['source'][case]} (not comparable round for round)"),
                             fmt_s(sb), "", f"{rep['nbytes']['scan'] / sb / 1e9:.1f} GB/s", "", ""))
        ve = med(rep, "verify")
        vg = rep["nbytes"]["verify"] / ve / 1e9
        rows.append((f"{st} verify (every record's CRC + consistency), {rep['nbytes']['verify'] / 1e9:.1f} GB",
                     f"{fmt_s(ve)}, {fmt_mb(med(rep, 'verify', 'maxrss_bytes'))}", f"cat {fmt_s(rd)}",
                     f"{vg:.1f} GB/s", f"≥ {VERIFY_GBPS:.0f} GB/s", verdict(vg >= VERIFY_GBPS)))
        if "verify [zlib CRC]" in rep["samples"]:
            vz = med(rep, "verify [zlib CRC]")
            rows.append((f"{st}   the same with zlib's CRC-32 (`DSCKPT_CRC=zlib`), same rounds", fmt_s(vz), "",
                         f"{rep['nbytes']['verify'] / vz / 1e9:.1f} GB/s", "", ""))
        rname = f"reshard {rep['ranks']}->{rep['to_half']}"
        rs, cp = med(rep, rname), med(rep, "cp -r")
        rows.append((f"{st} {rname} ranks (default `--verify quick`)",
                     f"{fmt_s(rs)}, {fmt_mb(med(rep, rname, 'maxrss_bytes'))}", f"cp -r {fmt_s(cp)}",
                     f"{rs / cp:.2f}× cp -r", f"≤ {RESHARD_VS_CP}×", verdict(rs / cp <= RESHARD_VS_CP)))
        if f"{rname} --no-fsync" in rep["samples"]:
            nf = med(rep, f"{rname} --no-fsync")
            rows.append((f"{st} {rname} `--no-fsync` (atomic rename, not crash-durable)",
                         f"{fmt_s(nf)}, {fmt_mb(med(rep, f'{rname} --no-fsync', 'maxrss_bytes'))}",
                         f"cp -r {fmt_s(cp)}", f"{nf / cp:.2f}× cp -r", f"≤ {RESHARD_VS_CP}×",
                         verdict(nf / cp <= RESHARD_VS_CP)))
        if "cp -r + sync" in rep["samples"]:
            cps = med(rep, "cp -r + sync")
            rows.append((f"{st} {rname} vs a durable copy (every output file is fsync'd)", fmt_s(rs),
                         f"cp -r + sync {fmt_s(cps)}", f"{rs / cps:.2f}× cp -r + sync", "", ""))
        par = next((k for k in rep["samples"] if k.startswith("write floor (8 dd")), None)
        if par:
            pw = med(rep, par)
            rows.append((f"{st} {rname} vs writing the checkpoint's size, fsync'd, 8 streams", fmt_s(rs),
                         f"dd ×8 {fmt_s(pw)} ({f['pt_bytes'] / pw / 1e9:.1f} GB/s)", f"{rs / pw:.2f}×", "", ""))
    table = ["| measurement | dsckpt | reference | ratio | target | result |", "|---|---|---|---|---|---|",
             *[f"| {' | '.join(r)} |" for r in rows]]

    mem = ["| command | " + " | ".join(f"ZeRO-{r['stage']} {r['small']} → {r['params']}" for r in reports)
           + " | flat? |", "|---|" + "---|" * len(reports) + "---|"]
    for cmd in ("to-fp32", "scan --nonfinite", "verify", "reshard"):
        cells, flat = [], True
        for rep in reports:
            big_name = cmd if cmd in rep["samples"] else f"reshard {rep['ranks']}->{rep['to_half']}"
            small_name = next(k for k in rep["samples"] if k.startswith(f"small: {cmd}"))
            a, z = med(rep, small_name, "maxrss_bytes"), med(rep, big_name, "maxrss_bytes")
            largest = rep["facts"]["big"]["largest_fp32_bytes"]
            flat &= z - a <= largest / 4
            cells.append(f"{fmt_mb(a)} → {fmt_mb(z)}")
        mem.append(f"| {cmd} | " + " | ".join(cells) + f" | {verdict(flat)} |")

    rounds = []  # every round of the timed cases, so that a median's spread shows
    for rep in reports:
        names = [n for n, v in rep["samples"].items() if len(v) > 1]
        if names:
            rounds += [(f"ZeRO-{rep['stage']}, every round (wall time, in the order measured; "
                        "every second round runs the cases in reverse):"), "",
                       "| case | rounds | median |", "|---|---|---|"]
            for n in names:
                walls = " / ".join(f"{x['wall_s']:.2f}" for x in rep["samples"][n])
                rounds.append(f"| {n} | {walls} s | {fmt_s(med(rep, n))} |")
            rounds.append("")

    curve_cmds = ("to-fp32", "scan", "verify", "reshard")
    curves = []
    for rep in reports:
        ws = sorted({int(k.rsplit(" ", 1)[1]) for k in rep["samples"] if "--workers" in k})
        if not ws:
            continue
        curves += [f"ZeRO-{rep['stage']}, wall time by `--workers` (one run each, in the run of {rep['date']}):", "",
                   "| command | " + " | ".join(str(w) for w in ws) + " |", "|---|" + "---|" * len(ws)]
        for cmd in curve_cmds:
            cells = [fmt_s(med(rep, f"{cmd} --workers {w}")) if f"{cmd} --workers {w}" in rep["samples"] else ""
                     for w in ws]
            if any(cells):
                curves.append(f"| {cmd} | " + " | ".join(cells) + " |")
        curves.append("")

    ckpts = "; ".join(
        f"ZeRO-{r['stage']}: {r['facts']['big']['params'] / 1e9:.2f}B params, {r['facts']['big']['file_bytes'] / 1e9:.1f}"
        f" GB on disk (written in {r['generate_s']['big']:.0f} s), and {r['facts']['small']['params'] / 1e6:.0f}M "
        f"params, {r['facts']['small']['file_bytes'] / 1e9:.1f} GB" for r in reports)
    return "\n".join([
        f"## Scale: {reports[0]['params']} parameters on a {m['cpus']}-core host (`bench/scale.py`)",
        "",
        (f"Measured {reports[0]['date']}: medians of {reports[0]['rounds']} interleaved rounds; "
        "each ratio compares numbers from the same run on the same machine."),
        *[f"ZeRO-{r['stage']}: the rows of {', '.join(f'`{c.rstrip(chr(36))}`' for c in x['cases'])} come from a later run "
          f"({x['date']}, {x.get('rounds', r['rounds'])} interleaved rounds, same kind of host, fresh checkpoint "
          "written by DeepSpeed just before); ratios compare cases of that run only."
          for r in reports for x in r.get("extra_runs", [])],
        "",
        f"Machine: {m['cpus']} CPU cores ({m['processor']}), {m['mem_gib']} GiB RAM, local disk {m['disk_gb']} GB, "
        f"Linux {m['kernel']}, Python {m['python']}, torch {m['torch']}, deepspeed {m['deepspeed']}"
        + (f" ({note})" if note else "") + ".",
        "",
        (f"Checkpoints (bf16, Adam, {reports[0]['ranks']} CPU ranks, written by DeepSpeed with "
        f"`bench/make_checkpoints.py`): {ckpts}."),
        "",
        *table,
        "",
        "Peak RSS as the model grows (same largest tensor, 67 MB in fp32):",
        "",
        *mem,
        "",
        *rounds,
        *curves,
    ])


def merge_reports(reports: list[dict]) -> list[dict]:
    """One report per stage, by stage: a partial run's (``--only``) samples join the stage's full run."""
    full = {r["stage"]: r for r in reports if not r.get("partial")}
    for r in full.values():
        r["source"] = {name: r["date"] for name in r["samples"]}  # which run each case's samples come from
    for r in reports:
        if r.get("partial"):
            base = full[r["stage"]]
            for name, samples in r["samples"].items():
                base["samples"][name] = samples  # ratios stay within one run
                base["source"][name] = r["date"]
            # rounds completed by every case (a run cut short by its time limit has fewer than asked for)
            done = min(len(v) for v in r["samples"].values())
            base.setdefault("extra_runs", []).append({"date": r["date"], "cases": r["partial"], "rounds": done,
                                                      "names": sorted(r["samples"])})
    return [full[k] for k in sorted(full)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--stage", type=int, choices=[1, 2, 3], required=True)
    r.add_argument("--params", default="1B")
    r.add_argument("--small", default="200M")
    r.add_argument("--ranks", type=int, default=8)
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--curve", default="to-fp32,scan,verify,reshard",
                   help="the commands whose --workers curve to measure, comma-separated (one run per count)")
    r.add_argument("--no-curve", dest="curve", action="store_const", const="")
    r.add_argument("--no-write-streams", dest="write_streams", action="store_false",
                   help="leave out the 8 fsync'd dd streams (bench/host_probe.py measures durable writes)")
    r.add_argument("--only", default=None, help="comma-separated name prefixes of the main cases: run just those "
                   "(no anchor, no curves, no small checkpoint); `report` merges the file with the stage's full one")
    r.add_argument("--baseline-src", default=None, help="a folder holding another dsckpt package (e.g. from "
                   "`git archive main dsckpt`): scan also runs from it, as a `[before]` case")
    r.add_argument("--out", default=str(HERE / "out" / "scale"))
    r.add_argument("--report", required=True)
    rp = sub.add_parser("report")
    rp.add_argument("reports", nargs="+")
    rp.add_argument("--results", type=Path, default=HERE / "results" / "results.md")
    rp.add_argument("--machine-note", default="", help="e.g. 'a lent GPU host; the GPU is not used'")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        text = render(merge_reports([json.loads(Path(p).read_text()) for p in args.reports]), args.machine_note)
        write_section(args.results, SECTION, text)
        print(text)


if __name__ == "__main__":
    main()
