"""What the readers share: the parsed-file cache, key-path lookup, metadata helpers."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import crc, parsed_tree, safe_load
from ..dtypes import dtype_info
from ..errors import CorruptCheckpointError
from ..model import Fragment, Kind, OptimizerGroup, Piece, Precision, Role, TensorEntry
from ..nvme_swap import SWAP_SUFFIX
from ..stand_ins import DeepSpeedObject
from ..tensor_ref import TensorRef
from ..validate import validate_tree

__all__ = ["ADAM_STATE_KEYS", "FileCache", "dtype_name", "int_or_none", "lookup", "merge_stage_groups",
           "metadata_from_model_states", "optimizer_groups", "optimizer_type", "saved_step", "whole"]

#: the per-element state keys of DeepSpeed's Adam/AdamW, in the optimizer's order
ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")


class FileCache:
    """Parses each checkpoint file once (pickle metadata only; tensor bytes stay on disk). A file's
    tree is a dict, or a :class:`TensorRef` for a file holding one bare tensor."""

    def __init__(self) -> None:
        self._trees: dict[Path, Any] = {}
        #: what each parsed file's container says about it (:class:`dsckpt.safe_load.FileInfo`)
        self.infos: dict[Path, safe_load.FileInfo] = {}

    def tree(self, path: Path) -> Any:
        if path not in self._trees:
            if path.name.endswith(SWAP_SUFFIX):  # NVMe swap file: raw fp32 bytes (dsckpt.nvme_swap)
                self._trees[path], self.infos[path] = safe_load.load_raw(path, "float32")
                return self._trees[path]
            obj, self.infos[path] = safe_load.load_with_info(path)
            # A bare tensor is a whole file only in universal checkpoints (ds_to_universal's ZeRO-3
            # fp32/exp_avg/exp_avg_sq.pt and step.pt); its key path is (). A bare int only in their step.pt, for an
            # optimizer keeping its step as a Python int (FusedLamb, DeepSpeedCPULion, FusedAdam).
            bare_step = path.name == "step.pt" and isinstance(obj, int) and not isinstance(obj, bool)
            if not isinstance(obj, (dict, TensorRef)) and not bare_step:
                raise CorruptCheckpointError(
                    f"{path}: expected a dict at the top level, found {type(obj).__name__}; "
                    "this is not a DeepSpeed checkpoint file"
                )
            validate_tree(path, obj)  # names, shapes and key types, once for every command
            self._trees[path] = obj
        return self._trees[path]

    def tensor(self, path: Path, key: tuple[Any, ...]) -> TensorRef:
        obj = lookup(self.tree(path), key, path)
        if not isinstance(obj, TensorRef):
            raise CorruptCheckpointError(
                f"{path}: expected a tensor at {format_key(key)}, found {type(obj).__name__}"
            )
        return obj

    def forget(self, path: Path) -> None:
        """Drop a parsed file, first completing the CRC-32 checks of what was read from it."""
        tree = self._trees.pop(path, None)
        if tree is not None:
            parsed_tree.finish_checks(tree)

    def tensor_refs(self) -> Iterator[TensorRef]:
        """Every tensor of every file parsed so far, files in path order (the same order in every process that
        parsed the same files), each file's tensors in tree order."""
        for path in sorted(self._trees, key=str):
            for _, ref in parsed_tree.walk_tensors(self._trees[path]):
                yield ref

    def finish_checks(self) -> int:
        """Complete the CRC-32 checks of every zip record read through this cache: records read only
        partly have their other bytes read now (see :mod:`dsckpt.crc`). Every command calls this
        before it reports success or moves an output into place.

        Raises :class:`CorruptCheckpointError` naming every damaged record. Returns the number of
        records verified."""
        return crc.finish(ref.storage.check for ref in self.tensor_refs())


def format_key(key: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in key)


def lookup(tree: Any, key: tuple[Any, ...], path: Path) -> Any:
    """Follow ``key`` (dict keys, list indices, stand-in attributes) into a parsed file."""
    obj = tree
    for i, k in enumerate(key):
        try:
            if isinstance(obj, DeepSpeedObject):
                obj = obj.__dict__[k]
            else:
                obj = obj[k]
        except (KeyError, IndexError, TypeError):
            raise CorruptCheckpointError(
                f"{path}: missing entry {format_key(key[: i + 1])}; the file does not have the layout "
                "its metadata announces"
            ) from None
    return obj


