"""Checks at save time: a Hugging Face ``TrainerCallback`` and a Lightning ``Callback`` that scan every checkpoint
as soon as it is completely written, in a background process training never waits for.

    from dsckpt.callbacks import TrainerScanCallback      # needs transformers
    from dsckpt.callbacks import LightningScanCallback    # needs lightning

Importing this module imports neither framework: each class is built on first access, and accessing one whose
framework is not installed raises :class:`ImportError` naming the package to install.

Both do the same (:class:`_ScanSession`, over :class:`dsckpt.watch.BackgroundScanner`):

* only global rank 0 scans: it offers each saved checkpoint to one scanner process (low priority, one thread),
  which scans it once every rank file is written (never a half-written one), one at a time, skipping ahead to the
  newest when saves come faster than scans, and writes the scan record beside it (``scan --all`` reuses it);
* outcomes are looked at between steps (never waited for) and logged through the framework: the Trainer's
  logger (``transformers.dsckpt``) and ``state.log_history``; Lightning's logger (``lightning.pytorch.dsckpt``)
  and ``trainer.loggers``' ``log_metrics``. Metric ``dsckpt/findings``: the number of findings of the checkpoint
  scanned (``dsckpt/unreadable`` = 1 for one that could not be read);
* ``on_finding="stop"`` stops training at the next step boundary after a finding is known (Trainer:
  ``control.should_training_stop``; Lightning: ``trainer.should_stop``). Every rank must stop together, so with
  ``"stop"`` the ranks agree on it each step (:class:`_StopVote`: one all-reduce of one integer on a CPU group,
  which never waits for the GPU; none with ``"log"``);
* at the end of training, the last checkpoint's scan is waited for (``wait_at_end_s``) and logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .watch import BackgroundScanner, Outcome, Status

if TYPE_CHECKING:
    from lightning.pytorch.callbacks import Callback as _LightningCallback
    from transformers import TrainerCallback as _TrainerCallback

__all__ = ["LightningScanCallback", "TrainerScanCallback"]

ON_FINDING = ("log", "stop")


class _ScanSession:
    """What both callbacks share: the scanner, the outcomes seen, whether to stop. Used on global rank 0 only."""

    def __init__(self, *, on_finding: str, nonfinite_only: bool, wait_at_end_s: float | None,
                 scanner: BackgroundScanner | None) -> None:
        if on_finding not in ON_FINDING:
            raise ValueError(f"on_finding must be one of {ON_FINDING}, not {on_finding!r}")
        self.on_finding = on_finding
        self.wait_at_end_s = wait_at_end_s
        self._nonfinite_only = nonfinite_only
        self._scanner = scanner
        self.seen: list[Outcome] = []
        self.offered: set[Path] = set()
        self.stop_requested = False

    @property
    def scanner(self) -> BackgroundScanner:
        if self._scanner is None:
            self._scanner = BackgroundScanner(nonfinite_only=self._nonfinite_only, finished_saves=True)
        return self._scanner

    def offer(self, path: Path, step: int | None) -> None:
        if path not in self.offered:
            self.offered.add(path)
            self.scanner.offer(path, step)

    def drain(self) -> list[Outcome]:
        """Outcomes since the last call (never waits); notes a finding for ``on_finding="stop"``."""
        if self._scanner is None:
            return []
        got = self._scanner.outcomes()
        self.seen += got
        if self.on_finding == "stop" and any(o.status is Status.FINDINGS for o in got):
            self.stop_requested = True
        return got

    def finish(self) -> list[Outcome]:
        """At the end of training: wait for the scan of the last checkpoint, stop the scanner."""
        if self._scanner is None:
            return []
        try:
            self._scanner.wait_idle(self.wait_at_end_s)
            return self.drain()
        finally:
            self._scanner.close()
            self._scanner = None


def _metrics(o: Outcome) -> dict[str, float]:
    if o.status is Status.SKIPPED:
        return {}
    if o.status is Status.UNREADABLE:
        return {"dsckpt/unreadable": 1.0}
    return {"dsckpt/findings": float(o.n_findings)}


def _log_outcome(log: Any, o: Outcome) -> None:
    if o.status is Status.FINDINGS:
        log.warning("dsckpt: %s: %s", o.describe(), "; ".join(o.findings))
    elif o.status is Status.UNREADABLE:
        log.warning("dsckpt: %s", o.describe())
    else:
        log.info("dsckpt: %s", o.describe())


class _StopVote:
    """Whether any rank wants to stop: one all-reduce (MAX) of one integer per call, on a CPU (gloo) group, so the
    vote never waits for an accelerator's queue (a CUDA tensor's ``.item()`` would, every step). Outside
    torch.distributed, or on one rank, no collective. Every rank must call :meth:`any` at the same points."""

    def __init__(self) -> None:
        self._group: Any = None
        self._ready = False

    def any(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return flag
        if not self._ready:  # every rank gets here at the same step: new_group is collective
            self._group = None if "gloo" in str(dist.get_backend()) else dist.new_group(backend="gloo")
            self._ready = True
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return bool(t.item())


# --------------------------------------------------------------------------------------------
# Hugging Face Trainer


def _make_trainer_callback() -> type:
    try:
        from transformers import TrainerCallback
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise ImportError("dsckpt.callbacks.TrainerScanCallback needs transformers (pip install transformers)") from e

    log = hf_logging.get_logger("transformers.dsckpt")

    class TrainerScanCallback(TrainerCallback):  # type: ignore[misc]
        """Scan every checkpoint the Trainer saves, in the background (see :mod:`dsckpt.callbacks`).

        ``Trainer(..., callbacks=[TrainerScanCallback(on_finding="stop")])``. ``on_finding``: ``"log"`` (default)
        or ``"stop"`` (``control.should_training_stop`` at the next step end). ``nonfinite_only``: only inf/NaN
        (as ``scan --nonfinite``). ``wait_at_end_s``: how long ``on_train_end`` waits for the last scan (None: until
        it ends). Each outcome is logged (WARNING for findings) and appended to ``state.log_history`` as
        ``{"dsckpt/findings": n, "dsckpt/checkpoint": path, "dsckpt/checkpoint_step": s, "step": global step}``."""

        def __init__(self, *, on_finding: str = "log", nonfinite_only: bool = False,
                     wait_at_end_s: float | None = 600.0, scanner: BackgroundScanner | None = None) -> None:
            self.session = _ScanSession(on_finding=on_finding, nonfinite_only=nonfinite_only,
                                        wait_at_end_s=wait_at_end_s, scanner=scanner)
            self._vote = _StopVote()

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.is_world_process_zero:
                path = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
                self.session.offer(path, state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            stop = False
            if state.is_world_process_zero:
                self._record(state, self.session.drain())
                stop = self.session.stop_requested
            if self.session.on_finding == "stop" and self._vote.any(stop):
                if not control.should_training_stop and state.is_world_process_zero:
                    log.warning("dsckpt: stopping training at step %d (on_finding='stop')", state.global_step)
                control.should_training_stop = True

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.is_world_process_zero:
                self._record(state, self.session.finish())

        def _record(self, state: Any, outcomes: list[Outcome]) -> None:
            for o in outcomes:
                _log_outcome(log, o)
                if m := _metrics(o):
                    state.log_history.append({**m, "dsckpt/checkpoint": str(o.path),
                                              "dsckpt/checkpoint_step": o.step, "step": state.global_step})

    return TrainerScanCallback


# --------------------------------------------------------------------------------------------
# Lightning


def _make_lightning_callback() -> type:
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError as e:
        raise ImportError("dsckpt.callbacks.LightningScanCallback needs lightning (pip install lightning)") from e
    from .scan_record import list_run_checkpoints

    log = logging.getLogger("lightning.pytorch.dsckpt")

    class LightningScanCallback(Callback):  # type: ignore[misc]
        """Scan every checkpoint a ``ModelCheckpoint`` saves, in the background (see :mod:`dsckpt.callbacks`).

        ``Trainer(..., callbacks=[LightningScanCallback(on_finding="stop")])``. Looks at each
        ``ModelCheckpoint``'s saved paths (``last_model_path``, ``best_model_path``, ``best_k_models``) after every
        training batch and at the end of validation; checkpoints saved with ``trainer.save_checkpoint`` by hand are
        not seen. ``on_finding``: ``"log"`` or ``"stop"`` (``trainer.should_stop``, the ranks agreeing each step).
        Metrics go to every ``trainer.loggers`` on rank 0 with ``log_metrics`` (``dsckpt/findings``,
        ``dsckpt/checkpoint_step``)."""

        def __init__(self, *, on_finding: str = "log", nonfinite_only: bool = False,
                     wait_at_end_s: float | None = 600.0, scanner: BackgroundScanner | None = None) -> None:
            self.session = _ScanSession(on_finding=on_finding, nonfinite_only=nonfinite_only,
                                        wait_at_end_s=wait_at_end_s, scanner=scanner)
            self._vote = _StopVote()

        def _offer_saved(self, trainer: Any) -> None:
            for cb in trainer.checkpoint_callbacks:
                for p in [getattr(cb, "last_model_path", ""), getattr(cb, "best_model_path", ""),
                          *getattr(cb, "best_k_models", {})]:
                    if p and Path(p) not in self.session.offered and os.path.lexists(p):
                        # the step from the name, as the run listing reads it (epoch=0-step=3.ckpt)
                        step = next((c.step for c in list_run_checkpoints(Path(p).parent) if c.path == Path(p)), None)
                        self.session.offer(Path(p), step)

        def _step(self, trainer: Any, pl_module: Any, *, can_stop: bool) -> None:
            stop = False
            if trainer.is_global_zero:
                self._offer_saved(trainer)
                self._record(trainer, self.session.drain())
                stop = self.session.stop_requested
            if can_stop and self.session.on_finding == "stop":
                if self._vote.any(stop):
                    if not trainer.should_stop and trainer.is_global_zero:
                        log.warning("dsckpt: stopping training at step %d (on_finding='stop')", trainer.global_step)
                    trainer.should_stop = True

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            self._step(trainer, pl_module, can_stop=True)

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if not trainer.sanity_checking:
                self._step(trainer, pl_module, can_stop=False)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.is_global_zero:
                self._offer_saved(trainer)
                self._record(trainer, self.session.finish())

        def _record(self, trainer: Any, outcomes: list[Outcome]) -> None:
            for o in outcomes:
                _log_outcome(log, o)
                if m := _metrics(o):
                    for lg in trainer.loggers:
                        lg.log_metrics({**m, "dsckpt/checkpoint_step": float(o.step if o.step is not None else -1)},
                                       step=trainer.global_step)

    return LightningScanCallback


_FACTORIES: dict[str, Callable[[], type]] = {
    "TrainerScanCallback": _make_trainer_callback,
    "LightningScanCallback": _make_lightning_callback,
}
_BUILT: dict[str, type] = {}

if TYPE_CHECKING:
    TrainerScanCallback: type[_TrainerCallback]
    LightningScanCallback: type[_LightningCallback]


def __getattr__(name: str) -> Any:
    if name in _FACTORIES:
        if name not in _BUILT:
            _BUILT[name] = _FACTORIES[name]()
            _BUILT[name].__module__ = __name__
            _BUILT[name].__qualname__ = name
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
