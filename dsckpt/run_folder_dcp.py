"""``to-dcp`` of a Trainer ``checkpoint-N/`` or an Accelerate ``save_state`` folder: the folder the same client
resumes from under FSDP2.

What the clients read there (transformers 5.23 ``Trainer``, accelerate 1.15, ``fsdp_version: 2`` with
``SHARDED_STATE_DICT``; accelerate/utils/fsdp_utils.py ``load_fsdp_model`` / ``load_fsdp_optimizer``)::

    pytorch_model_fsdp_0/    DCP folder of {"model": get_model_state_dict(model)}
    optimizer_0/             DCP folder of {"optimizer": get_optimizer_state_dict(model, optimizer)}
    scheduler.pt             Trainer: torch.load(weights_only=True) -> lr_scheduler.load_state_dict. The Trainer
                             loads optimizer_0 only when scheduler.pt is there too (_load_optimizer_and_scheduler)
    trainer_state.json       Trainer: read first (global step, log history, callbacks)
    rng_state_{rank}.pth     Trainer: one per process
    scheduler.bin, random_states_{i}.pkl, custom_checkpoint_{i}.pkl, sampler.bin ...   Accelerate's load_state

Both DCP folders are written by :mod:`dsckpt.dcp_writer` (the same tensors as a plain ``to-dcp``: fp32 masters, every
optimizer state tensor, ``step``, the param groups); every other file is carried byte for byte from CKPT
(:func:`dsckpt.hf.plan_resume_files`, at the checkpoint's own process count), except the Trainer's ``scheduler.pt``,
which is written from the LR-scheduler state DeepSpeed saved (``lr_scheduler`` in the model-states file) when the
Trainer handed its scheduler to DeepSpeed (then it wrote none itself).

**The Trainer's param groups.** Under DeepSpeed with an ``optimizer`` section in the DeepSpeed config, the Trainer
let DeepSpeed build the optimizer: one param group of every trained param. Under FSDP2 the Trainer builds its own
(``Trainer.create_optimizer``): two groups, the params ``get_decay_parameter_names`` lists and the others. DCP loads
groups by position and ``set_optimizer_state_dict`` matches a loaded group to the optimizer's group holding its
params, so O must have the Trainer's groups. :func:`trainer_param_groups` asks the installed transformers for them
(its own rule, on the model built from ``config.json`` on the meta device), and :func:`regroup` gives each of those
groups the hyper-parameters of the DeepSpeed group its params came from, so that the resumed run trains on with
DeepSpeed's settings (``weight_decay`` of the norms included). Per-group lists of the scheduler state (``base_lrs``,
``_last_lr``, ``lr_lambdas``) follow the same mapping. An Accelerate user builds the optimizer, so its groups are the
ones DeepSpeed saved and are kept.

:func:`plan_run_folder_dcp` is pure (it reads only pickle metadata, through ``cache``); :func:`run_run_folder_dcp`
writes OUT atomically as one folder.
"""

from __future__ import annotations

import enum
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .atomic import atomic_dir, claim_output
from .dcp_writer import DEFAULT_WORKERS, DcpGroup, DcpPlan, DcpTensor, plan_to_dcp, save_dcp_into, split_dcp_plan
from .errors import UnsupportedCheckpointError
from .hf import FileRole, HfFilesPlan, LeftOut, copy_files, is_accelerate_folder, is_hf_folder, plan_resume_files
from .model import LogicalCheckpoint
from .readers import FileCache

if TYPE_CHECKING:
    import torch

__all__ = [
    "RunFolderClient",
    "RunFolderDcpPlan",
    "SchedulerOut",
    "plan_run_folder_dcp",
    "regroup",
    "regroup_scheduler_state",
    "run_folder_client",
    "run_run_folder_dcp",
    "trainer_param_groups",
]

