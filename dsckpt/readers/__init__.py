"""Readers: one per DeepSpeed layout, each producing a :class:`~dsckpt.model.LogicalCheckpoint`.

Raw DeepSpeed dicts never leave this package.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..layout import classify_files, find_tag_dir, is_universal_dir
from ..model import LogicalCheckpoint
from .common import FileCache, metadata_from_model_states

__all__ = ["FileCache", "read_checkpoint"]


def read_checkpoint(path: str | os.PathLike[str], *, tag: str | None = None,
                    cache: FileCache | None = None, allow_mixed_saves: bool = False,
                    check_master_copies: bool = False,
                    tied_keys: Mapping[int, str] | None = None) -> LogicalCheckpoint:
    """Open the DeepSpeed checkpoint at ``path`` (save dir or tag folder) as one logical model.

    A rank file that is a copy of another (renamed, or two ranks holding the same bytes) is refused always; rank
    files that do not all come from one save are refused (:mod:`.same_save`) unless
    ``allow_mixed_saves`` (``verify`` lists the disagreements instead).

    ``check_master_copies`` (the commands that export or rewrite the fp32 master: ``to-fp32``, ``reshard``): where
    both an fp32 master and a module copy are saved (ZeRO-1/2, TP), their first and last elements of every param are
    compared (:func:`.same_save.sampled_copy_disagreements`, ``verify``'s check in its cheap form), so that files of
    two saves of one step cannot be exported together silently. ``scan`` and ``verify`` compare every element and
    report disagreements as findings instead.

    ``tied_keys`` (layer index -> ``TiedLayerSpec`` key): the keys of the tied modules of DeepSpeed's own fp32 stage-0
    pipeline save, which no file states (:mod:`.pipeline_binding`); elsewhere unused."""
    cache = cache if cache is not None else FileCache()
    logical = _read(path, tag, cache, tied_keys)
    _check_rank_identity(logical, cache)
    if not allow_mixed_saves:
        _check_one_save(logical, cache, check_master_copies)
    return logical


def _check_rank_identity(ckpt: LogicalCheckpoint, cache: FileCache) -> None:
    from .same_save import rank_identity_problems

    for f in ckpt.files:
        cache.tree(f)
    problems = rank_identity_problems(ckpt.files, cache.infos)
    if problems:
        raise CorruptCheckpointError("; ".join(problems))


def _check_one_save(ckpt: LogicalCheckpoint, cache: FileCache, check_master_copies: bool) -> None:
    from .same_save import file_facts, same_save_problems, sampled_copy_disagreements

    facts = file_facts(ckpt.files, {f: cache.tree(f) for f in ckpt.files}, ckpt.tag_dir)
    problems = same_save_problems(facts)
    if problems:
        raise CorruptCheckpointError(f"'{ckpt.tag_dir}': " + "; ".join(f"{fact}: {msg}" for fact, msg in problems))
    # The facts above cannot tell two saves of the same step and config apart; the master and the module copy
    # can (ZeRO-1/2, TP: both are saved). ZeRO-3 saves no module copy: there nothing second can tell.
    disagreements = sampled_copy_disagreements(ckpt, cache) if check_master_copies else []
    if disagreements:
        # Bit rot in either copy disagrees too: a record that fails its CRC-32 is the precise answer.
        from ..crc import check_file_records

        damaged = [p.message for f in dict.fromkeys(f for _, files in disagreements for f in files)
                   for p in check_file_records(f).problems]
        raise CorruptCheckpointError("; ".join(damaged) if damaged else
                                     f"'{ckpt.tag_dir}': " + "; ".join(msg for msg, _ in disagreements))


def _read(path: str | os.PathLike[str], tag: str | None, cache: FileCache,
          tied_keys: Mapping[int, str] | None = None) -> LogicalCheckpoint:
    from .pipeline import read_pipeline
    from .stage0 import read_stage0
    from .tensor_parallel import read_tensor_parallel, with_tp1_record
    from .zero3 import read_zero3
    from .zero12 import read_zero12

    root, tag_name, tag_dir = find_tag_dir(path, tag)
    if is_universal_dir(tag_dir):
        from .universal import read_universal

        return read_universal(root, tag_name, tag_dir, cache)
    files = classify_files(root, tag_name, tag_dir)
    if files.layer_files:
        return read_pipeline(files, cache, tied_keys)
    if files.dp_mp_to_zero3_model_states:
        first = files.dp_mp_to_zero3_model_states[min(files.dp_mp_to_zero3_model_states)]
        if cache.tree(first).get("ds_autoep_layers"):
            from .autoep import read_autoep

            return read_autoep(files, cache)
        if files.mp_world_size > 1:
            return read_tensor_parallel(files, cache, files.mp_world_size)
        return with_tp1_record(read_zero3(files, cache), cache,
                               [p for _, p in sorted(files.dp_mp_to_zero3_model_states.items())])
    if 0 not in files.mp_to_model_states:
        raise CorruptCheckpointError(f"'{tag_dir}' has no mp_rank_00_model_states.pt; the save is incomplete")
    meta = metadata_from_model_states(cache.tree(files.mp_to_model_states[0]))
    if cache.tree(files.mp_to_model_states[0]).get("ds_autoep_layers"):
        from .autoep import read_autoep

        return read_autoep(files, cache)
    tp_size = max(files.mp_world_size, meta.mp_world_size or 1)
    if files.layer_expert_to_files or files.ep_mp_to_expp_optim_states:
        _refuse_tensor_parallel(tp_size, files)
        from .moe import read_moe

        return read_moe(files, cache)
    if tp_size > 1:
        return read_tensor_parallel(files, cache, tp_size)
    if files.dp_mp_to_optim_states:
        return with_tp1_record(read_zero12(files, cache), cache, [files.mp_to_model_states[0]])
    ms = cache.tree(files.mp_to_model_states[0])
    if not isinstance(ms.get("module"), Mapping):
        raise CorruptCheckpointError(f"{files.mp_to_model_states[0]}: no 'module' state dict")
    return with_tp1_record(read_stage0(files, cache), cache, [files.mp_to_model_states[0]])


def _refuse_tensor_parallel(mp_world_size: int, files: object) -> None:
    if mp_world_size > 1:
        raise UnsupportedCheckpointError(
            f"'{getattr(files, 'tag_dir', '?')}' was saved with model parallel size {mp_world_size} "
            "(tensor parallelism) together with Mixture-of-Experts, which is not supported yet"
        )
