"""What issue 29's and 34's checks add to a command, measured in-process where they run (no subprocess noise).

    PYTHONPATH=. /work/venv/bin/python bench/hostile_overhead.py [--repeat 20] [bench/out/zero2-200m ...]

For each checkpoint: the time of ``read_checkpoint`` as ``to-fp32`` calls it (every check on), and of each
check alone on the same parsed files -- the opcode pre-scan of every pickle (``pickle_scan.prescan``, issue 34: it
runs before each pickle is parsed, so its cost scales with pickle bytes, not tensor bytes), the tree budgets
(``parsed_tree.check_tree``), the validation layer
(``validate.validate_tree``), rank identity (``same_save.rank_identity_problems``) and the sampled fp32-master
vs module-copy comparison (``same_save.sampled_copy_disagreements``) -- as medians of ``--repeat`` runs. Compare
the sum with the command's wall time from ``bench/run.py`` (the issue's target: <= 5% on the 200M benchmark).
"""

from __future__ import annotations

import argparse
import statistics
import time
import zipfile
from pathlib import Path

from dsckpt import parsed_tree
from dsckpt.pickle_scan import prescan
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.readers.same_save import rank_identity_problems, sampled_copy_disagreements
from dsckpt.validate import validate_tree

HERE = Path(__file__).resolve().parent


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(ckpt: Path, repeat: int) -> str:
    """One table row: the costs of the checks on one checkpoint."""
    def read() -> tuple[object, FileCache]:
        cache = FileCache()
        return read_checkpoint(ckpt, cache=cache, check_master_copies=True), cache

    logical, cache = read()
    files = list(logical.files)  # type: ignore[attr-defined]
    trees = {f: cache.tree(f) for f in files}
    pkl = sum(r[2] for f in files for r in cache.infos[f].records if r[0] == "data.pkl")
    pickles = []
    for f in files:
        with zipfile.ZipFile(f) as zf:
            pickles += [(f, zf.read(n)) for n in zf.namelist() if n.endswith("data.pkl")]
    t_read = median_s(read, repeat)
    t_scan = median_s(lambda: [prescan(data, f) for f, data in pickles], repeat)
    t_tree = median_s(lambda: [parsed_tree.check_tree(trees[f], f) for f in files], repeat)
    t_valid = median_s(lambda: [validate_tree(f, trees[f]) for f in files], repeat)
    t_ident = median_s(lambda: rank_identity_problems(files, cache.infos), repeat)
    t_sample = median_s(lambda: sampled_copy_disagreements(logical, cache), repeat)
    total = t_scan + t_tree + t_valid + t_ident + t_sample
    return (f"| {ckpt.name} | {t_read * 1e3:.1f} ms | {t_scan * 1e3:.2f} ms | {t_tree * 1e3:.2f} ms | {t_valid * 1e3:.2f} ms | "
            f"{t_ident * 1e3:.3f} ms | {t_sample * 1e3:.2f} ms | {total * 1e3:.1f} ms | {len(files)} | {pkl:,} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ckpts", nargs="*", type=Path, default=[HERE / "out" / "zero2-200m", HERE / "out" / "zero3-200m"])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    print("| checkpoint | read_checkpoint, all checks | pickle pre-scan | check_tree | validate_tree | rank identity | "
          "master vs copy sample | checks in all | files | pickle bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ckpt in args.ckpts:
        print(_row(ckpt, args.repeat))


if __name__ == "__main__":
    main()