#: accelerate 1.15 utils/constants.py: FSDP_MODEL_NAME, OPTIMIZER_NAME; index 0 (one model, one optimizer)
MODEL_FOLDER = "pytorch_model_fsdp_0"
OPTIM_FOLDER = "optimizer_0"
#: the top-level keys save_fsdp_model / save_fsdp_optimizer put around M and O
MODEL_KEY = "model"
OPTIM_KEY = "optimizer"
TRAINER_SCHEDULER = "scheduler.pt"  # transformers trainer.py SCHEDULER_NAME


class RunFolderClient(enum.Enum):
    TRAINER = "Hugging Face Trainer"
    ACCELERATE = "Accelerate"


def run_folder_client(root: str | os.PathLike[str]) -> RunFolderClient | None:
    """Who wrote the DeepSpeed save dir ``root``: the Trainer (a ``trainer_state.json`` beside the tag), Accelerate's
    ``save_state`` (``random_states_{i}.pkl`` / ``custom_checkpoint_{i}.pkl``), or neither (None)."""
    root = Path(root)
    if is_hf_folder(root) and (root / "trainer_state.json").is_file():
        return RunFolderClient.TRAINER
    if is_accelerate_folder(root):
        return RunFolderClient.ACCELERATE
    return None


@dataclass(frozen=True)
class SchedulerOut:
    """The Trainer's ``scheduler.pt`` in OUT: ``state`` torch.save'd (plain values only), from ``source``."""

    name: str
    source: Path
    state: dict[str, Any]
    note: str


@dataclass(frozen=True)
class RunFolderDcpPlan:
    output: Path
    client: RunFolderClient
    model: DcpPlan  # OUT/pytorch_model_fsdp_0: {"model": M}
    optim: DcpPlan  # OUT/optimizer_0: {"optimizer": O}
    files: HfFilesPlan  # carried byte for byte
    scheduler: SchedulerOut | None
    regrouped: bool  # O's groups are the Trainer's, not DeepSpeed's

    @property
    def total_nbytes(self) -> int:
        return self.model.total_nbytes + self.optim.total_nbytes

    @property
    def output_nbytes_bound(self) -> int:
        return self.model.output_nbytes_bound + self.optim.output_nbytes_bound + self.files.nbytes + 65536

    def describe(self) -> list[str]:
        lines = [f"  {MODEL_FOLDER}/: {len(self.model.tensors)} tensors ({{\"{MODEL_KEY}\": M}})",
                 f"  {OPTIM_FOLDER}/: {len(self.optim.tensors)} tensors ({{\"{OPTIM_KEY}\": O}}, "
                 f"{self.optim.optimizer_class})"]
        for g in self.optim.groups:
            lines.append(f"    param group {g.index}: {len(g.params)} params, "
                         + ", ".join(f"{k} {v!r}" for k, v in g.hyperparams))
        if self.scheduler is not None:
            lines.append(f"  write {self.scheduler.name} ({self.scheduler.note})")
        return lines + self.files.describe()


# --------------------------------------------------------------------------------------------
# plan


