"""``--distributed``: one command spread over the processes ``torchrun`` starts, on one host or many.

Launch::

    torchrun --nnodes N --nproc-per-node P --no-python dsckpt <command> ... --distributed

Coordination goes through ``torch.distributed`` (``env://`` from torchrun, the gloo backend: no GPU,
no NCCL). Every rank opens the checkpoint and computes the same plan; the ranks then

* **agree** (:meth:`Group.agree`): one all-gather of a digest of the plan; if the ranks do not hold the
  same plan (a different dsckpt version, a checkpoint that changed between opens, a filesystem that
  shows other files on another host) every rank stops with an error naming the ranks that differ;
* **split** the work by bytes with :func:`split_by_nbytes` (pure, deterministic: every rank computes the
  same assignment without talking);
* do their share, then **exchange** (:meth:`Group.step`): each rank's result *or its failure* is
  all-gathered, so a failure on one rank makes every rank raise :class:`RankFailedError` naming that
  rank, with its exit code; rank 0 alone renders the output.

A rank that dies without a word (SIGKILL, out of memory) breaks the next collective on the others
(gloo reports the closed connection) and torchrun stops the rest with SIGTERM; every rank then exits
non-zero and torchrun's summary names the rank that died.

Importing this module is cheap: torch is imported by :func:`init` only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import EXIT_DISTRIBUTED, EXIT_INTERNAL, DsckptError, UsageError
from .interrupts import received

if TYPE_CHECKING:
    from .readers import FileCache

__all__ = [
    "DistributedError",
    "Group",
    "RankEnv",
    "RankFailedError",
    "detect_env",
    "digest",
    "init",
    "split_by_nbytes",
]

logger = logging.getLogger("dsckpt")

T = TypeVar("T")

LAUNCH_HINT = ("launch it with torchrun, e.g. 'torchrun --nproc-per-node 2 --no-python dsckpt <command> ... "
               "--distributed' (several hosts: torchrun --nnodes N --nproc-per-node P --rdzv-backend c10d "
               "--rdzv-endpoint HEAD:29500 ...), or drop --distributed")

#: How long a collective waits for the slowest rank (env ``DSCKPT_DIST_TIMEOUT_S``). A rank that died is
#: noticed sooner: gloo reports the closed connection, and torchrun stops the others.
DEFAULT_TIMEOUT_S = 1800


class DistributedError(DsckptError):
    """The ranks could not work together (different plans, a lost peer): the environment, not the checkpoint
    and not a dsckpt bug, so its own exit code."""

    exit_code = EXIT_DISTRIBUTED


class RankFailedError(DsckptError):
    """Another rank (or this one) failed; ``exit_code`` is the failing rank's."""

    def __init__(self, message: str, exit_code: int, rank: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.rank = rank


@dataclass(frozen=True)
class RankEnv:
    """What torchrun tells each process (``env://``)."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def detect_env(environ: dict[str, str] | None = None) -> RankEnv | None:
    """The torchrun environment, or None when this process was not started by torchrun (or a launcher
    setting the same variables)."""
    env = os.environ if environ is None else environ
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(env.get(n) for n in names):
        return None
    try:
        return RankEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0")),
                       env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    except ValueError:
        return None


def digest(value: Any) -> str:
    """sha256 of ``value`` as canonical JSON (``repr`` for what JSON cannot hold): the same plan gives the
    same digest on every host."""
    raw = json.dumps(value, sort_keys=True, default=repr, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()


def split_by_nbytes(nbytes: Sequence[int], world_size: int) -> tuple[tuple[int, ...], ...]:
    """Assign work items (``nbytes[i]``: the bytes item ``i`` reads or writes) to ``world_size`` ranks,
    balanced by bytes. Pure and deterministic: ``result[r]`` lists rank ``r``'s item indices, ascending.

    Longest processing time first: items from the largest down (ties: lower index first) each go to the
    rank with the fewest bytes so far (ties: lower rank). The largest rank load is at most 4/3 of the
    best possible (Graham 1969), and never more than the average plus the largest item. Ranks process
    their items in index order, so each one streams its files in plan order."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    load = [0] * world_size
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += nbytes[i]
    return tuple(tuple(sorted(items)) for items in out)


@dataclass(frozen=True)
class _Status:
    ok: bool
    value: Any = None
    message: str = ""
    exit_code: int = 0


class Group:
    """The ranks of one ``--distributed`` run (a gloo process group)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.lost_peer = False  # a collective failed: a rank died or was stopped

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj)
        except RuntimeError as e:
            raise self._lost(e) from e
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (in rank order); None on the others."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.is_root else None
        try:
            dist.gather_object(obj, out, dst=0)
        except RuntimeError as e:
            raise self._lost(e) from e
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        import torch.distributed as dist

        box = [obj if self.is_root else None]
        try:
            dist.broadcast_object_list(box, src=0)
        except RuntimeError as e:
            raise self._lost(e) from e
        return box[0]

    def agree(self, value: Any, what: str) -> None:
        """Check that every rank holds the same ``value`` (a plan, or its digest); raise
        :class:`DistributedError` on every rank otherwise, naming the ranks that differ."""
        mine = digest(value)
        all_digests = self.all_gather(mine)
        if len(set(all_digests)) == 1:
            return
        ref = all_digests[0]
        differ = [r for r, d in enumerate(all_digests) if d != ref]
        raise DistributedError(
            f"the ranks do not agree on {what}: rank(s) {', '.join(map(str, differ))} computed another one than "
            "rank 0. Every rank must see the same files and run the same dsckpt version; check that the "
            "checkpoint is on a filesystem shared by every host and is not being written")

    def step(self, fn: Callable[[], T], what: str) -> list[T]:
        """Run ``fn`` here, then exchange every rank's result or failure; return all results (rank order).

        If ``fn`` raised on any rank, every rank raises :class:`RankFailedError` naming the lowest failing
        rank and carrying its message and exit code. Signals (SIGTERM, Ctrl-C) are not exchanged: they
        propagate at once, and the peers notice the lost rank."""
        try:
            status = _Status(True, fn())
        except DsckptError as e:
            status = _Status(False, message=str(e), exit_code=e.exit_code)
        except (Exception, MemoryError) as e:  # every failure is exchanged; signals are not
            if os.environ.get("DSCKPT_DEBUG"):
                logger.exception("rank %d failed during %s", self.rank, what)
            code = 3 if isinstance(e, OSError) else EXIT_INTERNAL
            status = _Status(False, message=f"{type(e).__name__}: {e}", exit_code=code)
        statuses = self.all_gather(status)
        failed = [(r, s) for r, s in enumerate(statuses) if not s.ok]
        if failed:
            r, s = failed[0]
            others = f" (ranks {', '.join(str(x) for x, _ in failed[1:])} failed too)" if len(failed) > 1 else ""
            raise RankFailedError(f"rank {r} failed during {what}: {s.message}{others}", s.exit_code, r)
        return [s.value for s in statuses]

    def _lost(self, e: BaseException) -> DistributedError:
        self.lost_peer = True
        return _lost_peer(self.rank, e)

    def barrier(self) -> None:
        self.all_gather(None)

    def close(self, timeout_s: float = 30.0) -> None:
        """Leave the process group, rank 0 last.

        Rank 0 hosts the rendezvous store (``MASTER_ADDR:MASTER_PORT``). Had it torn down first, a peer still
        inside ``destroy_process_group`` could lose its connections mid-shutdown and abort (seen once in CI:
        rank 1 of a ``to-dcp --distributed`` ended by SIGABRT after the output was in place). So every other
        rank destroys its group first and then checks in on the store; rank 0 waits for all of them (at most
        ``timeout_s``: a peer that died is not waited for) before destroying its own. Once a collective lost a
        peer, or this process got SIGTERM/SIGHUP (torchrun stopping every rank), rank 0 does not wait: nobody
        will check in, and torchrun kills a rank that outlives its grace period (30 s) before it exits."""
        import time

        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if not dist.is_initialized():
            return
        store = distributed_c10d._get_default_store()  # kept alive past destroy_process_group
        key = "dsckpt/closed"
        if not self.is_root:
            dist.destroy_process_group()
            store.add(key, 1)
            return
        if self.lost_peer or received() is not None:
            timeout_s = 0.0
        deadline = time.monotonic() + timeout_s
        while store.add(key, 0) < self.world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        dist.destroy_process_group()


def _lost_peer(rank: int, e: BaseException) -> DistributedError:
    # gloo: "[.../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:36227. This is typically ..."
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    text = re.sub(r"^\[[^\]]*\.cc:\d+\]\s*", "", text).split(". This is typically")[0]
    return DistributedError(
        f"rank {rank}: lost contact with another rank ({text}); a rank died or was stopped (torchrun's summary "
        "names it); nothing was written")


def init() -> Group:
    """Join the torchrun process group (gloo over ``env://``). Outside torchrun: :class:`UsageError`."""
    env = detect_env()
    if env is None:
        raise UsageError(f"--distributed needs the environment torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, "
                         f"MASTER_PORT); {LAUNCH_HINT}")
    import torch.distributed as dist

    timeout = timedelta(seconds=float(os.environ.get("DSCKPT_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", init_method="env://", rank=env.rank, world_size=env.world_size,
                                timeout=timeout)
    return Group(dist.get_rank(), dist.get_world_size())


# --------------------------------------------------------------------------------------------
# CRC-32 checks of input records read by several ranks


def record_checks(cache: FileCache) -> list[Any]:
    """Every zip record check (:class:`dsckpt.crc.RecordCheck`) of the files ``cache`` has parsed, once
    each, in file then record order (the same list on every rank holding the same plan)."""
    seen: dict[int, Any] = {}
    for ref in cache.tensor_refs():
        check = ref.storage.check
        if check is not None and id(check) not in seen:
            seen[id(check)] = check
    return list(seen.values())


def export_segments(checks: Sequence[Any]) -> dict[tuple[str, str], list[tuple[int, int, int]]]:
    """What this rank read of each record, as CRC-32 segments (``RecordCheck.segments``)."""
    return {(str(c.path), c.record): c.segments() for c in checks if c.touched}


def owned_paths(checks: Sequence[Any], group: Group) -> set[Any]:
    """The files whose records this rank completes: files split over ranks by record bytes."""
    paths = sorted({c.path for c in checks}, key=str)
    sizes = [sum(c.nbytes for c in checks if c.path == p) for p in paths]
    return {paths[i] for i in split_by_nbytes(sizes, group.world_size)[group.rank]}


def owned_checks(checks: Sequence[Any], everyone: Sequence[dict[tuple[str, str], list[tuple[int, int, int]]]],
                 group: Group) -> list[Any]:
    """The checks of the files this rank owns (files split over ranks by size with
    :func:`split_by_nbytes`), completed with every other rank's segments. The caller then finishes
    them (``crc.finish``): only the bytes no rank read are read again, each record by one rank."""
    mine = owned_paths(checks, group)
    out = [c for c in checks if c.path in mine]
    for r, segs in enumerate(everyone):
        if r == group.rank:
            continue
        for c in out:
            for start, end, crc in segs.get((str(c.path), c.record), ()):
                c.add_crc(start, crc, end - start)
    return out
