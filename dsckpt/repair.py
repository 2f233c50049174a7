"""``repair``: replace inf/NaN values with values from a trusted source, in every place a tensor is stored.

Three steps, like every dsckpt command:

1. :func:`assess_damage` and :func:`read_source_values` (I/O): which elements of which stored copies
   are non-finite (from a scan), and the source's values for those tensors;
2. :func:`plan_repair` (pure): a frozen :class:`RepairPlan` — which tensors, which elements, which
   stored copies (every rank's module copy, stage-3 buffer replicas, frozen fragments, fp32 master
   partitions), the new values, dtype promotions — or a :class:`~dsckpt.errors.RepairError` listing
   every tensor that has no source value;
3. :func:`run_repair` (I/O): copy the checkpoint folder to OUT (atomically), rewrite only the files
   that hold patched tensors, re-scan and re-read the output, and only then return.

Sources: a consolidated fp32 state dict (``.safetensors``, sharded folder, torch file) or
``master``, the checkpoint's own fp32 master weights (for 16-bit module copies of trainable params).
Optimizer moments (``exp_avg``/``exp_avg_sq``) have no source anywhere and are refused.

Dtype promotion: an fp16 *buffer* whose true value exceeds 65504 cannot be stored in fp16, so its
stored copies are rewritten as fp32. DeepSpeed 0.19.8 loads buffers with ``module.load_state_dict``
(engine.py ``load_module_state_dict``), which ``copy_``-casts into the engine's existing buffer: the
load succeeds, but an engine configured with ``data_types.buffer_dtype: fp16`` casts the value back to
inf. Resume such a run without ``buffer_dtype`` (buffers stay fp32). A *param* whose value does not
fit its 16-bit dtype is refused: its module copy is a view into DeepSpeed's flat 16-bit buffer.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import parsed_tree, safe_load, safe_save
from .assemble import read_piece
from .atomic import atomic_dir, claim_output, copy_file, refuse_overlap, scratch_dir
from .errors import RepairError, UsageError
from .loss_scale import LossScalePlan, apply_loss_scale, check_loss_scale, find_scalers, plan_loss_scale
from .model import Kind, LogicalCheckpoint, Role, TensorEntry, contiguous_fragments
from .readers.common import FileCache, format_key, lookup
from .scan import Check, ScanReport, StoredKind, open_target, scan, stored_kind
from .stand_ins import DeepSpeedObject
from .state_dict_files import TargetKind, detect_target, open_state_dict, read_safetensors_header
from .validate import refuse_unloadable_fields

__all__ = [
    "MASTER",
    "Damage",
    "Patch",
    "PatchTarget",
    "Policy",
    "RepairPlan",
    "RepairResult",
    "SourceValues",
    "assess_damage",
    "plan_repair",
    "prepare_repair",
    "read_source_values",
    "run_repair",
    "run_repair_distributed",
]

MASTER = "master"
_BN_INITIAL = {"running_mean": 0.0, "running_var": 1.0}


class Policy(enum.Enum):
    REFUSE = "refuse"
    RESET_BN_STATS = "reset-bn-stats"


@dataclass(frozen=True)
class Damage:
    """Non-finite elements of one logical tensor: per stored copy (index into ``entry.pieces``), a
    boolean mask over the flattened logical tensor."""

    name: str
    piece_masks: Mapping[int, torch.Tensor] = field(compare=False)
    nan: int = 0
    posinf: int = 0
    neginf: int = 0


@dataclass(frozen=True)
class SourceValues:
    """What the source holds for the damaged tensors: name -> flat fp32 values (missing = no value)."""

    label: str
    is_master: bool
    values: Mapping[str, torch.Tensor] = field(compare=False)
    # (name, optimizer state key) -> flat fp32 values: only a DeepSpeed checkpoint given as source holds them
    moments: Mapping[tuple[str, str], torch.Tensor] = field(default_factory=dict, compare=False)
    # (name, replica) -> flat fp32 values of that replica of the module copy (replicas >= 1; checkpoint source only)
    replicas: Mapping[tuple[str, int], torch.Tensor] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class PatchTarget:
    """A stored fragment to edit: elements ``[src_offset, src_offset + numel)`` of the tensor at
    ``key`` in ``file`` hold logical elements from ``dst_offset``."""

    file: Path
    key: tuple[Any, ...]
    role: Role
    replica: int
    rank: int | None
    dtype: str
    src_offset: int
    numel: int
    dst_offset: int
    state_key: str | None = None  # the optimizer state ("exp_avg") of an OPTIM_STATE target

    def describe(self) -> str:
        rank = f" rank {self.rank}" if self.rank is not None else ""
        what = self.state_key if self.role is Role.OPTIM_STATE and self.state_key else self.role.value
        return f"{self.file.name}{format_key(self.key)} ({what}{rank})"


@dataclass(frozen=True)
class Patch:
    name: str
    kind: StoredKind
    source: str
    numel: int
    indices: torch.Tensor = field(compare=False)  # int64 logical flat indices
    values: torch.Tensor = field(compare=False)  # float32, one per index
    targets: tuple[PatchTarget, ...] = ()
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    promote_to: str | None = None
    note: str = ""
    state_key: str | None = None  # set on a patch of an optimizer state (moments), which only targets that state

    @property
    def numel_patched(self) -> int:
        return int(self.indices.numel())

    @property
    def whole(self) -> bool:
        return self.numel_patched == self.numel

    def describe(self) -> str:
        before = ", ".join(f"{n} {lbl}" for n, lbl in ((self.nan, "NaN"), (self.posinf, "+inf"),
                                                          (self.neginf, "-inf")) if n) \
            or ("non-finite" if self.state_key else "finite")
        shown = self.indices[:8].tolist()
        where = "all" if self.whole else f"{self.numel_patched} of {self.numel}"
        lo, hi = (float(self.values.min()), float(self.values.max())) if self.values.numel() else (0.0, 0.0)
        what = f"{self.kind.value}, {self.state_key}" if self.state_key else self.kind.value
        lines = [f"{self.name} ({what}): {where} values at {shown}"
                 + ("..." if self.numel_patched > 8 else "")
                 + f"; before: {before}; after: min {lo:.6g}, max {hi:.6g}; from {self.source}"]
        for t in self.targets:
            lines.append(f"    in {t.describe()}, {t.dtype}"
                         + (f" -> stored as {self.promote_to}" if self.promote_to else ""))
        if self.promote_to:
            lines.append(f"    stored as {self.promote_to}: the source values do not fit "
                         f"{self.targets[0].dtype} (|x| > 65504)")
        if self.note:
            lines.append(f"    note: {self.note}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "kind": self.kind.value, "state_key": self.state_key, "source": self.source,
            "numel": self.numel,
            "numel_patched": self.numel_patched, "indices": self.indices[:64].tolist(),
            "before": {"nan": self.nan, "posinf": self.posinf, "neginf": self.neginf},
            "after": {"min": float(self.values.min()) if self.values.numel() else None,
                      "max": float(self.values.max()) if self.values.numel() else None},
            "targets": [{"file": str(t.file), "key": format_key(t.key), "role": t.role.value, "rank": t.rank,
                         "replica": t.replica, "dtype": t.dtype, "state_key": t.state_key} for t in self.targets],
            "promote_to": self.promote_to, "note": self.note,
        }


@dataclass(frozen=True)
class RepairPlan:
    input: Path
    input_kind: TargetKind
    tag: str
    tag_dir: Path
    source: str
    policy: Policy
    whole_tensor: bool
    patches: tuple[Patch, ...]
    loss_scale: LossScalePlan | None = None

    @property
    def has_work(self) -> bool:
        return bool(self.patches) or self.loss_scale is not None

    @property
    def files(self) -> tuple[Path, ...]:
        scaler_files = self.loss_scale.files if self.loss_scale is not None else ()
        return tuple(sorted({t.file for p in self.patches for t in p.targets} | set(scaler_files)))

    @property
    def promotions(self) -> list[Patch]:
        return [p for p in self.patches if p.promote_to]

    def to_dict(self) -> dict[str, Any]:
        return {"input": str(self.input), "input_kind": self.input_kind.value, "tag": self.tag,
                "source": self.source, "policy": self.policy.value, "whole_tensor": self.whole_tensor,
                "files_rewritten": [str(f) for f in self.files], "patches": [p.to_dict() for p in self.patches],
                "loss_scale": self.loss_scale.to_dict() if self.loss_scale is not None else None}


@dataclass(frozen=True)
class RepairResult:
    plan: RepairPlan
    output: Path
    rewritten: tuple[Path, ...]
    rescan: ScanReport


# --------------------------------------------------------------------------------------------
# Gathering (I/O)


def assess_damage(logical: LogicalCheckpoint, cache: FileCache,
                  report: ScanReport) -> tuple[dict[str, Damage], list[str]]:
    """Full non-finite masks of every tensor the scan flagged, and descriptions of findings that no
    logical tensor owns (they cannot be repaired)."""
    names: list[str] = []
    orphans: list[str] = []
    for f in report.of(Check.NONFINITE):
        if f.name is None:
            orphans.append(f"{f.file.name} {f.key_str}: {f.count} non-finite values outside any tensor "
                           "(padding or unrecognised data)")
        elif f.padding_rows is not None:
            orphans.append(f"{f.file.name} {f.key_str}: {f.count} non-finite values in the vocabulary padding rows "
                           f"{f.padding_rows[0]}-{f.padding_rows[1] - 1} of '{f.name}' (not part of the tensor; "
                           "repair does not patch them)")
        elif f.name not in names:
            names.append(f.name)
    damage = {}
    for name in names:
        e = logical.entry(name)
        masks: dict[int, torch.Tensor] = {}
        nan = posinf = neginf = 0
        for i, p in enumerate(e.pieces):
            t = read_piece(p, e.shape, cache, name=name).reshape(-1)
            if not t.is_floating_point():
                continue
            bad = ~torch.isfinite(t)
            if bool(bad.any()):
                masks[i] = bad
                nan += int(torch.isnan(t).sum())
                posinf += int(torch.isposinf(t).sum())
                neginf += int(torch.isneginf(t).sum())
        damage[name] = Damage(name, masks, nan, posinf, neginf)
    return damage, orphans


def _bn_partner(name: str) -> str | None:
    prefix, _, leaf = name.rpartition(".")
    if leaf == "running_var":
        return f"{prefix}.running_mean" if prefix else "running_mean"
    if leaf == "running_mean":
        return f"{prefix}.running_var" if prefix else "running_var"
    return None


def read_source_values(source: str | os.PathLike[str], logical: LogicalCheckpoint, cache: FileCache,
                       names: list[str], *, source_tag: str | None = None) -> SourceValues:
    """The source's values for ``names`` (flat fp32). ``source`` is ``"master"``, a state-dict path, or another
    DeepSpeed checkpoint of the same model (:func:`read_checkpoint_values`).

    Tied aliases are looked up under every name of the group."""
    values: dict[str, torch.Tensor] = {}
    if str(source) == MASTER:
        for name in names:
            e = logical.entry(name)
            p = e.piece(Role.MASTER)
            if p is not None:
                values[name] = read_piece(p, e.shape, cache, name=name).reshape(-1).float()
        return SourceValues("the checkpoint's fp32 master weights", True, values)
    if detect_target(source) is TargetKind.DEEPSPEED:
        return read_checkpoint_values(Path(source), logical, names, tag=source_tag)
    src_logical, src_cache = open_state_dict(source)
    by_name = {e.name: e for e in src_logical.entries}
    aliases: dict[str, list[str]] = {}
    for e in logical.entries:
        if e.tied_to is not None:
            aliases.setdefault(e.tied_to, []).append(e.name)
    for name in names:
        for candidate in (name, *aliases.get(name, ())):
            se = by_name.get(candidate)
            if se is not None:
                values[name] = read_piece(se.source_for_fp32(), se.shape, src_cache, name=candidate).reshape(-1).float()
                break
    src_cache.finish_checks()
    return SourceValues(f"fp32 source {source}", False, values)


def read_checkpoint_values(source: Path, logical: LogicalCheckpoint, names: list[str], *,
                           tag: str | None = None) -> SourceValues:
    """Values for ``names`` from ``source``, another DeepSpeed checkpoint of the same model (e.g. the last clean
    one of the run): per tensor its most precise copy (the fp32 master of a trained param, else the stored
    module copy: buffers, frozen params), and every optimizer state it keeps (``exp_avg``, ``exp_avg_sq`` ...).

    The two checkpoints must hold the same tensors (names and shapes), else :class:`UsageError`; the source may
    have another ZeRO stage, rank count or precision (values are read by name)."""
    from .checkpoint import open_checkpoint

    c = open_checkpoint(source, tag=tag)
    src = c.logical
    if src.tag_dir.resolve() == logical.tag_dir.resolve():
        raise UsageError(f"--from '{source}' is the checkpoint being repaired (tag {src.tag}); give another "
                         "checkpoint of the run (a tag folder such as RUN/global_step100)")
    mine = {e.name: tuple(e.shape) for e in logical.entries}
    theirs = {e.name: tuple(e.shape) for e in src.entries}
    if mine != theirs:
        missing = sorted(set(mine) - set(theirs))
        extra = sorted(set(theirs) - set(mine))
        shapes = sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n])
        why = "; ".join(x for x in (
            f"{len(missing)} tensor(s) it lacks ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
            if missing else "",
            f"{len(extra)} it has that '{logical.tag_dir}' lacks ({', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''})" if extra else "",
            ", ".join(f"{n} is {list(theirs[n])} there, {list(mine[n])} here" for n in shapes[:3]) if shapes else "",
        ) if x)
        raise UsageError(f"--from '{source}' (tag {src.tag}) is not a checkpoint of the same model: {why}; give "
                         "another checkpoint of the same run")
    src.require_unambiguous("repair", moments=True, names=set(names))
    by_name = {e.name: e for e in src.entries}
    values: dict[str, torch.Tensor] = {}
    moments: dict[tuple[str, str], torch.Tensor] = {}
    replicas: dict[tuple[str, int], torch.Tensor] = {}
    for name in names:
        se = by_name[name]
        if se.tied_to is not None:
            se = by_name[se.tied_to]
        values[name] = read_piece(se.source_for_fp32(), se.shape, c.cache, name=se.name).reshape(-1).float()
        for key in se.state_keys:
            piece = se.state_piece(key)
            if piece is not None:
                moments[(name, key)] = read_piece(piece, se.shape, c.cache, name=se.name).reshape(-1).float()
        if se.piece(Role.MASTER) is None:  # the module copy is the value: each replica its own
            for p in se.pieces:
                if p.role is Role.MODULE and p.replica > 0:
                    replicas[(name, p.replica)] = read_piece(p, se.shape, c.cache, name=se.name).reshape(-1).float()
    c.cache.finish_checks()
    return SourceValues(f"checkpoint {source} (tag {src.tag})", False, values, moments, replicas)


# --------------------------------------------------------------------------------------------
# Planning (pure)


def _targets(entry: TensorEntry, roles: tuple[Role, ...], indices: torch.Tensor,
             state_key: str | None = None) -> tuple[PatchTarget, ...]:
    out = []
    lo, hi = (int(indices.min()), int(indices.max()) + 1) if indices.numel() else (0, 0)
    seen = set()
    for p in entry.pieces:
        if p.role not in roles or (p.role is Role.OPTIM_STATE and p.state_key != state_key):
            continue
        for f in contiguous_fragments(p):
            if f.dst_offset >= hi or f.dst_offset + f.numel <= lo:
                continue
            inside = ((indices >= f.dst_offset) & (indices < f.dst_offset + f.numel)).any()
            sig = (f.file, f.key, f.src_offset, f.dst_offset)
            if bool(inside) and sig not in seen:
                seen.add(sig)
                out.append(PatchTarget(f.file, f.key, p.role, p.replica, f.rank, p.dtype, f.src_offset, f.numel,
                                       f.dst_offset, p.state_key if p.role is Role.OPTIM_STATE else None))
    return tuple(out)


def _fits(values: torch.Tensor, dtype: str) -> bool:
    return bool(torch.isfinite(values.to(getattr(torch, dtype))).all())


def plan_repair(logical: LogicalCheckpoint, damage: Mapping[str, Damage], source: SourceValues, *,
                input: Path, input_kind: TargetKind, whole_tensor: bool = False,
                policy: Policy = Policy.REFUSE, orphans: tuple[str, ...] = ()) -> RepairPlan:
    """Decide every patch, or raise :class:`RepairError` naming every tensor that cannot be repaired.

    Pure: works from the damage masks and source values gathered beforehand."""
    problems: list[str] = list(orphans)
    patches: list[Patch] = []
    resets: dict[str, torch.Tensor] = {}  # BN prefix -> mask of elements to reset
    for name, d in damage.items():
        e = logical.entry(name)
        kind = stored_kind(e, Role.MODULE)
        moment_masks: dict[str, torch.Tensor] = {}
        for i, m in d.piece_masks.items():
            key = e.pieces[i].label
            if e.pieces[i].role is Role.OPTIM_STATE:
                moment_masks[key] = moment_masks[key] | m if key in moment_masks else m
        no_moments = sorted(k for k in moment_masks if (name, k) not in source.moments)
        if no_moments:
            problems.append(f"{name}: non-finite values in its {' and '.join(no_moments)}; only another DeepSpeed "
                            "checkpoint of the run given with --from holds optimizer moments")
        for key, m in sorted(moment_masks.items()):
            mvals = source.moments.get((name, key))
            if mvals is None:
                continue
            midx = torch.arange(e.numel) if whole_tensor else m.nonzero().flatten()
            if mvals.numel() != e.numel or not bool(torch.isfinite(mvals[midx]).all()):
                problems.append(f"{name}: {source.label} has no finite {key} at the same places")
                continue
            patches.append(Patch(name, kind, f"{source.label} ({key})", e.numel, midx, mvals[midx].float(),
                                 _targets(e, (Role.OPTIM_STATE,), midx, key),
                                 note="optimizer state taken from the earlier checkpoint at these elements",
                                 state_key=key))
        value_masks = [m for i, m in d.piece_masks.items() if e.pieces[i].role in (Role.MASTER, Role.MODULE)]
        if not value_masks:
            continue
        mask = torch.stack(value_masks).any(dim=0)
        indices = torch.arange(e.numel) if whole_tensor else mask.nonzero().flatten()
        if source.is_master:
            master_idx = next((i for i, p in enumerate(e.pieces) if p.role is Role.MASTER), None)
            if master_idx is None or name not in source.values:
                problems.append(f"{name} ({kind.value}): has no fp32 master to repair from"
                                + (" (buffers and frozen params never have one)"
                                   if kind is not StoredKind.PARAM else ""))
                continue
            if master_idx in d.piece_masks and bool(d.piece_masks[master_idx][indices].any()):
                problems.append(f"{name} ({kind.value}): its fp32 master is non-finite too; give an fp32 source "
                                "file with --from")
                continue
            roles: tuple[Role, ...] = (Role.MODULE,)
        else:
            roles = (Role.MODULE, Role.MASTER) if kind is StoredKind.PARAM else (Role.MODULE,)
        values = source.values.get(name)
        if values is None:
            partner = _bn_partner(name)
            if policy is Policy.RESET_BN_STATS and partner is not None and e.kind is Kind.BUFFER:
                prefix = name.rpartition(".")[0]
                full = torch.zeros(e.numel, dtype=torch.bool)
                full[indices] = True
                resets[prefix] = resets[prefix] | full if prefix in resets else full
                continue
            hint = " (or --policy reset-bn-stats)" if partner is not None and e.kind is Kind.BUFFER else ""
            problems.append(f"{name} ({kind.value}, {d.nan + d.posinf + d.neginf} non-finite): no value in "
                            f"{source.label}{hint}")
            continue
        if values.numel() != e.numel:
            problems.append(f"{name}: {source.label} holds {values.numel()} values, the checkpoint's tensor "
                            f"has shape {list(e.shape)}")
            continue
        targets = _targets(e, roles, indices)
        # a checkpoint source holds its own value for each replica of a module copy (ZeRO-3 keeps a buffer per
        # rank, and DP ranks update them apart): each replica gets the same replica's value
        own = {r: v for (n, r), v in source.replicas.items() if n == name and v.numel() == e.numel}
        groups = [(values, tuple(t for t in targets if not (t.role is Role.MODULE and t.replica in own)), "")]
        groups += [(v, tuple(t for t in targets if t.role is Role.MODULE and t.replica == r), f" (replica {r})")
                   for r, v in sorted(own.items())]
        for vals, tgts, which in groups:
            if not tgts:
                continue
            new = vals[indices]
            if not bool(torch.isfinite(new).all()):
                problems.append(f"{name}: {source.label}{which} is non-finite at the same places")
                continue
            promote = None
            misfit = sorted({t.dtype for t in tgts if not _fits(new, t.dtype)})
            if misfit:
                if e.kind is Kind.BUFFER:
                    promote = "float32"
                else:
                    problems.append(f"{name} ({kind.value}): source values up to {float(new.abs().max()):.6g} do "
                                    f"not fit its stored {', '.join(misfit)} copy; a param cannot change dtype")
                    continue
            patches.append(Patch(name, kind, source.label + which, e.numel, indices, new.float(), tgts, d.nan,
                                 d.posinf, d.neginf, promote_to=promote))
    for prefix, mask in resets.items():
        for leaf, initial in _BN_INITIAL.items():
            name = f"{prefix}.{leaf}" if prefix else leaf
            try:
                e = logical.entry(name)
            except KeyError:
                continue
            indices = torch.arange(e.numel) if whole_tensor else mask.nonzero().flatten()
            dmg = damage.get(name)
            note = ("reset with --policy reset-bn-stats: BatchNorm running statistics set to their initial "
                    "values (running_mean 0, running_var 1) at the damaged channels; recalibrate them")
            if dmg is None:
                note += "; this tensor was finite but is reset with its partner for consistency"
            patches.append(Patch(name, StoredKind.BUFFER, "reset-bn-stats (initial value)", e.numel, indices,
                                 torch.full((indices.numel(),), initial), _targets(e, (Role.MODULE,), indices),
                                 dmg.nan if dmg else 0, dmg.posinf if dmg else 0, dmg.neginf if dmg else 0,
                                 note=note))
    if problems:
        raise RepairError(
            f"cannot repair {len(problems)} tensor(s) of '{input}', nothing was written: " + "; ".join(problems)
            + ". Give an fp32 source that holds them with --from"
        )
    return RepairPlan(input, input_kind, logical.tag, logical.tag_dir, source.label, policy, whole_tensor,
                      tuple(sorted(patches, key=lambda p: (p.name, p.state_key or ""))))


def prepare_repair(checkpoint: str | os.PathLike[str], source: str | os.PathLike[str] | None, *, tag: str | None = None,
                   whole_tensor: bool = False, policy: Policy = Policy.REFUSE, loss_scale: float | None = None,
                   source_tag: str | None = None,
                   on_progress: Callable[[int], None] | None = None) -> tuple[RepairPlan, FileCache]:
    """Scan ``checkpoint``, read the damaged tensors and their source values, and plan the repair.

    ``source`` None: only ``--policy reset-bn-stats`` can supply values. ``source`` a DeepSpeed checkpoint (another
    checkpoint of the same model, ``source_tag`` its tag): see :func:`read_source_values`. ``loss_scale``: also
    reset the fp16 dynamic loss scaler of every rank file to this scale (:mod:`dsckpt.loss_scale`)."""
    inp = Path(checkpoint)
    if loss_scale is not None:
        check_loss_scale_value(loss_scale)
    kind = detect_target(inp)
    if kind not in (TargetKind.DEEPSPEED, TargetKind.SAFETENSORS):
        raise UsageError(f"'{inp}': repair works on DeepSpeed checkpoint folders and single .safetensors files; "
                         "convert with 'dsckpt to-fp32' first")
    if loss_scale is not None and kind is not TargetKind.DEEPSPEED:
        raise UsageError(f"--loss-scale: '{inp}' is a .safetensors file, which has no loss scaler; give the "
                         "DeepSpeed checkpoint folder")
    if source is not None and str(source) != MASTER and not Path(source).exists():
        raise UsageError(f"source '{source}' does not exist; give a .safetensors file, a sharded folder, a torch "
                         "state-dict file, or 'master'")
    logical, cache, kind = open_target(inp, tag=tag)
    if kind is TargetKind.DEEPSPEED:  # the output carries every file's other fields as they are
        refuse_unloadable_fields([(f, cache.tree(f)) for f in logical.files], source=f"'{logical.tag_dir}'")
    scaler_plan = None
    if loss_scale is not None:
        scaler_plan = plan_loss_scale(find_scalers(list(logical.files), cache.tree), loss_scale,
                                      precision=logical.precision.value, source=str(inp))
    report = scan(inp, tag=tag, nonfinite_only=True, on_progress=on_progress)
    damage, orphans = assess_damage(logical, cache, report)
    # Patching a master or moments by name needs the proven owner of each optimizer-side tensor.
    # (Damage in a stored tensor that no name owns may sit in an unbound master: then any ambiguity counts.)
    logical.require_unambiguous("repair", moments=True, names=None if orphans else set(damage))
    if source is None:
        values = SourceValues("no source (none given)", False, {})
    else:
        values = read_source_values(source, logical, cache, list(damage), source_tag=source_tag)
    cache.finish_checks()  # records read only partly by the reads above (the scan finished its own)
    plan = plan_repair(logical, damage, values, input=inp, input_kind=kind, whole_tensor=whole_tensor,
                       policy=policy, orphans=tuple(orphans))
    return dataclasses.replace(plan, loss_scale=scaler_plan), cache


def check_loss_scale_value(scale: float) -> None:
    """:class:`UsageError` unless ``scale`` is a positive finite number (``--loss-scale``)."""
    if not (math.isfinite(scale) and scale > 0):
        raise UsageError(f"--loss-scale {scale}: give a positive finite loss scale (e.g. 1024)")


# --------------------------------------------------------------------------------------------
# Doing (I/O)


def _set(tree: Any, key: tuple[Any, ...], value: Any, path: Path) -> None:
    parent = lookup(tree, key[:-1], path)
    if isinstance(parent, DeepSpeedObject):
        parent.__dict__[key[-1]] = value
    else:
        parent[key[-1]] = value


def _apply(tensor_at: Callable[[tuple[Any, ...], PatchTarget], torch.Tensor], patches: tuple[Patch, ...],
           file: Path) -> None:
    for p in patches:
        for t in p.targets:
            if t.file.resolve() != file.resolve():
                continue
            stored = tensor_at(t.key, t)
            flat = stored.view(-1)
            sel = (p.indices >= t.dst_offset) & (p.indices < t.dst_offset + t.numel)
            flat[p.indices[sel] - t.dst_offset + t.src_offset] = p.values[sel].to(flat.dtype)


def _rewrite_torch_file(src: Path, dst: Path, patches: tuple[Patch, ...],
                        loss_scale: LossScalePlan | None = None) -> None:
    parsed = safe_load.load(src)  # first: it checks that src is a regular file before opening it
    with open(src, "rb") as f:
        legacy = f.read(2) != b"PK"
    tree = parsed_tree.materialize(parsed)
    parsed_tree.finish_checks(parsed)  # materialize read every storage; a record longer than its storage has more
    promoted: set[tuple[Any, ...]] = set()

    def tensor_at(key: tuple[Any, ...], target: PatchTarget) -> torch.Tensor:
        t = lookup(tree, key, src)
        promote = next((p.promote_to for p in patches if target in p.targets), None)
        if promote and key not in promoted:
            t = t.detach().to(getattr(torch, promote)).clone()
            _set(tree, key, t, src)
            promoted.add(key)
        if not t.is_contiguous():
            raise RepairError(f"{src}: tensor {format_key(key)} is not contiguous; cannot patch it in place")
        return t

    _apply(tensor_at, patches, src)
    if loss_scale is not None:
        apply_loss_scale(tree, loss_scale, src)
    safe_save.save(tree, dst, legacy_format=legacy)


def run_repair(plan: RepairPlan, output: str | os.PathLike[str], *, force: bool = False,
               on_progress: Callable[[int], None] | None = None) -> RepairResult:
    """Write the repaired copy to ``output`` atomically; the input is only read.

    DeepSpeed input: ``output`` becomes a copy of the input folder where only the files holding
    patched tensors are rewritten (legacy non-zip files stay legacy). ``.safetensors`` input: a new
    ``.safetensors`` file. The output is re-scanned and the patched values re-read before returning;
    on any failure nothing is left at ``output``."""
    out = Path(output)
    inp = plan.input.resolve()
    refuse_overlap(out, plan.input, "choose a folder outside it")
    with claim_output(out, force=force, nbytes=_output_nbytes_bound(plan)):
        if plan.input_kind is TargetKind.SAFETENSORS:
            return _run_safetensors(plan, out, on_progress)
        return _run_folder(plan, inp, out, on_progress)


def run_repair_distributed(plan: RepairPlan, output: str | os.PathLike[str], group: Any, *, force: bool = False,
                           on_progress: Callable[[int], None] | None = None) -> RepairResult:
    """:func:`run_repair` spread over the ranks of ``group`` (:class:`dsckpt.distributed.Group`).

    DeepSpeed input: the input's files (rewritten or copied unchanged) are split over the ranks by bytes;
    each rank writes its files into rank 0's leased temporary folder and fsyncs them; rank 0 checks the
    reported sizes against the filesystem, re-scans the copy and re-reads every patched element (alone,
    for now), and renames OUT into place. A ``.safetensors`` input is one file: rank 0 writes it alone (its
    patched tensors are few, and the rest is a copy). Same bytes as :func:`run_repair`; every rank returns
    rank 0's result."""
    import contextlib

    from .distributed import split_by_nbytes

    out = Path(output)
    inp = plan.input.resolve()
    refuse_overlap(out, plan.input, "choose a folder outside it")
    group.agree({"plan": plan.to_dict(), "out": str(out)}, "the repair plan")
    if plan.input_kind is TargetKind.SAFETENSORS:
        return group.step(lambda: run_repair(plan, out, force=force, on_progress=on_progress)
                          if group.is_root else None, "writing OUT")[0]
    entries = sorted(inp.rglob("*"))
    files = [src for src in entries if not (src.is_dir() and not src.is_symlink())]
    to_rewrite = {f.resolve() for f in plan.files}
    mine = split_by_nbytes([src.stat().st_size for src in files], group.world_size)[group.rank]

    with contextlib.ExitStack() as stack:
        def claim() -> str | None:
            if not group.is_root:
                return None
            stack.enter_context(claim_output(out, force=force, nbytes=_output_nbytes_bound(plan)))
            tmp = stack.enter_context(atomic_dir(out, leased=True))
            for src in entries:
                if src.is_dir() and not src.is_symlink():
                    (tmp / src.relative_to(inp)).mkdir(parents=True, exist_ok=True)
            return str(tmp)

        tmp = Path(group.step(claim, "claiming OUT")[0])

        def write() -> dict[str, int]:
            sizes = {}
            for i in mine:
                src = files[i]
                rel = src.relative_to(inp)
                dst = tmp / rel
                if src.resolve() in to_rewrite:
                    _rewrite_torch_file(src, dst, _retarget(plan.patches, src), plan.loss_scale)
                else:
                    copy_file(src, dst)
                fd = os.open(dst, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                sizes[str(rel)] = dst.stat().st_size
            return sizes

        reported = {k: v for r in group.step(write, "writing OUT") for k, v in r.items()}

        def finish() -> RepairResult | None:
            if not group.is_root:
                return None
            wrong = [str(src.relative_to(inp)) for src in files
                     if reported.get(str(src.relative_to(inp))) != (tmp / src.relative_to(inp)).stat().st_size]
            if wrong:
                raise RepairError(f"'{out}' was not written completely ({', '.join(wrong)}); nothing was moved into "
                                  "place")
            tag = None if inp == plan.tag_dir.resolve() else plan.tag
            report = _verify(plan, tmp, tag, inp, on_progress)
            rewritten = tuple(out / src.relative_to(inp) for src in files if src.resolve() in to_rewrite)
            return RepairResult(plan, out, rewritten, report)

        result = group.step(finish, "checking OUT")[0]
        group.step(lambda: stack.close() if group.is_root else None, "moving OUT into place")
    return result


def _output_nbytes_bound(plan: RepairPlan) -> int:
    """What the repaired copy can take: the input's bytes, plus 2 bytes per element of every stored
    copy promoted from fp16 to fp32."""
    inp = plan.input
    files = [inp] if inp.is_file() else [p for p in inp.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    return total + sum(2 * p.numel * len(p.targets) for p in plan.patches if p.promote_to)


def _run_folder(plan: RepairPlan, inp: Path, out: Path,
                on_progress: Callable[[int], None] | None) -> RepairResult:
    rewritten = []
    to_rewrite = {f.resolve() for f in plan.files}
    with atomic_dir(out) as tmp:
        for src in sorted(inp.rglob("*")):
            rel = src.relative_to(inp)
            dst = tmp / rel
            if src.is_dir() and not src.is_symlink():
                dst.mkdir(parents=True, exist_ok=True)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.resolve() in to_rewrite:
                _rewrite_torch_file(src, dst, _retarget(plan.patches, src), plan.loss_scale)
                rewritten.append(out / rel)
            else:
                copy_file(src, dst)
        tag = None if inp == plan.tag_dir.resolve() else plan.tag
        report = _verify(plan, tmp, tag, inp, on_progress)
    return RepairResult(plan, out, tuple(rewritten), report)


def _retarget(patches: tuple[Patch, ...], src: Path) -> tuple[Patch, ...]:
    return tuple(p for p in patches if any(t.file.resolve() == src.resolve() for t in p.targets))


def _verify(plan: RepairPlan, written: Path, tag: str | None, inp: Path,
            on_progress: Callable[[int], None] | None) -> ScanReport:
    """Re-scan the written copy (must be clean) and re-read every patched element."""
    report = scan(written, tag=tag, nonfinite_only=True, on_progress=on_progress)
    if not report.clean:
        raise RepairError(f"the repaired copy of '{plan.input}' still holds non-finite values "
                          f"({'; '.join(f.describe() for f in report.findings)}); nothing was written. "
                          "This is a dsckpt bug: please report it")
    if plan.loss_scale is not None:
        check_loss_scale(plan.loss_scale, written, inp, safe_load.load)
    logical, cache, _ = open_target(written, tag=tag)
    for p in plan.patches:
        e = logical.entry(p.name)
        for t in p.targets:
            piece = next((q for q in e.pieces if q.role is t.role and q.replica == t.replica
                          and (t.role is not Role.OPTIM_STATE or q.state_key == t.state_key)), None)
            if piece is None:
                raise RepairError(f"repaired copy lost the {t.role.value} copy of '{p.name}'; nothing was written")
            got = read_piece(piece, e.shape, cache, name=p.name).reshape(-1)[p.indices]
            want = p.values.to(got.dtype)
            if p.promote_to and got.dtype != getattr(torch, p.promote_to):
                raise RepairError(f"'{p.name}' in {t.file.name} was not stored as {p.promote_to}")
            if not torch.equal(got, want):
                raise RepairError(f"'{p.name}' in {t.file.name} does not hold the planned values after "
                                  "writing; nothing was written")
    return report


def _run_safetensors(plan: RepairPlan, out: Path, on_progress: Callable[[int], None] | None) -> RepairResult:
    from .writers.safetensors import TensorSpec, write_safetensors

    refs, metadata = read_safetensors_header(plan.input)
    by_name = {p.name: p for p in plan.patches}
    specs = []
    for name, ref in refs.items():
        p = by_name.get(name)
        dtype = p.promote_to if p is not None and p.promote_to else str(ref.dtype).removeprefix("torch.")
        specs.append(TensorSpec(name, dtype, tuple(ref.shape)))

    def produce(spec: TensorSpec) -> torch.Tensor:
        dtype = getattr(torch, spec.dtype)
        t = refs[spec.name].load().to(dtype).clone()
        p = by_name.get(spec.name)
        if p is not None:
            t.view(-1)[p.indices] = p.values.to(dtype)
        return t

    # Written and verified inside a temp folder beside OUT (named like every dsckpt temp, so a killed
    # run's leftover is found and removed), then moved into place.
    with scratch_dir(out) as tmp_dir:
        tmp = tmp_dir / out.name
        write_safetensors(tmp, specs, produce, metadata=metadata or None)
        report = scan(tmp, nonfinite_only=True, on_progress=on_progress)
        if not report.clean:
            raise RepairError(f"the repaired copy of '{plan.input}' still holds non-finite values; nothing was "
                              "written. This is a dsckpt bug: please report it")
        new_refs, _ = read_safetensors_header(tmp)
        for p in plan.patches:
            got = new_refs[p.name].read().reshape(-1)[p.indices]
            if not torch.equal(got, p.values.to(got.dtype)):
                raise RepairError(f"'{p.name}' does not hold the planned values after writing; nothing was written")
        os.replace(tmp, out)
    return RepairResult(plan, out, (out,), report)
