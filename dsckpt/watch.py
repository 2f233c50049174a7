"""Scan a run's checkpoints as they are saved, in a background process that training never waits for.

Used by ``dsckpt watch RUN`` and by the framework callbacks (:mod:`dsckpt.callbacks`). Three parts:

* :class:`SkipAhead` -- the pure decision of what to scan next: one scan at a time, and while one runs only the
  newest checkpoint offered waits for the next turn. An older one offered meanwhile is *skipped* (reported as
  such, never queued), so a scan slower than the save interval never builds a backlog;
* :class:`BackgroundScanner` -- one scanner process (``python -m dsckpt.scan_worker``, a plain subprocess: no
  fork of a training process with its threads and accelerator state, no re-import of a training script that
  lacks a ``__main__`` guard) at low priority and one thread, fed one checkpoint at a time by a daemon thread
  of the caller's process. The scanner process starts a checkpoint only once it is complete (every rank file
  written: :func:`dsckpt.scan_record.completeness_problem`), writes the scan record beside it
  (:func:`dsckpt.scan_record.write_record`), which ``scan --all`` reuses while the files are unchanged, and
  reuses a valid record itself. :meth:`BackgroundScanner.offer` and :meth:`BackgroundScanner.outcomes` never
  block;
* :func:`watch_run` -- the loop of ``dsckpt watch``: list the run's checkpoints every ``interval_s`` seconds,
  offer the complete ones, hand back outcomes.

The library never prints: outcomes are records (:class:`Outcome`); the CLI and the callbacks render them.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

__all__ = [
    "BackgroundScanner",
    "Outcome",
    "Saved",
    "SkipAhead",
    "Status",
    "watch_run",
]

WORKER_NICE = 10  # the scanner yields the CPU to training ranks (CPU runs; on GPUs it hardly competes)


@dataclass(frozen=True)
class Saved:
    """A checkpoint offered for scanning: its path (a tag folder, a Trainer ``checkpoint-N``, a Lightning
    ``.ckpt``) and its global step where known (None: ordered by when it was offered)."""

    path: Path
    step: int | None = None


class Status(Enum):
    CLEAN = "clean"
    FINDINGS = "findings"
    UNREADABLE = "unreadable"  # damaged, deleted or rewritten while read, unsupported: the message says which
    SKIPPED = "skipped"  # a newer checkpoint was complete before this one's turn came (never scanned here)


@dataclass(frozen=True)
class Outcome:
    """What became of one offered checkpoint. ``findings``: one line per finding (``check description``, at most
    :data:`dsckpt.scan_run.MAX_DETAILS`); ``count``: how many findings there are (training-state ones included;
    :attr:`n_findings`); ``message``: why unreadable or skipped; ``reused``: from a valid record beside the
    checkpoint, not a new scan; ``scan_s``: seconds from handing it to the scanner process to its answer."""

    saved: Saved
    status: Status
    findings: tuple[str, ...] = ()
    message: str | None = None
    reused: bool = False
    scan_s: float = 0.0
    count: int | None = None

    @property
    def n_findings(self) -> int:
        return self.count if self.count is not None else len(self.findings)

    @property
    def path(self) -> Path:
        return self.saved.path

    @property
    def step(self) -> int | None:
        return self.saved.step

    def describe(self) -> str:
        """One line: ``PATH (step N): clean`` / ``2 finding(s)`` / ``unreadable: why`` / ``skipped: why``."""
        where = f"{self.path}" + (f" (step {self.step})" if self.step is not None else "")
        if self.status is Status.CLEAN:
            return f"{where}: clean" + (" (recorded)" if self.reused else "")
        if self.status is Status.FINDINGS:
            return f"{where}: {self.n_findings} finding(s)" + (" (recorded)" if self.reused else "")
        return f"{where}: {self.status.value}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step, "status": self.status.value,
                "findings": list(self.findings), "count": self.n_findings, "message": self.message,
                "reused": self.reused, "scan_s": round(self.scan_s, 3)}


# --------------------------------------------------------------------------------------------
# What to scan next (pure)


@dataclass
class SkipAhead:
    """One scan at a time; while it runs, one checkpoint waits (the newest offered); older ones are skipped.

    Not thread-safe by itself (:class:`BackgroundScanner` holds a lock around it). Every checkpoint offered
    ends up exactly once as started (:meth:`start`) or skipped (returned by :meth:`offer`)."""

    running: Saved | None = None
    pending: Saved | None = None
    _seen: set[Path] = field(default_factory=set)
    _newest: tuple[int, int] | None = None  # order key of the newest checkpoint started
    _offers: int = 0
    _order: dict[Path, tuple[int, int]] = field(default_factory=dict)

    def _key(self, s: Saved) -> tuple[int, int]:
        # the step when known; offer order breaks ties and orders checkpoints with no step
        return (s.step if s.step is not None else -1, self._order[s.path][1])

    def offer(self, saved: Saved) -> list[Saved]:
        """Offer ``saved`` (a path offered before is ignored). Returns what this offer made skipped: the
        checkpoint that was pending if ``saved`` is newer, or ``saved`` itself if something newer is pending or
        was already started."""
        if saved.path in self._seen:
            return []
        self._seen.add(saved.path)
        self._offers += 1
        self._order[saved.path] = (saved.step if saved.step is not None else -1, self._offers)
        key = self._key(saved)
        if self._newest is not None and key < self._newest:
            return [saved]
        if self.pending is not None:
            if key < self._key(self.pending):
                return [saved]
            skipped, self.pending = self.pending, saved
            return [skipped]
        self.pending = saved
        return []

    def start(self) -> Saved | None:
        """The checkpoint to scan now (it becomes :attr:`running`), or None if one runs or none waits."""
        if self.running is not None or self.pending is None:
            return None
        self.running, self.pending = self.pending, None
        self._newest = self._key(self.running)
        return self.running

    def drop_pending(self) -> Saved | None:
        """Forget the waiting checkpoint (it disappeared before it was complete); returns it."""
        dropped, self.pending = self.pending, None
        return dropped

    def finish(self) -> Saved:
        """The running scan is over; returns its checkpoint."""
        assert self.running is not None
        done, self.running = self.running, None
        return done

    @property
    def idle(self) -> bool:
        return self.running is None and self.pending is None


def skipped_outcome(saved: Saved, newer: Saved | None) -> Outcome:
    why = (f"the newer {newer.path.name} was complete before its turn" if newer is not None else
           "a newer checkpoint was complete before its turn")
    return Outcome(saved, Status.SKIPPED, message=f"{why}; 'dsckpt scan RUN --all' checks every checkpoint")


# --------------------------------------------------------------------------------------------
# The background scanner


def worker_command() -> list[str]:
    """The scanner process: this interpreter running :mod:`dsckpt.scan_worker`."""
    return [sys.executable, "-m", "dsckpt.scan_worker"]


def worker_env() -> dict[str, str]:
    """The scanner's environment: one thread for every math library (training keeps the cores), dsckpt importable
    from where this process imported it."""
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


class BackgroundScanner:
    """Scan offered checkpoints in one background process, one at a time, newest first (:class:`SkipAhead`).

    The scanner process waits until a checkpoint is completely written
    (:func:`dsckpt.scan_record.completeness_problem`, checked every 0.2 s for up to ``complete_timeout_s`` seconds)
    before it scans it, so this process (a training rank) does no more than hand over a path and read back one line:
    not even the directory listing and metadata parse of the completeness check hold its interpreter.
    ``finished_saves``: every offer comes after its save ended (the callbacks), so a checkpoint without DeepSpeed's
    layout is answered at once (not a DeepSpeed checkpoint) instead of waited for.
    ``is_complete(path)``, when given, is checked here first, every ``poll_s`` seconds (tests put fakes there).
    ``nonfinite_only`` and ``workers`` are passed to the scan (``workers`` default 0: the scanner's one thread).
    ``on_outcome`` is called from the scanner's thread for every outcome (keep it short); :meth:`outcomes` hands
    them to the caller's thread. The scanner process starts on the first offer.
    ``command``/``env``: the worker process (tests put a slow or failing one there)."""

    def __init__(self, *, is_complete: Callable[[Path], bool] | None = None, nonfinite_only: bool = False,
                 workers: int = 0, poll_s: float = 0.5, complete_timeout_s: float = 300.0,
                 finished_saves: bool = False,
                 on_outcome: Callable[[Outcome], None] | None = None,
                 command: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self._is_complete = is_complete if is_complete is not None else os.path.lexists
        self._request = {"nonfinite_only": nonfinite_only, "workers": workers, "complete_timeout_s": complete_timeout_s,
                         "finished_save": finished_saves}
        self._poll_s = poll_s
        self._on_outcome = on_outcome
        self._command = command or worker_command()
        self._env = env if env is not None else worker_env()
        self._plan = SkipAhead()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._done: list[Outcome] = []
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        self._closing = False
        self._started_at = 0.0

    # --- the caller's side (never blocks on a scan)

    def offer(self, path: str | os.PathLike[str], step: int | None = None) -> None:
        """Offer a saved (or being-saved) checkpoint; returns at once."""
        self.offer_many([(path, step)])

    def offer_many(self, saved: list[tuple[str | os.PathLike[str], int | None]]) -> None:
        """Offer several checkpoints at once (oldest first), as one: only the newest of them can be scanned next,
        whatever the scanner thread was doing meanwhile."""
        with self._lock:
            if self._closing:
                return
            for path, step in saved:
                s_new = Saved(Path(path), step)
                for s in self._plan.offer(s_new):
                    newer = self._plan.pending if self._plan.pending is not s else None
                    self._add(skipped_outcome(s, newer or self._plan.running))
            self._ensure_thread()
        self._wake.set()

    def outcomes(self) -> list[Outcome]:
        """Outcomes since the last call, in the order they came."""
        with self._lock:
            out, self._done = self._done, []
        return out

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._plan.idle

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing runs or waits (True), or ``timeout`` seconds (False). For the end of training
        and for tests; never called between steps."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self.idle:
            if end is not None and time.monotonic() >= end:
                return False
            time.sleep(0.02)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Stop: a running scan is abandoned (no record is written for it), the scanner process ends."""
        with self._lock:
            self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._stop_worker()

    def __enter__(self) -> BackgroundScanner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the scanner thread

    def _add(self, outcome: Outcome) -> None:
        self._done.append(outcome)
        if self._on_outcome is not None:
            try:
                self._on_outcome(outcome)
            except Exception:
                logger.exception("dsckpt watch: the outcome hook failed")

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dsckpt-scanner", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        try:
            self._serve()
        except Exception:  # a scanner thread that died would leave offers waiting forever: say so
            with self._lock:
                closing = self._closing
            if not closing:
                logger.exception("dsckpt: the scanner thread stopped; later checkpoints are not scanned")

    def _serve(self) -> None:
        while True:
            with self._lock:
                if self._closing:
                    return
                running = self._plan.running
            if running is None:
                self._maybe_start()
                self._wake.wait(self._poll_s)
                self._wake.clear()
            else:
                self._read_reply(running)

    def _maybe_start(self) -> None:
        with self._lock:
            pending = self._plan.pending
        if pending is None:
            return
        try:
            complete = self._is_complete(pending.path)
        except OSError:
            complete = False
        if not complete:
            if not os.path.lexists(pending.path):
                with self._lock:
                    if self._plan.pending is pending:
                        self._plan.drop_pending()
                        self._add(Outcome(pending, Status.UNREADABLE,
                                          message="deleted before it was complete"))
            return
        with self._lock:
            if self._plan.pending is not pending or self._closing:
                return  # a newer one came meanwhile; the next turn looks at it
            saved = self._plan.start()
        assert saved is not None
        try:
            self._send(saved)
        except OSError as e:
            self._finish(Outcome(saved, Status.UNREADABLE, message=f"the scanner process failed to start ({e})"))

    def _send(self, saved: Saved) -> None:
        if self._proc is None or self._proc.poll() is not None:
            # no preexec_fn (not safe in a process with threads, as a training rank is): the worker lowers its
            # own priority; its own session keeps a terminal's Ctrl-C for the training process to handle
            self._proc = subprocess.Popen(self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=None, text=True, env=self._env, bufsize=1, start_new_session=True)
        assert self._proc.stdin is not None
        self._started_at = time.monotonic()
        self._proc.stdin.write(json.dumps({**self._request, "path": str(saved.path)}) + "\n")
        self._proc.stdin.flush()

    def _read_reply(self, saved: Saved) -> None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], self._poll_s)
        if not ready:
            return
        line = proc.stdout.readline()
        if not line:  # the scanner process died (killed, out of memory): this checkpoint unreadable, go on
            code = proc.wait()
            self._proc = None
            self._finish(Outcome(saved, Status.UNREADABLE,
                                 message=f"the scanner process ended (exit status {code}) while scanning it"))
            return
        try:
            outcome = outcome_from_reply(saved, json.loads(line), time.monotonic() - self._started_at)
        except (ValueError, KeyError, TypeError):
            outcome = Outcome(saved, Status.UNREADABLE, message=f"the scanner process answered {line.strip()[:200]!r}")
        self._finish(outcome)

    def _finish(self, outcome: Outcome) -> None:
        with self._lock:
            self._plan.finish()
            self._add(outcome)
        self._wake.set()

    def _stop_worker(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            _close(stream)
        try:
            proc.terminate()
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        except OSError:
            pass


def _close(stream: IO[str] | None) -> None:
    if stream is not None:
        try:
            stream.close()
        except OSError:
            pass


def outcome_from_reply(saved: Saved, reply: dict[str, Any], seconds: float) -> Outcome:
    """The worker's JSON reply (:func:`dsckpt.scan_worker.handle`) as an :class:`Outcome`."""
    status = Status(reply["status"])
    findings = tuple(str(f) for f in reply.get("findings", ()))
    count = reply.get("count")
    return Outcome(saved, status, findings=findings, message=reply.get("message"), reused=bool(reply.get("reused")),
                   scan_s=seconds, count=int(count) if status is Status.FINDINGS and count is not None else None)


# --------------------------------------------------------------------------------------------
# dsckpt watch


def watch_run(run: str | os.PathLike[str], *, interval_s: float = 5.0, timeout_s: float | None = None,
              once: bool = False, nonfinite_only: bool = False, workers: int = 0,
              list_checkpoints: Callable[[Path], list[Saved]] | None = None,
              is_complete: Callable[[Path], bool] | None = None,
              scanner: BackgroundScanner | None = None) -> Iterator[Outcome]:
    """Yield an :class:`Outcome` for every checkpoint of ``run`` as it is scanned (or skipped).

    Every ``interval_s`` seconds the run folder is listed (default
    :func:`dsckpt.scan_record.list_run_checkpoints`) and every complete checkpoint not offered before is offered
    to one :class:`BackgroundScanner`. Ends after ``timeout_s`` seconds (None: never; the caller stops iterating),
    or with ``once`` when what was complete at the first listing is done. The caller may stop iterating at any
    outcome (``--exit-on-finding``); the scanner process is stopped then."""
    run = Path(run)
    if list_checkpoints is None:
        list_checkpoints = _list_run
    if is_complete is None:
        from .scan_record import checkpoint_complete

        is_complete = checkpoint_complete
    own = scanner is None
    if scanner is None:
        scanner = BackgroundScanner(nonfinite_only=nonfinite_only, workers=workers, poll_s=min(interval_s, 0.5))
    end = None if timeout_s is None else time.monotonic() + timeout_s
    offered: set[Path] = set()

    def offer_new() -> None:
        new = [s for s in list_checkpoints(run) if s.path not in offered and is_complete(s.path)]
        offered.update(s.path for s in new)
        if new:
            scanner.offer_many([(s.path, s.step) for s in new])

    try:
        if once:
            offer_new()
            scanner.wait_idle(None if end is None else max(0.0, end - time.monotonic()))
            yield from scanner.outcomes()
            return
        while True:
            offer_new()
            yield from scanner.outcomes()
            if end is not None and time.monotonic() >= end:
                return
            time.sleep(interval_s if end is None else max(0.0, min(interval_s, end - time.monotonic())))
    finally:
        if own:
            scanner.close()


def _list_run(run: Path) -> list[Saved]:
    from .scan_record import list_run_checkpoints

    return [Saved(Path(c.path), c.step) for c in list_run_checkpoints(run)]