def regroup(groups: tuple[DcpGroup, ...], target: tuple[tuple[str, ...], ...],
            where: str) -> tuple[tuple[DcpGroup, ...], tuple[int, ...]]:
    """O's param groups as ``target`` (the FQNs of each group the resuming optimizer has, in its order), each with
    the hyper-parameters of the DeepSpeed group its params come from; and for each new group the position of that
    group in ``groups`` (an empty new group takes the first group's). Pure.

    Refuses a target that is not a partition of the same params, and a new group whose params come from DeepSpeed
    groups with different hyper-parameters (one optimizer group cannot hold both)."""
    fqn_to_group = {f: i for i, g in enumerate(groups) for f in g.params}
    wanted = [f for t in target for f in t]
    missing = sorted(set(fqn_to_group) - set(wanted))
    extra = sorted(set(wanted) - set(fqn_to_group))
    doubled = sorted({f for f in wanted if wanted.count(f) > 1})
    if missing or extra or doubled:
        parts = [f"{what}: {', '.join(names[:3])}" + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")
                 for what, names in (("trained in the checkpoint but in no group of the resuming optimizer", missing),
                                     ("in the resuming optimizer but not trained in the checkpoint", extra),
                                     ("in two groups of the resuming optimizer", doubled)) if names]
        raise UnsupportedCheckpointError(f"'{where}': the resuming optimizer's param groups do not hold the "
                                         f"checkpoint's trained params ({'; '.join(parts)}); nothing was written "
                                         "(--plain writes one DCP folder in DeepSpeed's groups)")
    out: list[DcpGroup] = []
    sources: list[int] = []
    for k, fqns in enumerate(target):
        srcs = sorted({fqn_to_group[f] for f in fqns})
        hyper = {repr(groups[i].hyperparams) for i in srcs}
        if len(hyper) > 1:
            a, b = srcs[0], next(i for i in srcs if groups[i].hyperparams != groups[srcs[0]].hyperparams)
            diff = [key for key, v in groups[a].hyperparams if dict(groups[b].hyperparams).get(key) != v]
            raise UnsupportedCheckpointError(
                f"'{where}': the resuming optimizer's param group {k} holds params of DeepSpeed's groups {a} and {b}, "
                f"which differ in {', '.join(diff) or 'their keys'}; one group cannot hold both; nothing was written")
        src = srcs[0] if srcs else 0
        out.append(DcpGroup(k, tuple(fqns), groups[src].hyperparams))
        sources.append(src)
    return tuple(out), tuple(sources)


def regroup_scheduler_state(state: dict[str, Any], n_groups: int, sources: tuple[int, ...]) -> dict[str, Any]:
    """A torch LR scheduler's ``state_dict()`` for the regrouped optimizer: every list with one entry per old group
    (``base_lrs``, ``_last_lr``, ``lr_lambdas`` ...) becomes one entry per new group, taken from its source group.
    Pure."""
    return {k: [v[i] for i in sources] if isinstance(v, list) and len(v) == n_groups else v
            for k, v in state.items()}


_PLAIN = (bool, int, float, str, type(None))


def _plain_value(obj: Any, where: str, path: str) -> Any:
    """``obj`` as builtins (what ``torch.load(weights_only=True)`` reads back), else a one-line refusal."""
    if isinstance(obj, _PLAIN):
        return obj
    if type(obj) in (dict, OrderedDict) and all(isinstance(k, _PLAIN) for k in obj):
        return {k: _plain_value(v, where, f"{path}[{k!r}]") for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_plain_value(v, where, f"{path}[{i}]") for i, v in enumerate(obj))
    raise UnsupportedCheckpointError(
        f"'{where}': the LR-scheduler state holds a {type(obj).__module__}.{type(obj).__qualname__} at {path}; "
        "dsckpt writes scheduler.pt from plain values only; nothing was written")


def _model_states_file(ckpt: LogicalCheckpoint) -> Path | None:
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if ckpt.zero_stage == 3 else "mp_rank_00_model_states.pt"
    return next((f for f in ckpt.files if f.name == name and f.parent == ckpt.tag_dir), None)


