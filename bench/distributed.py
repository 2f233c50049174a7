"""Issue 21's measurement: ``--distributed`` with 1, 2, 4 and 8 processes against the one-process command, on one
host, for a 1B-parameter checkpoint, in one run (interleaved rounds, medians).

    python3 bench/distributed.py run --stage 3 --params 1B --ranks 8 --rounds 2 --report dist.json
    python3 bench/distributed.py report dist.json          # the table (markdown) on stdout

``run`` writes the checkpoint with real DeepSpeed on ``--ranks`` CPU ranks (``bench/scale.py``'s ``generate``),
then, for each command (``to-fp32`` to one ``.safetensors``, ``scan --nonfinite``, ``verify``, ``reshard`` to
half the ranks), times the one-process command and ``torchrun --standalone --nproc-per-node P --no-python dsckpt
... --distributed`` for every P, with ``--workers`` = cores / P so that every configuration has the same threads.
Each measurement is a fresh subprocess (torchrun's start-up and torch's import included: that is what a user
pays); the page cache holds the checkpoint (read once before every measurement), the previous output is removed
and ``sync`` ed. Peak RSS is the largest of any one process of the tree (``wait4`` of torchrun: the kernel keeps
the largest descendant's high-water mark), i.e. per-rank memory.

Same bytes: in the first round every output (the ``.safetensors`` file, every file of the resharded folder) and
``scan``/``verify``'s ``--json`` report are compared with the one-process run's, and the result is in the report.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import DSCKPT, PY, measure, remove, warm_cache
from scale import free_port, generate, log

PROCS = tuple(int(p) for p in os.environ.get("DIST_PROCS", "1,2,4,8").split(","))


def torchrun(nproc: int) -> list[str]:
    launcher = Path(PY).parent / "torchrun"
    return [str(launcher) if launcher.exists() else "torchrun", "--standalone", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", "--no-python", DSCKPT]


def digest_tree(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (or of ``path``), by relative name."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    out = {}
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while block := fh.read(1 << 24):
                h.update(block)
        out[str(f.relative_to(path)) if f != path else f.name] = h.hexdigest()
    return out


def run(args: argparse.Namespace) -> None:
    t_start = time.time()
    out = Path(args.out).resolve()
    work = out / "tmp"
    out.mkdir(parents=True, exist_ok=True)
    remove(work)
    work.mkdir()
    big = out / f"zero{args.stage}-{args.params.lower()}"
    gen_s = generate(args.params, args.stage, args.ranks, big)
    cores = os.cpu_count() or 1
    half = max(1, args.ranks // 2)
    st, resh = work / "out.safetensors", work / "resharded"
    commands = {  # name -> (argv after 'dsckpt', output, output of the identity check)
        "to-fp32": (["to-fp32", str(big), str(st), "-q"], st),
        "scan --nonfinite": (["scan", "--nonfinite", "-q", str(big)], None),
        "verify": (["verify", str(big)], None),
        f"reshard {args.ranks}->{half}": (["reshard", str(big), str(resh), "-n", str(half), "-q"], resh),
    }
    # the floor of every --distributed run: torchrun starting P processes that import torch and join a gloo group
    commands["torchrun + gloo start only"] = (["-c", ("import torch.distributed as d; d.init_process_group('gloo'); "
                                               "d.barrier(); d.destroy_process_group()")], None)
    if args.only:
        commands = {k: v for k, v in commands.items() if any(k.startswith(o) for o in args.only.split(","))}
    configs = [("1 process", None)] + [(f"--distributed P={p}", p) for p in PROCS]
    report: dict = {"stage": args.stage, "params": args.params, "ranks": args.ranks, "cores": cores,
                    "generate_s": gen_s, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
                    "checkpoint_bytes": sum(p.stat().st_size for p in big.rglob("*") if p.is_file()),
                    "samples": {}, "same_bytes": {}, "digests": {}}
    rpath = Path(args.report)

    def save() -> None:
        rpath.write_text(json.dumps(report, indent=1) + "\n")

    def argv_of(cmd: list[str], nproc: int | None) -> list[str]:
        if cmd[0] == "-c":  # the start-up floor: no dsckpt
            return [*torchrun(nproc or 1)[:-1], PY, *cmd]
        if nproc is None:
            return [DSCKPT, *cmd]
        return [*torchrun(nproc), *cmd, "--distributed", "--workers", str(max(1, cores // nproc))]

    reference: dict[str, object] = {}
    for r in range(args.rounds):
        if r and time.time() - t_start > args.budget_s:
            log(f"stopping after {r} round(s): {time.time() - t_start:.0f} s used of the {args.budget_s} s budget")
            break
        items = [(c, n) for c in commands.items() for n in configs if c[1][0][0] != "-c" or n[1] is not None]
        reverse = (r + args.reverse_first) % 2 == 1  # interleaved: every other round backwards
        for (name, (cmd, output)), (cfg, nproc) in (items[::-1] if reverse else items):
            remove(output)
            subprocess.run(["sync"], check=True)
            warm_cache(big)
            s = measure(argv_of(cmd, nproc), {"DSCKPT_LEASE_EXPIRY_S": "120"})
            key = f"{name} | {cfg}"
            report["samples"].setdefault(key, []).append(asdict(s))
            log(f"{key:48s} {s.wall_s:8.2f} s  {s.cpu_s:7.2f} s CPU  {s.maxrss_bytes / 1e6:8.0f} MB")
            save()  # before the identity check: a call cut short keeps the sample
            if r == 0 and cmd[0] != "-c":  # same bytes as the one-process run
                if output is not None:
                    got: object = digest_tree(output)
                else:
                    proc = subprocess.run(argv_of([*cmd, "--json"], nproc), capture_output=True, text=True, check=False)
                    got = {"rc": proc.returncode, "stdout_sha256": hashlib.sha256(proc.stdout.encode()).hexdigest()}
                report.setdefault("digests", {})[key] = got
                if nproc is None:
                    reference[name] = got
                elif name in reference:
                    report["same_bytes"][key] = got == reference[name]
                    if got != reference[name]:
                        log(f"DIFFERENT OUTPUT: {key}")
            remove(output)
            subprocess.run(["sync"], check=True)
            save()
    report["elapsed_s"] = time.time() - t_start
    save()
    remove(work)


def merged(paths: list[str]) -> dict:
    """One report from several runs of the same configuration (e.g. one device call per round): samples joined,
    the identity checks of all of them kept."""
    reps = [json.loads(Path(p).read_text()) for p in paths]
    rep = dict(reps[0], samples={}, same_bytes={})
    for r in reps:
        if (r["stage"], r["params"], r["ranks"], r["cores"]) != (rep["stage"], rep["params"], rep["ranks"], rep["cores"]):
            raise SystemExit(f"{paths}: reports of different configurations")
        for k, v in r["samples"].items():
            rep["samples"].setdefault(k, []).extend(v)
        for k, v in r["same_bytes"].items():
            rep["same_bytes"][k] = rep["same_bytes"].get(k, True) and v
    return rep


def table(paths: list[str]) -> str:
    lines = []
    for rep in [merged(paths)]:
        gb = rep["checkpoint_bytes"] / 1e9
        lines.append(f"ZeRO-{rep['stage']}, {rep['params']} params, written by {rep['ranks']} ranks ({gb:.1f} GB); "
                     f"{rep['cores']} cores; {rep['date']}; rounds: "
                     "medians, samples in parentheses\n")
        lines.append("| command | configuration | wall s | vs 1 process | beyond the start-up floor | CPU s | "
                     "peak RSS per process | same bytes |")
        lines.append("|---|---|---|---|---|---|---|---|")
        med: dict[tuple[str, str], dict[str, float]] = {}
        for key, samples in rep["samples"].items():
            name, cfg = key.split(" | ")
            med[(name, cfg)] = {f: statistics.median(s[f] for s in samples) for f in ("wall_s", "cpu_s", "maxrss_bytes")}
            med[(name, cfg)]["n"] = len(samples)
        names = list(dict.fromkeys(n for n, _ in med))
        floor = "torchrun + gloo start only"
        names = [n for n in names if n != floor] + [floor]

        def order(cfg: str) -> int:
            return -1 if cfg == "1 process" else int(cfg.rsplit("=", 1)[1])

        for name in names:
            for cfg in sorted((c for n, c in med if n == name), key=order):
                m = med[(name, cfg)]
                base = med.get((name, "1 process"))
                ratio = f"{m['wall_s'] / base['wall_s']:.2f}x" if base else ""
                fl = med.get((floor, cfg))
                beyond = f"{m['wall_s'] - fl['wall_s']:.2f}" if fl and name != floor else ""
                same = {True: "yes", False: "**no**"}.get(rep["same_bytes"].get(f"{name} | {cfg}"),
                                                          "(reference)" if cfg == "1 process" else "")
                lines.append(f"| {name} | {cfg} | {m['wall_s']:.2f} ({int(m['n'])}) | {ratio} | {beyond} | "
                             f"{m['cpu_s']:.1f} | {m['maxrss_bytes'] / 1e6:.0f} MB | {same} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--stage", type=int, choices=[1, 2, 3], default=3)
    r.add_argument("--params", default="1B")
    r.add_argument("--ranks", type=int, default=8)
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--budget-s", type=float, default=480.0, help="start no new round after this many seconds")
    r.add_argument("--reverse-first", type=int, choices=[0, 1], default=0,
                   help="1: the first round runs backwards (a second device call continuing the interleaving)")
    r.add_argument("--only", default=None, help="comma-separated command name prefixes")
    r.add_argument("--out", default=str(HERE / "out" / "dist"))
    r.add_argument("--report", required=True)
    rp = sub.add_parser("report")
    rp.add_argument("reports", nargs="+")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        print(table(args.reports))


if __name__ == "__main__":
    main()