def dtype_name(dtype: object) -> str:
    """``"bfloat16"`` for a dtype name, ``"torch.bfloat16"`` or a ``torch.dtype``."""
    return str(dtype).removeprefix("torch.")


def is_floating(dtype: object) -> bool:
    return dtype_info(dtype).is_floating


def whole(path: Path, key: tuple[Any, ...], ref: TensorRef, rank: int | None = None) -> tuple[Fragment, ...]:
    """A piece made of one whole stored tensor."""
    return (Fragment(path, key, 0, ref.numel, 0, rank),)


def module_piece(path: Path, name: str, ref: TensorRef, replica: int = 0, rank: int | None = None) -> Piece:
    return Piece(Role.MODULE, dtype_name(ref.dtype_name), whole(path, ("module", name), ref, rank), replica)


@dataclass(frozen=True)
class CommonMeta:
    ds_version: str | None
    global_steps: int | None
    global_samples: int | None
    dp_world_size: int | None
    mp_world_size: int | None
    ds_config: dict[str, Any] | None
    buffer_names: tuple[str, ...]
    tp_degree: int
    pp_degree: int


def int_or_none(x: Any) -> int | None:
    """A counter (``global_steps``, Adam's ``step``, a world size) stored as a number or a one-element
    tensor, as an int; None for anything else."""
    if isinstance(x, TensorRef):
        x = x.item() if x.numel == 1 else None
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def saved_step(x: Any) -> int | float | None:
    """An optimizer ``step`` as saved: a number, or a one-element tensor's value (torch keeps Adam's step as a
    float tensor); None for anything else."""
    if isinstance(x, TensorRef):
        return x.item() if x.numel == 1 else None
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def optimizer_groups(param_groups: Any, names: Sequence[Sequence[str]],
                     states: Sequence[Any]) -> tuple[OptimizerGroup, ...]:
    """The saved ``param_groups`` as :class:`OptimizerGroup` s: group ``g`` holds ``names[g]`` (logical names,
    in the optimizer's order) and its step is the ``step`` of ``states[g]`` (the state of one of its params or
    flat partitions; None where the group has no state yet). () when the groups are not a list of mappings."""
    if not isinstance(param_groups, list) or not all(isinstance(pg, Mapping) for pg in param_groups):
        return ()
    out = []
    for g, pg in enumerate(param_groups):
        st = states[g] if g < len(states) else None
        step = saved_step(st.get("step")) if isinstance(st, Mapping) else None
        out.append(OptimizerGroup(g, tuple(names[g]) if g < len(names) else (), step,
                                  tuple((str(k), v) for k, v in pg.items() if k != "params")))
    return tuple(out)


def merge_stage_groups(stage_groups: Sequence[Sequence[OptimizerGroup]]
                       ) -> tuple[tuple[OptimizerGroup, ...], str | None]:
    """One optimizer's groups from the groups of several pipeline stages (DeepSpeed keeps one optimizer per stage,
    each built from the same param-group recipe over the stage's own params): group ``g`` of every stage becomes
    group ``g``, holding the stages' params in stage order (a tied module's params, trained on several stages,
    once). Only where every stage has the same number of groups and group ``g`` has the same hyper-parameters and
    step on every stage; otherwise ``((), why)``, the first disagreement named."""
    if not stage_groups or any(not groups for groups in stage_groups):
        s = next((s for s, groups in enumerate(stage_groups) if not groups), 0)
        return (), f"stage {s}'s optimizer param groups are not saved"
    first = stage_groups[0]
    for s, groups in enumerate(stage_groups[1:], start=1):
        if len(groups) != len(first):
            return (), f"stage {s} has {len(groups)} optimizer param groups, stage 0 has {len(first)}"
        for g0, g in zip(first, groups):
            h0, h = dict(g0.hyperparams), dict(g.hyperparams)
            diff = next((k for k in (*h0, *h) if k not in h or k not in h0 or h[k] != h0[k]), None)
            if diff is not None:
                return (), (f"param group {g0.index} has {diff}={h.get(diff, '(absent)')!r} on stage {s} but "
                            f"{h0.get(diff, '(absent)')!r} on stage 0")
            if g.step != g0.step:
                return (), f"param group {g0.index} has step {g.step} on stage {s} but {g0.step} on stage 0"
    return tuple(OptimizerGroup(g0.index, tuple(dict.fromkeys(n for groups in stage_groups
                                                              for n in groups[i].param_names)),
                                g0.step, g0.hyperparams) for i, g0 in enumerate(first)), None


