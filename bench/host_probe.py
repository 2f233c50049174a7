"""Host probe behind the issue-12 second pass: what bounds ``scan`` and a durable ``reshard`` on the 16-core host.

    python3 bench/host_probe.py --dir /tmp/probe --gb 12 --report probe.json

No checkpoint and no DeepSpeed: synthetic bf16 bytes (finite values, so the cheap path of the non-finite check
runs, as on a healthy checkpoint), read from the page cache and written to the local disk.

* ``scan-like``: threads (and processes) each ``preadv`` 2 MiB chunks into a buffer of their own, CRC-32 them and
  run the exponent-bits check of ``dsckpt.scan_engine._nonfinite``. The CRC comes from ``zlib`` (CPython's, which links
  the system zlib) or from ``isal`` (ISA-L); GB/s by thread count shows whether the CRC or the GIL bounds scan.
* ``write``: the checkpoint's size written as 8 streams (16 MiB writes from memory) by
  ``buffered`` (no fsync: what ``cp -r`` costs), ``buffered+fsync``, and ``O_DIRECT`` (+ fsync) with 4, 8 and 16
  streams; plus ``cp -r`` and ``cp -r && sync`` of the data. Shows whether a durable write can come near ``cp -r``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing
import os
import shutil
import subprocess
import threading
import time
import zlib
from pathlib import Path

import numpy as np

CHUNK = 2 << 20
WRITE = 16 << 20
FILE_GB = 1


def make_data(d: Path, gb: int) -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    block = (np.random.default_rng(0).standard_normal(32 << 20, dtype=np.float32).view(np.uint32) >> 16)
    block = block.astype(np.uint16).tobytes()  # 64 MiB of finite bf16
    files = []
    for i in range(gb):
        p = d / f"part{i:02d}.bin"
        with open(p, "wb") as f:
            f.writelines(block for _ in range((FILE_GB << 30) // len(block)))
        files.append(p)
    return files


def chunks(files: list[Path]) -> list[tuple[Path, int]]:
    out = []
    for p in files:
        size = p.stat().st_size
        out += [(p, off) for off in range(0, size, CHUNK)]
    return out


def crc_impl(name: str):
    if name == "isal":
        from isal import isal_zlib

        return isal_zlib.crc32
    return zlib.crc32


def scan_worker(todo: list[tuple[Path, int]], crc_name: str) -> int:
    crc32 = crc_impl(crc_name)
    buf = np.empty(CHUNK // 2, dtype=np.uint16)
    tmp = np.empty_like(buf)
    view = buf.view(np.uint8).data.cast("B")
    fds: dict[Path, int] = {}
    bad = 0
    for path, off in todo:
        fd = fds.get(path)
        if fd is None:
            fd = fds[path] = os.open(path, os.O_RDONLY)
        n = os.preadv(fd, [view], off)
        crc32(view[:n])
        np.bitwise_and(buf, 0x7F80, out=tmp)
        bad += int(tmp.max()) == 0x7F80
    for fd in fds.values():
        os.close(fd)
    return bad


def start_join(workers: list) -> float:
    """Start every thread or process, wait for all; the seconds it took."""
    t0 = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - t0


def scan_parallel(all_chunks: list[tuple[Path, int]], n: int, crc_name: str, *, processes: bool = False) -> float:
    """``n`` threads (or forked processes) each scanning every ``n``-th chunk."""
    make = multiprocessing.get_context("fork").Process if processes else threading.Thread
    return start_join([make(target=scan_worker, args=(all_chunks[i::n], crc_name)) for i in range(n)])


def write_streams(out: Path, total: int, streams: int, mode: str) -> float:
    out.mkdir(parents=True, exist_ok=True)
    per = total // streams // WRITE * WRITE
    src = mmap.mmap(-1, WRITE)  # page-aligned, as O_DIRECT needs
    src.write(os.urandom(1 << 20) * (WRITE >> 20))

    def one(i: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        if mode == "direct":
            flags |= os.O_DIRECT
        fd = os.open(out / f"w{i:02d}", flags, 0o644)
        try:
            for off in range(0, per, WRITE):
                os.pwrite(fd, src, off)
            if mode != "buffered":
                os.fsync(fd)
        finally:
            os.close(fd)

    return start_join([threading.Thread(target=one, args=(i,)) for i in range(streams)])


def timed(cmd: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, shell=True, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--gb", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--report", type=Path, required=True)
    a = ap.parse_args()
    res: dict[str, list[float]] = {}

    def add(key: str, v: float) -> None:
        res.setdefault(key, []).append(round(v, 3))
        print(f"{key}: {v:.2f} s", flush=True)

    data = a.dir / "data"
    files = make_data(data, a.gb)
    subprocess.run("sync", shell=True, check=True)
    nbytes = sum(p.stat().st_size for p in files)
    todo = chunks(files)
    timed(f"cat {data}/* > /dev/null")
    add("read floor (cat)", timed(f"cat {data}/* > /dev/null"))
    for _ in range(a.rounds):
        for crc in ("zlib", "isal"):
            for n in (1, 4, 8, 12, 16):
                add(f"scan-like {crc} {n} threads", scan_parallel(todo, n, crc))
            add(f"scan-like {crc} 8 processes", scan_parallel(todo, 8, crc, processes=True))
    out = a.dir / "out"
    for _ in range(a.rounds):
        for mode, streams in (("buffered", 8), ("buffered+fsync", 8), ("direct", 4), ("direct", 8), ("direct", 16)):
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run("sync", shell=True, check=True)
            add(f"write {mode} x{streams}", write_streams(out, nbytes, streams, mode))
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run("sync", shell=True, check=True)
        add("cp -r", timed(f"cp -r {data} {out}"))
        add("sync after cp -r", timed("sync"))
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run("sync", shell=True, check=True)
    summary = {k: {"median_s": sorted(v)[len(v) // 2], "rounds": v, "GB/s": round(nbytes / 1e9 / sorted(v)[len(v) // 2], 2)}
               for k, v in res.items()}
    a.report.write_text(json.dumps({"bytes": nbytes, "nproc": os.cpu_count(), "results": summary}, indent=1))
    for k, v in summary.items():
        print(f"{k:32s} {v['median_s']:7.2f} s  {v['GB/s']:6.2f} GB/s")
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
