"""Byte-for-byte record of every ``dsckpt reshard`` case over the committed fixtures, to prove a refactor changes
nothing.

Every checkpoint under ``tests/fixtures`` (a folder holding ``latest`` or ``latest_universal``; Lightning run
folders too) is run through the CLI with a list of flag sets: the generic ones for every checkpoint (other
data-parallel sizes up and down, every ``--zero-stage``, ``--universal``, ``--dry-run``, ``--sub-group-size``, the
tensor/pipeline/expert-parallel flags where they must be refused, ``--dtype`` to each precision with and without
``--loss-scale``) and those of its family, told from its files
and name (tensor parallel: ``--tp-size``, ``--make-vocab-size-divisible-by``; pipeline: ``--pp-size``,
``--partition-method``, ``--num-layers``, ``--layer-types``, ``--tied-key``; native MoE and AutoEP: ``--ep-size``;
Trainer/Accelerate folders: ``--no-hf-files``), plus NVMe targets (the source's config edited to NVMe offload, as
``tests/test_offload.py`` does, swap threshold 64 bytes) and chains (an output resharded again: NVMe and stage-0
sources). New fixtures are picked up by these rules.

Each case records the exit code, stdout, stderr (temporary paths replaced by ``<OUT>``/``<TMP>``, the repository by
``<REPO>``), an exception's type and text if one escaped click, and the sha256 of every file written, by path
relative to OUT. Cases run in-process through click's ``CliRunner`` in a small process pool.

    python bench/reshard_bytes.py record bench/out/reshard-base.json      # at the commit before a refactor
    python bench/reshard_bytes.py check bench/out/reshard-base.json       # after each commit: record + compare
    python bench/reshard_bytes.py compare A.json B.json                   # two records
    python bench/reshard_bytes.py list [-k SUBSTR]                        # the cases

``check`` and ``compare`` print every difference and exit 1 on any (0 when identical). ``-k SUBSTR`` keeps the
cases whose id contains SUBSTR; ``--jobs N`` processes (default 2).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"

# the layer list of tests/test_reshard_pipeline.py's pipeline fixtures and of the Megatron tensor x pipeline ones
PP_LAYER_TYPES = "Embedding[embed],Linear,BatchNormPipe,ReLU,FrozenLinear,Linear,Embedding[embed]"
TP_PP_LAYER_TYPES = "EmbeddingPipe[embed],BlockPipe,BlockPipe,FinalLayerNorm,EmbeddingPipe[embed]"


@dataclass(frozen=True)
class Case:
    id: str
    src: str  # relative to the repository, or "@<case id>" for the output of another case
    args: tuple[str, ...]
    nvme: bool = False  # the source's ds_config edited to NVMe offload (tests/test_offload.py's _as_nvme)
    then: tuple[Case, ...] = field(default=())  # cases reading this case's output


# --------------------------------------------------------------------------------------------
# The cases, from the fixtures present


def checkpoints() -> list[Path]:
    """Every checkpoint folder under tests/fixtures, sorted (site-packages shims left out)."""
    found = set()
    for p in FIXTURES.rglob("latest*"):
        if p.name in ("latest", "latest_universal") and p.is_file() and "site-packages" not in p.parts:
            found.add(p.parent)
    return sorted(found)


def run_folders(ckpts: list[Path]) -> list[Path]:
    """Lightning ``dirpath`` folders (a parent of ``*.ckpt`` checkpoint folders): resolved by the CLI."""
    return sorted({c.parent for c in ckpts if c.name.endswith(".ckpt")})


def _tag_files(ckpt: Path) -> list[str]:
    latest = ckpt / "latest"
    tag = latest.read_text().strip() if latest.is_file() else None
    tag_dir = ckpt / tag if tag and (ckpt / tag).is_dir() else None
    return sorted(p.name for p in tag_dir.iterdir()) if tag_dir is not None else []


def family(ckpt: Path) -> set[str]:
    rel = str(ckpt.relative_to(FIXTURES))
    files = _tag_files(ckpt)
    fam = set()
    if any(re.fullmatch(r"layer_\d+(-model_\d+)?-model_states\.pt", f) for f in files):
        fam.add("pp")
    if re.search(r"(^|_)tp\d|megatron", rel):
        fam.add("tp")
    if "megatron" in rel:
        fam.add("megatron")
    if any("expert_" in f for f in files) or "autoep" in rel:
        fam.add("ep")
    if (ckpt / "trainer_state.json").exists() or any(p.name.startswith("random_states_") for p in ckpt.iterdir()):
        fam.add("hf")
    if "offload" in rel or re.search(r"(^|/)s3_", rel):
        fam.add("nvme")
    if (ckpt / "latest_universal").exists():
        fam.add("universal")
    return fam


GENERIC: list[tuple[str, ...]] = [
    ("-n", "1"), ("-n", "2"), ("-n", "3"), ("-n", "4", "--dry-run"), ("-n", "3", "--dry-run"),
    *[("-n", "2", "--zero-stage", str(s)) for s in range(4)],
    *[("-n", "3", "--zero-stage", str(s), "--dry-run") for s in range(4)],
    ("-n", "1", "--zero-stage", "3"), ("-n", "4", "--zero-stage", "1"),
    ("--universal",), ("--universal", "--dry-run"),
    ("-n", "4", "--zero-stage", "3", "--sub-group-size", "40"), ("-n", "2", "--sub-group-size", "40"),
    ("-n", "2", "--verify", "full"), ("-n", "3", "--no-verify"),
    ("--universal", "-n", "2"), ("-q",),
]
NOT_TP = [("-n", "4", "--tp-size", "2"), ("-n", "2", "--make-vocab-size-divisible-by", "8")]
NOT_PP = [("-n", "4", "--pp-size", "2"), ("-n", "2", "--partition-method", "uniform")]
NOT_EP = [("-n", "2", "--ep-size", "2")]
TP = [
    ("-n", "1", "--tp-size", "1"), ("-n", "2", "--tp-size", "1", "--zero-stage", "3"),
    ("-n", "2", "--tp-size", "1", "--zero-stage", "0"), ("-n", "4", "--tp-size", "4"),
    ("-n", "8", "--tp-size", "4", "--dry-run"), ("-n", "4", "--tp-size", "2"), ("-n", "4", "--tp-size", "1"),
    ("-n", "4", "--tp-size", "2", "--zero-stage", "3"), ("-n", "4", "--tp-size", "2", "--zero-stage", "0"),
    ("-n", "4", "--tp-size", "4", "--make-vocab-size-divisible-by", "8"),
    ("-n", "1", "--tp-size", "1", "--make-vocab-size-divisible-by", "16"),
    ("-n", "2", "--tp-size", "2", "--make-vocab-size-divisible-by", "2"),
    ("-n", "3", "--tp-size", "3"), ("-n", "2", "--tp-size", "4"),
]
PP = [
    ("-n", "1", "--pp-size", "1"), ("-n", "2", "--pp-size", "1"), ("-n", "4", "--pp-size", "1"),
    ("-n", "4", "--pp-size", "4"), ("-n", "4", "--pp-size", "4", "--partition-method", "uniform"),
    ("-n", "4", "--pp-size", "4", "--partition-method", "uniform", "--num-layers", "7", "--dry-run"),
    ("-n", "2", "--pp-size", "2", "--partition-method", "parameters", "--num-layers", "7"),
    ("-n", "4", "--pp-size", "4", "--partition-method", "type:Linear", "--layer-types", PP_LAYER_TYPES),
    ("-n", "4", "--pp-size", "1", "--partition-method", "type:BlockPipe", "--layer-types", TP_PP_LAYER_TYPES),
    ("-n", "2", "--pp-size", "1", "--partition-method", "type:BlockPipe", "--layer-types", TP_PP_LAYER_TYPES),
    ("-n", "4", "--pp-size", "4", "--partition-method", "type:Linear"),
    ("-n", "4", "--zero-stage", "0"), ("-n", "4", "--zero-stage", "2"), ("-n", "4", "--zero-stage", "0",
                                                                          "--pp-size", "4", "--partition-method",
                                                                          "uniform"),
    ("-n", "4", "--tied-key", "0=embed"), ("-n", "2", "--tied-key", "0=embed", "--zero-stage", "1"),
    ("-n", "4", "--tied-key", "0=embed", "--pp-size", "4", "--partition-method", "uniform"),
    ("-n", "2", "--tied-key", "0=embed", "--pp-size", "1", "--partition-method", "uniform"),
    ("--universal", "--tied-key", "0=embed"), ("-n", "2", "--tied-key", "5=embed"),
    ("-n", "8", "--pp-size", "2", "--tp-size", "4"), ("-n", "2", "--pp-size", "1", "--tp-size", "1",
                                                      "--partition-method", "uniform"),
    ("-n", "8", "--pp-size", "1", "--tp-size", "4", "--partition-method", "type:BlockPipe", "--layer-types",
     TP_PP_LAYER_TYPES),
    ("-n", "4", "--pp-size", "1", "--zero-stage", "0", "--partition-method", "type:BlockPipe", "--layer-types",
     TP_PP_LAYER_TYPES),
]
EP = [
    ("-n", "2", "--ep-size", "1"), ("-n", "2", "--ep-size", "2"), ("-n", "4", "--ep-size", "2"),
    ("-n", "4", "--ep-size", "4"), ("-n", "4", "--ep-size", "1"), ("-n", "1", "--ep-size", "1"),
    ("-n", "4", "--ep-size", "4", "--zero-stage", "3"), ("-n", "2", "--ep-size", "1", "--zero-stage", "0"),
    ("-n", "4", "--ep-size", "2", "--zero-stage", "1", "--dry-run"), ("-n", "3", "--ep-size", "3"),
    ("-n", "8", "--ep-size", "8"), ("--universal", "--ep-size", "2"),
]
TP_PP = [  # a tensor x pipeline run: every rank count a multiple of TP x stages
    ("-n", "8"), ("-n", "8", "--tp-size", "4"), ("-n", "8", "--tp-size", "1", "--pp-size", "4", "--partition-method",
                                                  "uniform"),
    ("-n", "4", "--tp-size", "4", "--pp-size", "1", "--partition-method", "type:BlockPipe", "--layer-types",
     TP_PP_LAYER_TYPES),
    ("-n", "8", "--zero-stage", "0"), ("-n", "4", "--tp-size", "1", "--zero-stage", "0"), ("-n", "8", "--dry-run"),
]
# another precision (--dtype, ds_writers/precision.py): written where DeepSpeed trains the layout in it, refused by
# name elsewhere (stage 0, pipeline, TP, MoE, --universal), --loss-scale's usage errors
DTYPE = [("-n", "2", "--dtype", "fp32"), ("-n", "2", "--dtype", "bf16"), ("-n", "3", "--dtype", "fp16", "--zero-stage", "3"),
         ("-n", "2", "--dtype", "fp16", "--loss-scale", "1024"), ("-n", "3", "--dtype", "bf16", "--dry-run"),
         ("-n", "2", "--dtype", "bf16", "--loss-scale", "8"), ("--universal", "--dtype", "fp16")]
HF = [("-n", "2", "--no-hf-files"), ("-n", "1", "--no-hf-files", "--zero-stage", "1"), ("-n", "3", "--dry-run",
                                                                                          "--no-hf-files")]
NVME = [("-n", "2", "--zero-stage", "3"), ("-n", "3", "--zero-stage", "3", "--sub-group-size", "16")]
NVME_THEN = [("-n", "1",), ("-n", "3", "--zero-stage", "2"), ("--universal",), ("-n", "2", "--zero-stage", "3")]
STAGE0_THEN = [("-n", "2", "--zero-stage", "1"), ("-n", "1",), ("--universal",)]


def _id(src: str, args: tuple[str, ...], nvme: bool = False) -> str:
    return f"{src}{' [nvme]' if nvme else ''} :: {' '.join(args)}"


def all_cases() -> list[Case]:
    ckpts = checkpoints()
    cases: list[Case] = []
    for ckpt in ckpts:
        rel = str(ckpt.relative_to(REPO))
        fam = family(ckpt)
        flag_sets = list(GENERIC) + DTYPE
        flag_sets += TP if "tp" in fam else NOT_TP
        flag_sets += PP if "pp" in fam else NOT_PP
        flag_sets += EP if "ep" in fam else NOT_EP
        flag_sets += HF if "hf" in fam else []
        flag_sets += TP_PP if {"tp", "pp"} <= fam else []
        for args in flag_sets:
            then: tuple[Case, ...] = ()
            if args == ("-n", "2", "--zero-stage", "0") and "pp" not in fam and "tp" not in fam and "ep" not in fam:
                parent = _id(rel, args)
                then = tuple(Case(_id("@" + parent, a), "@" + parent, a) for a in STAGE0_THEN)
            cases.append(Case(_id(rel, args), rel, args, then=then))
        if "nvme" in fam and not fam & {"pp", "tp", "ep", "universal"}:
            for args in NVME:
                parent = _id(rel, args, nvme=True)
                then = tuple(Case(_id("@" + parent, a), "@" + parent, a, nvme=True) for a in NVME_THEN)
                cases.append(Case(parent, rel, args, nvme=True, then=then))
    for folder in run_folders(ckpts):
        rel = str(folder.relative_to(REPO))
        for args in [("-n", "1"), ("-n", "2", "--zero-stage", "3"), ("--universal",)]:
            cases.append(Case(_id(rel, args), rel, args))
    return cases


def flat(cases: list[Case]) -> Iterator[Case]:
    for c in cases:
        yield c
        yield from flat(list(c.then))


# --------------------------------------------------------------------------------------------
# Running one case (in a worker process)


def _digest(root: Path) -> dict[str, str]:
    out = {}
    if root.is_dir():
        for p in sorted(root.rglob("*")):
            if p.is_file():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# the temporary folder OUT is written in before its rename (dsckpt.atomic: pid, host and a random part)
_ATOMIC_TMP = re.compile(r"(/\.out\d+)\.[^/'\"\s]*?\.tmp(?=[/'\"\s:]|$)")


def _normalize(text: str, tmp: Path) -> str:
    for path, name in ((tmp, "<TMP>"), (REPO, "<REPO>")):
        text = text.replace(str(path), name)
        text = text.replace(os.path.realpath(path), name)
    return _ATOMIC_TMP.sub(r"\1.<ATOMIC>.tmp", text)


def _run(case: Case, tmp: Path, outputs: dict[str, Path]) -> dict[str, object]:
    from click.testing import CliRunner

    import dsckpt.readers as readers
    from dsckpt import nvme_swap
    from dsckpt.cli import main

    src = outputs[case.src[1:]] if case.src.startswith("@") else REPO / case.src
    out = tmp / f"out{len(outputs)}"
    outputs[case.id] = out
    real_read = readers.read_checkpoint
    real_min = nvme_swap.MIN_AIO_BYTES
    if case.nvme:
        from dataclasses import replace

        def read_nvme(path, *a, **kw):  # type: ignore[no-untyped-def]
            ckpt = real_read(path, *a, **kw)
            if Path(path).resolve() == src.resolve():
                cfg = json.loads(json.dumps(ckpt.ds_config))
                cfg["zero_optimization"]["offload_optimizer"] = {"device": "nvme", "nvme_path": "/local_nvme"}
                ckpt = replace(ckpt, ds_config=cfg)
            return ckpt

        readers.read_checkpoint = read_nvme  # type: ignore[assignment]
        nvme_swap.MIN_AIO_BYTES = 64
    try:
        result = CliRunner().invoke(main, ["reshard", str(src), str(out), *case.args, "--workers", "1"])
    finally:
        readers.read_checkpoint = real_read  # type: ignore[assignment]
        nvme_swap.MIN_AIO_BYTES = real_min
    exc = result.exception
    rec: dict[str, object] = {
        "exit_code": result.exit_code,
        "stdout": _normalize(result.stdout.replace(str(out), "<OUT>"), tmp),
        "stderr": _normalize(result.stderr.replace(str(out), "<OUT>"), tmp),
        "exception": None if exc is None or isinstance(exc, SystemExit) else f"{type(exc).__name__}: "
                                                                             f"{_normalize(str(exc), tmp)}",
        "files": _digest(out),
    }
    return rec


def _run_tree(case: Case) -> list[tuple[str, dict[str, object], float]]:
    results = []
    outputs: dict[str, Path] = {}
    with tempfile.TemporaryDirectory(prefix="reshard-bytes-") as d:
        todo = [case]
        while todo:
            c = todo.pop(0)
            t = time.perf_counter()
            rec = _run(c, Path(d), outputs)
            results.append((c.id, rec, time.perf_counter() - t))
            todo.extend(c.then)
    return results


def _import_all() -> None:
    """Import every dsckpt module now: a module first imported by a case would be read from disk mid-run (an edit
    made while the harness runs would leak into the record)."""
    import importlib
    import pkgutil

    import dsckpt

    for m in pkgutil.walk_packages(dsckpt.__path__, "dsckpt."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)


def record(cases: list[Case], jobs: int) -> dict[str, dict[str, object]]:
    import multiprocessing as mp

    recs: dict[str, dict[str, object]] = {}
    slow: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    if jobs <= 1:
        results = map(_run_tree, cases)
        for tree in results:
            for cid, rec, dt in tree:
                recs[cid] = rec
                slow.append((dt, cid))
    else:
        ctx = mp.get_context("fork")
        with ctx.Pool(jobs) as pool:
            for tree in pool.imap_unordered(_run_tree, cases, chunksize=4):
                for cid, rec, dt in tree:
                    recs[cid] = rec
                    slow.append((dt, cid))
    n_write = sum(1 for r in recs.values() if r["files"])
    print(f"{len(recs)} cases ({n_write} wrote files, {len(recs) - n_write} wrote nothing: refusals and dry runs) "
          f"in {time.perf_counter() - t0:.0f} s with {jobs} process(es); slowest: "
          + ", ".join(f"{dt:.1f} s {cid}" for dt, cid in sorted(slow, reverse=True)[:3]), file=sys.stderr)
    return dict(sorted(recs.items()))


def compare(a: dict[str, dict[str, object]], b: dict[str, dict[str, object]]) -> int:
    """Print every difference between two records; the number of cases that differ."""
    bad = 0
    for cid in sorted(set(a) | set(b)):
        if cid not in a or cid not in b:
            print(f"{'only in first' if cid in a else 'only in second'}: {cid}")
            bad += 1
            continue
        ra, rb = a[cid], b[cid]
        diffs = []
        for key in ("exit_code", "stdout", "stderr", "exception"):
            va, vb = (_ATOMIC_TMP.sub(r"\1.<ATOMIC>.tmp", v) if isinstance(v, str) else v for v in (ra[key], rb[key]))
            if va != vb:
                diffs.append(f"  {key}:\n    - {ra[key]!r}\n    + {rb[key]!r}")
        fa, fb = ra["files"], rb["files"]
        assert isinstance(fa, dict) and isinstance(fb, dict)
        for f in sorted(set(fa) | set(fb)):
            if fa.get(f) != fb.get(f):
                diffs.append(f"  file {f}: {fa.get(f, 'absent')} -> {fb.get(f, 'absent')}")
        if diffs:
            bad += 1
            print(f"DIFF {cid}")
            print("\n".join(diffs))
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["record", "check", "compare", "list"])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("-k", dest="match", default=None, help="only the cases whose id contains this")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--save", type=Path, default=None, help="check: also write the new record here")
    ap.add_argument("--src", type=Path, default=REPO,
                    help="the folder whose dsckpt/ package runs the cases (default: this checkout), e.g. a "
                         "`git archive` of the commit before a refactor; the fixtures are always this checkout's")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(args.src.resolve()))
    import dsckpt  # imported before the pool forks, so that every case runs the same code

    print(f"dsckpt from {Path(dsckpt.__file__).parent}", file=sys.stderr)
    _import_all()
    cases = all_cases()
    if args.match:
        cases = [c for c in cases if any(args.match in x.id for x in flat([c]))]
    if args.mode == "list":
        for c in flat(cases):
            print(c.id)
        print(f"{sum(1 for _ in flat(cases))} cases", file=sys.stderr)
        return 0
    if args.mode == "compare":
        if len(args.files) != 2:
            ap.error("compare takes two records")
        a, b = (json.loads(p.read_text()) for p in args.files)
        bad = compare(a, b)
        print(f"{bad} of {len(set(a) | set(b))} cases differ" if bad else f"identical: {len(a)} cases")
        return 1 if bad else 0
    if len(args.files) != 1:
        ap.error(f"{args.mode} takes one record file")
    recs = record(cases, args.jobs)
    if args.mode == "record":
        args.files[0].parent.mkdir(parents=True, exist_ok=True)
        args.files[0].write_text(json.dumps(recs, indent=1, sort_keys=True) + "\n")
        return 0
    if args.save is not None:
        args.save.write_text(json.dumps(recs, indent=1, sort_keys=True) + "\n")
    base = json.loads(args.files[0].read_text())
    if args.match:
        base = {k: v for k, v in base.items() if k in recs}
    bad = compare(base, recs)
    print(f"{bad} of {len(set(base) | set(recs))} cases differ" if bad else f"identical: {len(recs)} cases")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