def optimizer_type(ds_config: Any) -> str | None:
    """The optimizer ``type`` the ds_config names (DeepSpeed's name or a ``torch.optim`` class name), or None."""
    opt = ds_config.get("optimizer") if isinstance(ds_config, Mapping) else None
    t = opt.get("type") if isinstance(opt, Mapping) else None
    return str(t) if t is not None else None


def metadata_from_model_states(tree: Mapping[str, Any]) -> CommonMeta:
    # checkpoint_parallel_dimensions is newer than DeepSpeed 0.18.9 (absent in 0.10.3-0.18.9 files)
    dims = tree.get("checkpoint_parallel_dimensions") or {}
    cfg = tree.get("ds_config")
    return CommonMeta(
        ds_version=str(tree["ds_version"]) if tree.get("ds_version") is not None else None,
        global_steps=int_or_none(tree.get("global_steps")),
        global_samples=int_or_none(tree.get("global_samples")),
        dp_world_size=int_or_none(tree.get("dp_world_size")),
        mp_world_size=int_or_none(tree.get("mp_world_size")),
        ds_config=cfg if isinstance(cfg, dict) else None,
        buffer_names=tuple(tree.get("buffer_names") or ()),
        tp_degree=int(dims.get("tp_degree", 1) or 1) if isinstance(dims, dict) else 1,
        pp_degree=int(dims.get("pp_degree", 1) or 1) if isinstance(dims, dict) else 1,
    )


def precision_of(config: Mapping[str, Any] | None, sample_dtype: str | None) -> Precision:
    """The training precision: from the config, else from the dtype of the module weights."""
    if config:
        for key, prec in (("bf16", Precision.BF16), ("bfloat16", Precision.BF16), ("fp16", Precision.FP16)):
            section = config.get(key)
            if isinstance(section, dict) and section.get("enabled") is True:
                return prec
    if sample_dtype == "bfloat16":
        return Precision.BF16
    if sample_dtype == "float16":
        return Precision.FP16
    return Precision.FP32


def step_of(state: Any) -> int | None:
    """Adam's step count from a torch optimizer ``state`` mapping (first entry that has one)."""
    if isinstance(state, Mapping):
        for v in state.values():
            if isinstance(v, Mapping) and "step" in v:
                return int_or_none(v["step"])
    return None


def buffer_entries(path: Path, module: Mapping[str, Any], buffer_names: tuple[str, ...],
                   replicas: list[tuple[Path, Mapping[str, Any], int]] | None = None) -> list[TensorEntry]:
    """Entries for the persistent buffers in a module state dict (extra replicas: stage-3 ranks)."""
    out = []
    for name in buffer_names:
        ref = module.get(name)
        if not isinstance(ref, TensorRef):
            continue
        pieces = [module_piece(path, name, ref)]
        for i, (rpath, rmodule, rank) in enumerate(replicas or (), start=1):
            rref = rmodule.get(name)
            if isinstance(rref, TensorRef) and rref.numel == ref.numel:
                pieces.append(module_piece(rpath, name, rref, replica=i, rank=rank))
        out.append(TensorEntry(name, ref.shape, Kind.BUFFER, False, tuple(pieces)))
    return out


def alias_entry(name: str, source: TensorEntry) -> TensorEntry:
    return TensorEntry(name, source.shape, source.kind, source.trainable, source.pieces,
                       tied_to=source.name, group=source.group, padding=source.padding,
                       padding_rows=source.padding_rows)


def order_like_module(entries: dict[str, TensorEntry], module_names: list[str]) -> list[TensorEntry]:
    """Entries in the module's state-dict order; names the module lacks go last, in given order."""
    ordered = [entries[n] for n in module_names if n in entries]
    seen = set(module_names)
    ordered += [e for n, e in entries.items() if n not in seen]
    return ordered