def _trainer_scheduler(ckpt: LogicalCheckpoint, cache: FileCache, n_groups: int,
                       sources: tuple[int, ...] | None) -> SchedulerOut | None:
    """The Trainer's scheduler.pt: its own (a scheduler DeepSpeed did not wrap; None: carried byte for byte when the
    groups are kept) or DeepSpeed's ``lr_scheduler``."""
    root = ckpt.root
    own = root / TRAINER_SCHEDULER
    if own.is_file() and sources is None:
        return None
    if own.is_file():
        from . import safe_load

        source, raw, note = own, safe_load.load(own), f"the Trainer's own {TRAINER_SCHEDULER}"
    else:
        source = _model_states_file(ckpt) or ckpt.tag_dir
        raw = cache.tree(source).get("lr_scheduler") if source.is_file() else None
        note = f"the LR-scheduler state DeepSpeed saved in {source.name}"
        if raw is None:
            raise UnsupportedCheckpointError(
                f"'{root}': no LR-scheduler state (no {TRAINER_SCHEDULER}, no lr_scheduler in {source.name}); "
                f"the Trainer loads optimizer_0 only together with {TRAINER_SCHEDULER}; nothing was written")
    state = _plain_value(raw, str(source), "lr_scheduler")
    if not isinstance(state, dict) or "last_epoch" not in state or "base_lrs" not in state:
        keys = ", ".join(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise UnsupportedCheckpointError(
            f"'{source}': the LR-scheduler state ({keys}) is not a torch.optim.lr_scheduler one (a DeepSpeed-config "
            "scheduler such as WarmupLR?); the Trainer under FSDP2 builds a torch scheduler; nothing was written")
    if sources is not None and len(state["base_lrs"]) != n_groups:
        raise UnsupportedCheckpointError(
            f"'{source}': the LR-scheduler state has {len(state['base_lrs'])} base_lrs for {n_groups} param "
            "group(s); nothing was written")
    if sources is not None:
        state = regroup_scheduler_state(state, n_groups, sources)
        note += f", its per-group lists regrouped to the Trainer's {len(sources)} param groups"
    return SchedulerOut(TRAINER_SCHEDULER, source, state, note)


def plan_run_folder_dcp(ckpt: LogicalCheckpoint, cache: FileCache, output: str | os.PathLike[str], *,
                        client: RunFolderClient, dtype: str | torch.dtype = "float32",
                        target_groups: tuple[tuple[str, ...], ...] | None = None) -> RunFolderDcpPlan:
    """Plan OUT (see the module docstring) for ``ckpt``, a checkpoint in a Trainer / Accelerate folder.
    ``target_groups``: the resuming Trainer's param groups (:func:`trainer_param_groups`); None keeps DeepSpeed's.
    Reads pickle metadata only; writes nothing."""
    out = Path(output)
    base = plan_to_dcp(ckpt, out, dtype=dtype)
    groups, sources = None, None
    if target_groups is not None and tuple(target_groups) != tuple(g.params for g in base.groups):
        groups, sources = regroup(base.groups, tuple(tuple(t) for t in target_groups), str(ckpt.root))
    model, optim = split_dcp_plan(base, out / MODEL_FOLDER, out / OPTIM_FOLDER, model_key=MODEL_KEY,
                                  optim_key=OPTIM_KEY, groups=groups)
    # DeepSpeed tag folders (another tag of the same save dir too): none is carried
    tag_dirs = frozenset(p.name for p in ckpt.root.iterdir() if p.is_dir() and any(p.glob("*model_states.pt")))
    tags = sorted(tag_dirs | {ckpt.tag})
    if client is RunFolderClient.ACCELERATE and len(tags) > 1:
        # save_state writes pytorch_model_{i} per prepared model and load_state reads pytorch_model_fsdp_{i} for each
        raise UnsupportedCheckpointError(
            f"'{ckpt.root}' holds {len(tags)} DeepSpeed tags ({', '.join(tags)}): several prepared models, and "
            "to-dcp writes the FSDP2 folder of one; pass --plain --tag TAG to export each as a DCP folder")
    files = plan_resume_files(ckpt.root, ckpt.dp_world_size, tag=ckpt.tag, tag_dirs=tag_dirs | {ckpt.tag})
    assert files is not None, "run_folder_client() said this is a Trainer / Accelerate folder"
    scheduler = None
    if client is RunFolderClient.TRAINER:
        scheduler = _trainer_scheduler(ckpt, cache, len(base.groups), sources)
        if scheduler is not None:
            files = replace(files, copies=tuple(c for c in files.copies if c.dest_name != TRAINER_SCHEDULER))
    files = replace(files, copies=tuple(c for c in files.copies if c.dest_name not in (MODEL_FOLDER, OPTIM_FOLDER)),
                    left_out=(LeftOut(ckpt.tag_dir, FileRole.DEEPSPEED, f"the DeepSpeed tag folder: its state is in "
                                                                         f"{MODEL_FOLDER}/ and {OPTIM_FOLDER}/"),
                              *files.left_out))
    return RunFolderDcpPlan(out, client, model, optim, files, scheduler, groups is not None)


def trainer_param_groups(root: str | os.PathLike[str], trained: frozenset[str]) -> tuple[tuple[str, ...], ...]:
    """The param groups ``Trainer.create_optimizer`` builds (transformers 5.23: the params ``get_decay_parameter_names``
    lists, then the others; trained params only, tied ones once, in ``named_parameters`` order), for the model
    ``config.json`` of ``root`` describes, built on the meta device by the installed transformers with its own rule.
    ``trained``: the checkpoint's trained params (the Trainer leaves out those with ``requires_grad=False``).

    Imports transformers (seconds). Refuses an architecture transformers does not have (remote code)."""
    root = Path(root)
    try:
        import torch
        import transformers
        from transformers import AutoConfig
        from transformers.trainer import Trainer
    except ImportError as e:
        raise UnsupportedCheckpointError(
            f"'{root}': writing a Trainer folder for FSDP2 needs transformers (to learn the param groups the "
            f"Trainer builds): {e}; install it, or pass --plain for one DCP folder") from e
    if not (root / "config.json").is_file():
        raise UnsupportedCheckpointError(f"'{root}' has no config.json, so the Trainer's param groups cannot be "
                                         "learned; pass --plain for one DCP folder")
    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:  # remote code (auto_map), an unknown model_type
        raise UnsupportedCheckpointError(
            f"'{root}/config.json': transformers cannot read it ({e}), so the Trainer's param groups cannot be "
            "learned; pass --plain for one DCP folder") from e
    archs = [a for a in (getattr(config, "architectures", None) or []) if hasattr(transformers, a)]
    if not archs:
        raise UnsupportedCheckpointError(
            f"'{root}/config.json': architectures {getattr(config, 'architectures', None)} is not a transformers "
            "class (remote code?), so the Trainer's param groups cannot be learned; pass --plain for one DCP folder")
    with torch.device("meta"):
        model = getattr(transformers, archs[0])(config)
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]  # uses no Trainer state
    # a tied param under its first name (named_parameters' and get_optimizer_state_dict's), trained when the
    # checkpoint trains it under any of its names
    names_of: dict[int, list[str]] = {}
    for n, q in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(q), []).append(n)
    names = [ns[0] for ns in names_of.values() if any(n in trained for n in ns)]
    return (tuple(n for n in names if n in decay), tuple(n for n in names if n not in decay))


# --------------------------------------------------------------------------------------------
# do


def run_run_folder_dcp(plan: RunFolderDcpPlan, cache: FileCache, *, force: bool = False,
                       on_tensor: Callable[[DcpTensor], None] | None = None,
                       workers: int = DEFAULT_WORKERS) -> list[Path]:
    """Write OUT atomically: both DCP folders, scheduler.pt, the carried files; every record read is CRC-checked
    before OUT is moved into place. Returns the top-level entries written."""
    import torch

    synced: list[Path] = []  # the DCP data files, fsync'd by their writer threads
    with claim_output(plan.output, force=force, nbytes=plan.output_nbytes_bound), \
            atomic_dir(plan.output, synced=synced) as tmp:
        for sub in (plan.model, plan.optim):
            folder = tmp / sub.output.name
            folder.mkdir()
            save_dcp_into(folder, sub, cache, on_tensor=on_tensor, workers=workers, synced=synced)
        if plan.scheduler is not None:
            with open(tmp / plan.scheduler.name, "wb") as f:
                torch.save(plan.scheduler.state, f)
        copy_files(plan.files, tmp)
        cache.finish_checks()
        names = sorted(p.name for p in tmp.iterdir())
    return [plan.output / n for n in names]
