"""``verify``: audit a whole DeepSpeed checkpoint without converting it.

One pass over the metadata of every file, then one streaming pass over every stored tensor byte:

* **files** — every rank file present (the readers refuse an incomplete set), and all of them from the
  same save: tag, world sizes, global step/samples, DeepSpeed version and config, ZeRO stage,
  partition counts, loss scaler, optimizer hyper-parameters and Adam step counts agree across files;
* **records** — every zip record's CRC32 (legacy non-zip files have none: said, not failed);
* **partitions** — sizes and padding consistent with ``param_shapes`` and DeepSpeed's rules (the
  readers check this while building the logical checkpoint);
* **bindings** — every optimizer-side tensor's owner proven (:mod:`dsckpt.binding`);
* **values** — every 16-bit copy equals its fp32 master rounded, no inf/NaN, no fp32 master beyond
  fp16's range in an fp16 run (the checks of :mod:`dsckpt.scan`, in the same pass).

A problem is reported, not raised: the report lists them all. What cannot be read at all (missing
rank files, partitions that contradict ``param_shapes``, unparseable files) raises as in every
command.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .model import LogicalCheckpoint
from .readers import FileCache, read_checkpoint
from .safe_load import DeepSpeedObject, TensorRef

__all__ = ["Area", "Problem", "VerifyReport", "verify"]


class Area(enum.Enum):
    FILES = "files"
    RECORDS = "records"
    PARTITIONS = "partitions"
    BINDINGS = "bindings"
    VALUES = "values"


@dataclass(frozen=True)
class Problem:
    area: Area
    where: str
    message: str

    def describe(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message

    def to_dict(self) -> dict[str, str]:
        return {"area": self.area.value, "where": self.where, "message": self.message}


@dataclass(frozen=True)
class VerifyReport:
    target: Path
    tag: str
    files: tuple[Path, ...]
    records_checked: int
    nbytes_read: int
    stored_tensors: int
    problems: tuple[Problem, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": str(self.target), "tag": self.tag, "ok": self.ok,
            "files": [str(f) for f in self.files], "records_checked": self.records_checked,
            "nbytes_read": self.nbytes_read, "stored_tensors": self.stored_tensors,
            "areas": [a.value for a in Area],
            "problems": [p.to_dict() for p in self.problems], "notes": list(self.notes),
        }


# --------------------------------------------------------------------------------------------
# Same save: facts that every file of one save shares

_MODEL_FACTS = ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size",
                "ds_version", "ds_config")
_OPTIM_FACTS = ("zero_stage", "partition_count", "loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad",
                "param_groups", "adam_step")


def _plain(value: Any) -> Any:
    """A comparable, JSON-able form of a parsed value (stand-ins by their state)."""
    if isinstance(value, DeepSpeedObject):
        return {"class": f"{value.ds_module}.{value.ds_name}",
                **{k: _plain(v) for k, v in sorted(value.__dict__.items())}}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, TensorRef):
        return _scalar(value) if value.numel == 1 else f"<tensor {list(value.shape)}>"
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def _scalar(ref: TensorRef) -> float | str:
    if not ref.is_contiguous():
        return "<strided scalar>"
    import numpy as np

    from .dtypes import to_float32

    raw = ref.read_numpy(0, 1)
    if ref.dtype_name in ("bfloat16", "float16", "float32"):
        return float(to_float32(raw, ref.dtype_name)[0])
    return float(np.asarray(raw, dtype=np.float64)[0])


def _optim_facts(tree: Mapping[str, Any]) -> dict[str, Any]:
    osd = tree.get("optimizer_state_dict")
    if not isinstance(osd, Mapping):
        return {}
    facts: dict[str, Any] = {k: _plain(osd[k]) for k in _OPTIM_FACTS[:-2] if k in osd}
    inner = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    if isinstance(inner, Mapping):
        groups = inner.get("param_groups") or []
        facts["param_groups"] = [_plain({k: v for k, v in g.items() if k != "params"})
                                 for g in groups if isinstance(g, Mapping)]
        steps = set()
        for st in (inner.get("state") or {}).values():
            if isinstance(st, Mapping) and "step" in st:
                steps.add(json.dumps(_plain(st["step"])))
        facts["adam_step"] = sorted(steps)
    for k in ("ds_version", "ds_config"):
        if k in tree:
            facts[k] = _plain(tree[k])
    return facts


def _model_facts(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _plain(tree[k]) for k in _MODEL_FACTS if k in tree}


def same_save_problems(named_facts: Iterable[tuple[str, dict[str, Any]]]) -> list[Problem]:
    """A problem for every fact on which the files disagree, naming which file holds which value.
    Pure: facts in, problems out."""
    by_fact: dict[str, dict[str, list[str]]] = {}
    for name, facts in named_facts:
        for key, value in facts.items():
            shown = json.dumps(value, sort_keys=True, default=str)
            by_fact.setdefault(key, {}).setdefault(shown, []).append(name)
    problems = []
    for key, values in by_fact.items():
        if len(values) < 2:
            continue
        parts = [f"{v if len(v) <= 60 else v[:57] + '...'} in {', '.join(files)}" for v, files in values.items()]
        problems.append(Problem(Area.FILES, key, f"files disagree ({'; '.join(parts)}); they do not come from "
                                "one save — restore the odd ones from the same save or pick another tag"))
    return problems


def _file_facts(ckpt: LogicalCheckpoint, cache: FileCache) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in ckpt.files:
        tree = cache.tree(path)
        facts = _optim_facts(tree) if "optimizer_state_dict" in tree else _model_facts(tree)
        # ds_config and ds_version are shared by model-states and optimizer files alike
        out.append((str(path.relative_to(ckpt.tag_dir)), facts))
    return out


# --------------------------------------------------------------------------------------------
# Records: checked while the value pass reads them, the rest in the same sweep


class _RecordAudit:
    """Every zip record of the checkpoint's files checked once: the records the value pass reads are
    checked as their bytes go by (their :class:`~dsckpt.crc.RecordCheck` collects instead of raising),
    then every record not verified that way (integer tensors, the pickle's small companions) is read."""

    def __init__(self, files: tuple[Path, ...], cache: FileCache) -> None:
        from .safe_load import walk_tensors

        self.files = files
        self.problems: list[str] = []
        self.checks: dict[Path, list[Any]] = {}
        for f in files:
            seen: dict[int, Any] = {}
            for _, ref in walk_tensors(cache.tree(f)):
                check = ref.storage.check
                if check is not None and id(check) not in seen:
                    check.sink = self.problems
                    seen[id(check)] = check
            self.checks[f] = list(seen.values())
        self.records_checked = 0
        self.extra_nbytes = 0
        self.legacy: list[Path] = []

    def finish(self) -> list[tuple[str, str]]:
        from . import crc

        crc.finish(c for cs in self.checks.values() for c in cs)
        for f in self.files:
            verified = [c for c in self.checks[f] if c.done]
            self.records_checked += sum(1 for c in verified if c.ok)
            report = crc.check_file_records(f, skip=(c.record for c in verified))
            if not report.has_crc:
                self.legacy.append(f)
                continue
            self.records_checked += report.records - len(report.problems)
            self.extra_nbytes += report.nbytes_checked
            self.problems += [p.message for p in report.problems]
        return [(_where(m), m) for m in dict.fromkeys(self.problems)]

    def notes(self, root: Path) -> list[str]:
        if not self.legacy:
            return []
        names = ", ".join(str(f.relative_to(root)) for f in self.legacy)
        return [f"no CRC (legacy non-zip format): bit rot cannot be detected in {names}"]


def _where(message: str) -> str:
    """``file record`` from a CRC message (``'{path}: record '{name}' ...'``)."""
    path, _, rest = message.partition(": ")
    record = rest.split("'")[1] if rest.startswith("record '") else ""
    return f"{Path(path).name} {record}".strip()


# --------------------------------------------------------------------------------------------
# The audit


def verify(path: str | os.PathLike[str], *, tag: str | None = None,
           on_progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Audit the checkpoint at ``path``; see the module docstring. Reads every stored byte once."""
    from .scan import Check, plan_scan, run_scan
    from .state_dict_files import TargetKind

    cache = FileCache()
    ckpt = read_checkpoint(path, tag=tag, cache=cache)
    problems: list[Problem] = []
    notes: list[str] = []

    # same save
    problems += same_save_problems(_file_facts(ckpt, cache))

    # bindings
    for amb in ckpt.ambiguities:
        problems.append(Problem(Area.BINDINGS, ", ".join(amb.names), amb.describe()))

    # one streaming pass: values (scan's checks) with every record's CRC checked as its bytes go by
    audit = _RecordAudit(ckpt.files, cache)
    trees = {f: cache.tree(f) for f in ckpt.files}
    plan = plan_scan(ckpt, trees, cache.tensor, target=ckpt.root, target_kind=TargetKind.DEEPSPEED)
    report = run_scan(plan, cache, on_progress=on_progress)
    problems += [Problem(Area.RECORDS, where, msg) for where, msg in audit.finish()]
    for f in report.findings:
        problems.append(Problem(Area.VALUES, f.name or f"{f.file.name} {f.key_str}", f"{f.check.value}: {f.describe()}"))
    notes += audit.notes(ckpt.tag_dir)
    assert Check.MISMATCH in report.checks
    return VerifyReport(ckpt.root, ckpt.tag, ckpt.files, audit.records_checked,
                        report.nbytes_read + audit.extra_nbytes, report.stored_tensors, tuple(problems), tuple(notes))
