"""ZeRO stage 0 (no partitioning): everything is in ``mp_rank_00_model_states.pt``.

Where the fp32 master lives (DEEPSPEED-NOTES 1.6):

* fp32 training: the module weights are the master; ``optimizer`` is a plain torch state dict.
* fp16/bf16 with ``FP16_Optimizer`` (fused; DeepSpeed's default for Adam, also stage-0 bf16):
  ``optimizer['fp32_groups_flat'][g]`` is the unpadded flat fp32 copy of group ``g``. No names are
  stored, but the saved module tensors are views into the 16-bit flat buffer of their group with the
  same layout, so a param's ``storage_offset`` is its offset in ``fp32_groups_flat[g]``.
* ``FP16_UnfusedOptimizer`` (e.g. SGD): ``optimizer['fp32_groups']`` lists per-param fp32 tensors in
  optimizer order.

None of these stores which param owns which optimizer-side tensor, so every binding is inferred, then
proven (:mod:`dsckpt.binding`): a master is attached to a name only when it rounds bit for bit to that
param's 16-bit copy and to no other equally shaped one, or, without value evidence (fp32), when shape and
module order leave a single choice. Anything else is recorded as an ambiguity; nothing is guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..binding import Ambiguity, Slot, ambiguity_from, order_candidates, resolve
from ..errors import CorruptCheckpointError
from ..layout import CheckpointFiles
from ..model import Fragment, Kind, LogicalCheckpoint, OptimizerGroup, Piece, Role, TensorEntry
from ..tensor_ref import TensorRef
from .common import (
    FileCache,
    alias_entry,
    buffer_entries,
    is_floating,
    metadata_from_model_states,
    module_piece,
    optimizer_groups,
    optimizer_type,
    order_like_module,
    precision_of,
    step_of,
)
from .values import Fingerprint, fingerprint_16bit, fingerprint_rounded, whole_storage

__all__ = ["module_params_and_aliases", "moment_pieces", "read_stage0", "state_shape"]


def module_params_and_aliases(module: Mapping[str, Any], buffer_names: set[str]) -> tuple[list[str], dict[str, str]]:
    """Unique param names in module order, and ``alias -> source`` for tied params (same view)."""
    first: dict[tuple[Any, ...], str] = {}
    unique: list[str] = []
    aliases: dict[str, str] = {}
    for name, ref in module.items():
        if name in buffer_names or not isinstance(ref, TensorRef):
            continue
        view = (ref.storage.path, ref.storage.key, ref.storage_offset, ref.shape, ref.stride)
        if view in first and ref.numel:
            aliases[name] = first[view]
        else:
            first[view] = name
            unique.append(name)
    return unique, aliases


def moment_pieces(path: Path, state_key: tuple[Any, ...], state: Any, src_offset: int, numel: int,
                  owner_numel: int | None = None) -> list[Piece]:
    """The optimizer states of a param: every key of its optimizer ``state`` whose tensor has one value per element
    of the tensor the state belongs to (``owner_numel`` elements: the flat master of a fused group, else the param
    itself), elements ``[src_offset, src_offset + numel)`` of it."""
    owner = numel if owner_numel is None else owner_numel
    pieces = []
    if isinstance(state, Mapping):
        for sk, ref in state.items():
            if (isinstance(ref, TensorRef) and len(ref.shape) > 0 and ref.numel == owner
                    and src_offset + numel <= ref.numel):
                pieces.append(Piece(Role.OPTIM_STATE, ref.dtype_name,
                                    (Fragment(path, (*state_key, sk), src_offset, numel, 0),), state_key=str(sk)))
    return pieces


def state_shape(st: Any) -> tuple[int, ...] | None:
    """The shape of a param's optimizer state (its first tensor that is not 0-d, as ``step`` is): what binds it."""
    if not isinstance(st, Mapping):
        return None
    ref = next((v for v in st.values() if isinstance(v, TensorRef) and len(v.shape) > 0), None)
    return tuple(ref.shape) if ref is not None else None


def read_stage0(files: CheckpointFiles, cache: FileCache) -> LogicalCheckpoint:
    ms_path = files.mp_to_model_states[0]
    ms = cache.tree(ms_path)
    meta = metadata_from_model_states(ms)
    module: Mapping[str, Any] = ms["module"]
    buffers = set(meta.buffer_names)
    unique, aliases = module_params_and_aliases(module, buffers)
    optimizer = ms.get("optimizer")
    step: int | None = None
    if isinstance(optimizer, Mapping) and "fp32_groups_flat" in optimizer:
        wrapper = "FP16_Optimizer"
        entries, ambiguities = _fused(ms_path, module, unique, optimizer)
        step = step_of((optimizer.get("optimizer_state_dict") or {}).get("state"))
    elif isinstance(optimizer, Mapping) and "fp32_groups" in optimizer:
        wrapper = "FP16_UnfusedOptimizer"
        entries, ambiguities = _unfused(ms_path, module, unique, optimizer)
        step = step_of((optimizer.get("optimizer_state_dict") or {}).get("state"))
    else:
        wrapper = "torch optimizer" if isinstance(optimizer, Mapping) else "none saved"
        entries, ambiguities = _plain(ms_path, module, unique, optimizer if isinstance(optimizer, Mapping) else None)
        step = step_of(optimizer.get("state")) if isinstance(optimizer, Mapping) else None
    for alias, source in aliases.items():
        entries[alias] = alias_entry(alias, entries[source])
    for e in buffer_entries(ms_path, module, meta.buffer_names):
        entries[e.name] = e
    sample = next((module[n].dtype_name for n in unique if is_floating(module[n].dtype_name)), None)
    inner = ((optimizer.get("optimizer_state_dict") if wrapper.startswith("FP16_") else optimizer)
             if isinstance(optimizer, Mapping) else None)
    return LogicalCheckpoint(
        root=files.root, tag=files.tag, tag_dir=files.tag_dir, layout="stage0", zero_stage=0,
        precision=precision_of(meta.ds_config, sample), dp_world_size=meta.dp_world_size or 1,
        pp_world_size=1, tp_world_size=1, ds_version=meta.ds_version, global_steps=meta.global_steps,
        global_samples=meta.global_samples, optimizer_step=step, optimizer_wrapper=wrapper,
        entries=tuple(order_like_module(entries, list(module))), files=tuple(files.all_files()),
        ds_config=meta.ds_config, ambiguities=tuple(ambiguities),
        optimizer_groups=_optimizer_groups(inner, entries, list(module)), optimizer_type=optimizer_type(meta.ds_config),
    )


def _optimizer_groups(inner: Any, entries: Mapping[str, TensorEntry],
                      module_order: list[str], by_module_order: bool = False) -> tuple[OptimizerGroup, ...]:
    """The torch optimizer's param groups (the inner one under FP16_Optimizer / FP16_UnfusedOptimizer): each
    group's params (the entries bound to it) in the optimizer's order (where their stored copies sit: the
    flat master's offset, the master's index, the optimizer state's index; ``by_module_order``: in
    ``module_order``, for groups gathered from several ranks' optimizers) and the step of its first param
    that has a state."""
    if not isinstance(inner, Mapping) or not isinstance(inner.get("param_groups"), list):
        return ()
    groups, state = inner["param_groups"], inner.get("state") or {}
    position = {n: i for i, n in enumerate(module_order)}

    def where(e: TensorEntry) -> tuple[Any, ...]:
        p = e.piece(Role.MASTER) or next(iter(e.state_pieces), None)
        f = p.fragments[0] if p is not None and p.fragments else None
        if by_module_order or f is None:
            return (1, position.get(e.name, 0))
        return (0, f.key, f.src_offset, position.get(e.name, 0))

    names, states = [], []
    for g, pg in enumerate(groups):
        own = [e for e in entries.values() if e.group == g and e.tied_to is None and e.kind is Kind.PARAM]
        names.append([e.name for e in sorted(own, key=where)])
        params = pg.get("params") if isinstance(pg, Mapping) else None
        states.append(next((state[i] for i in (params or []) if isinstance(state, Mapping) and i in state), None))
    return optimizer_groups(groups, names, states)


@dataclass(frozen=True)
class _Proof:
    param_of: dict[int, int]  # slot -> candidate index, for proven slots
    ambiguity: Ambiguity | None


def _bind(slots: list[Slot], shapes: list[tuple[int, ...]], value_candidates: list[set[int]] | None,
          owners: list[tuple[str, ...]], *, what: str, exact: list[bool]) -> _Proof:
    """Prove each slot's param from the evidence at hand; see :mod:`dsckpt.binding`.

    With value evidence, a slot's candidates are the equally shaped params whose 16-bit copy equals its
    rounded master (module order is not assumed). A slot that no copy matches falls back to shape and
    module order, as do all slots without value evidence.
    """
    by_order = order_candidates(slots, shapes)
    values = value_candidates if value_candidates is not None else [set() for _ in slots]
    cands = [v if v else o for v, o in zip(values, by_order)]
    evidence = "shape and 16-bit values" if value_candidates is not None else "shape and module order"
    binding = resolve(cands, len(shapes))
    if not binding.consistent:
        # No binding keeps every group in module order: the groups were built in another order.
        # Shape alone still constrains the choice; whatever it leaves open is ambiguous.
        cands = [v if v else {j for j, shp in enumerate(shapes) if s.shape is None or tuple(s.shape) == shp}
                 for s, v in zip(slots, values)]
        evidence = "shape (the param groups do not follow module order)"
        binding = resolve(cands, len(shapes))
        if not binding.consistent:
            raise CorruptCheckpointError(
                f"the optimizer holds {len(slots)} tensors that no assignment to the module's {len(shapes)} "
                f"params fits by shape (e.g. {slots[0].label}, shape {list(slots[0].shape or ())}); the "
                "model states and the optimizer state do not belong together"
            )
    agree = all(exact[s] for s in binding.undetermined)
    amb = ambiguity_from(binding, cands, slots, owners, what=what, evidence=evidence, values_agree=agree)
    return _Proof(binding.slot_to_param, amb)


def _value_candidates(masters: list[Fingerprint | None], copies: list[Fingerprint | None]) -> list[set[int]] | None:
    """Per master, the params whose 16-bit copy equals it rounded; None when there is no 16-bit copy."""
    if not any(c is not None for c in copies):
        return None
    index: dict[tuple[str, int, bytes], set[int]] = {}
    for j, c in enumerate(copies):
        if c is not None:
            index.setdefault((c.dtype, c.numel, c.digest), set()).add(j)
    return [set(index.get((m.dtype, m.numel, m.digest), ())) if m is not None else set() for m in masters]


def _lowp_dtype(module: Mapping[str, Any], unique: list[str]) -> str | None:
    return next((module[n].dtype_name for n in unique if module[n].dtype_name in ("bfloat16", "float16")), None)


def _fused(path: Path, module: Mapping[str, Any], unique: list[str],
           optimizer: Mapping[str, Any]) -> tuple[dict[str, TensorEntry], list[Ambiguity]]:
    """``fp32_groups_flat[g]`` is one group's unpadded flat master; the module params of that group are
    views into one 16-bit flat buffer of the same length, at the same offsets (names come from there).
    Which buffer belongs to which group is proven by value: the buffer equals the master rounded."""
    flats = optimizer["fp32_groups_flat"]
    inner = optimizer.get("optimizer_state_dict") or {}
    inner_state = inner.get("state") or {}
    by_storage: dict[tuple[Path, str], list[str]] = {}
    for name in unique:
        ref = module[name]
        by_storage.setdefault((ref.storage.path, ref.storage.key), []).append(name)
    skeys = list(by_storage)
    storage_of = {skey: module[names[0]].storage for skey, names in by_storage.items()}
    slots = []
    for g, flat in enumerate(flats):
        if not isinstance(flat, TensorRef):
            raise CorruptCheckpointError(f"{path}: fp32_groups_flat[{g}] is not a tensor")
        slots.append(Slot(g, 0, (flat.numel,), f"optimizer.fp32_groups_flat[{g}]"))
    shapes: list[tuple[int, ...]] = [(storage_of[k].numel,) for k in skeys]
    lowp = _lowp_dtype(module, unique)
    exact = [True] * len(slots)
    value_cands = None
    if lowp is not None:
        masters = [fingerprint_rounded(flat, lowp) for flat in flats]
        exact = [m.exact if m is not None else False for m in masters]
        copies = [fingerprint_16bit(whole_storage(storage_of[k])) if shapes[j][0] in {s.shape[0] for s in slots
                                                                                      if s.shape} else None
                  for j, k in enumerate(skeys)]
        value_cands = _value_candidates(masters, copies)
    proof = _bind(slots, shapes, value_cands, [tuple(by_storage[k]) for k in skeys],
                  what="fp32 master (fp32_groups_flat)", exact=exact)
    group_of = {skeys[j]: g for g, j in proof.param_of.items()}
    amb = proof.ambiguity
    ambiguous = set(amb.names) if amb is not None else set()
    state_index = _state_indices(inner, len(flats))
    entries = {}
    for skey, names in by_storage.items():
        group = group_of.get(skey)
        for name in names:
            ref = module[name]
            pieces = [module_piece(path, name, ref)]
            if group is None:
                entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, False, tuple(pieces),
                                            ambiguous=name in ambiguous)
                continue
            off = ref.storage_offset
            master = Piece(Role.MASTER, "float32",
                           (Fragment(path, ("optimizer", "fp32_groups_flat", group), off, ref.numel, 0),))
            k = state_index[group]
            moments = moment_pieces(path, ("optimizer", "optimizer_state_dict", "state", k),
                                    inner_state.get(k), off, ref.numel, flats[group].numel) if k is not None else []
            entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, True, (master, *moments, *pieces), group=group)
    return entries, [amb] if amb is not None else []


def _state_indices(inner: Mapping[str, Any], n_groups: int) -> list[Any]:
    """The inner optimizer's state key of each group's one flat param (torch numbers params across
    groups in order: group g's is ``param_groups[g]['params'][0]``)."""
    groups = inner.get("param_groups") or []
    out: list[Any] = []
    for g in range(n_groups):
        params = groups[g].get("params") if g < len(groups) and isinstance(groups[g], Mapping) else None
        out.append(params[0] if isinstance(params, list) and len(params) == 1 else None)
    return out


def _unfused(path: Path, module: Mapping[str, Any], unique: list[str],
             optimizer: Mapping[str, Any]) -> tuple[dict[str, TensorEntry], list[Ambiguity]]:
    """``fp32_groups[g][i]``: the master of the i-th trainable param handed to group g. Bound by value:
    it must round to exactly one equally shaped 16-bit module param."""
    inner_state = (optimizer.get("optimizer_state_dict") or {}).get("state") or {}
    masters: list[tuple[int, int, TensorRef]] = []
    for g, group in enumerate(optimizer["fp32_groups"]):
        for i, t in enumerate(group):
            if not isinstance(t, TensorRef):
                raise CorruptCheckpointError(f"{path}: optimizer.fp32_groups[{g}][{i}] is not a tensor")
            masters.append((g, i, t))
    slots = [Slot(g, i, tuple(t.shape), f"optimizer.fp32_groups[{g}][{i}]") for g, i, t in masters]
    shapes = [tuple(module[n].shape) for n in unique]
    lowp = _lowp_dtype(module, unique)
    exact = [True] * len(slots)
    value_cands = None
    if lowp is not None:
        wanted = {s.shape for s in slots}
        prints = [fingerprint_rounded(t, lowp) for _, _, t in masters]
        exact = [p.exact if p is not None else False for p in prints]
        copies = [fingerprint_16bit(module[n]) if shapes[j] in wanted else None for j, n in enumerate(unique)]
        value_cands = _value_candidates(prints, copies)
    proof = _bind(slots, shapes, value_cands, [(n,) for n in unique], what="fp32 master (fp32_groups)",
                  exact=exact)
    amb = proof.ambiguity
    slot_of = {j: k for k, j in proof.param_of.items()}
    entries = {}
    for j, name in enumerate(unique):
        ref = module[name]
        pieces: list[Piece] = [module_piece(path, name, ref)]
        k = slot_of.get(j)
        if k is None:
            entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, False, tuple(pieces),
                                        ambiguous=amb is not None and name in amb.names)
            continue
        g, i, master = masters[k]
        pieces.insert(0, Piece(Role.MASTER, "float32",
                               (Fragment(path, ("optimizer", "fp32_groups", g, i), 0, master.numel, 0),)))
        # The inner optimizer holds the masters themselves: its state index k counts them across groups.
        if k in inner_state:
            pieces[1:1] = moment_pieces(path, ("optimizer", "optimizer_state_dict", "state", k),
                                        inner_state[k], 0, ref.numel)
        entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, True, tuple(pieces), group=g)
    return entries, [amb] if amb is not None else []


def _plain(path: Path, module: Mapping[str, Any], unique: list[str],
           optimizer: Mapping[str, Any] | None) -> tuple[dict[str, TensorEntry], list[Ambiguity]]:
    """fp32: module weights are the master. The torch optimizer's state indices are bound to params by
    shape and module order (there is no value evidence); a param handed to the optimizer that has no
    state after steps were taken never received a gradient: it is frozen."""
    slots: list[Slot] = []
    keys: list[Any] = []
    state = (optimizer or {}).get("state") or {}
    for g, group in enumerate((optimizer or {}).get("param_groups") or []):
        for i, idx in enumerate(group.get("params", [])):
            st = state.get(idx)
            shape = state_shape(st)
            slots.append(Slot(g, i, shape, f"optimizer.state[{idx}]"))
            keys.append(idx)
    shapes = [tuple(module[n].shape) for n in unique]
    entries = {}
    amb = None
    slot_of: dict[int, int] = {}
    if slots:
        proof = _bind(slots, shapes, None, [(n,) for n in unique], what="optimizer state",
                      exact=[True] * len(slots))
        amb = proof.ambiguity
        slot_of = {j: k for k, j in proof.param_of.items()}
    for j, name in enumerate(unique):
        ref = module[name]
        k = slot_of.get(j)
        trainable = optimizer is None
        moments: list[Piece] = []
        group = None
        if k is not None:
            st = state.get(keys[k])
            trainable = st is not None or not state
            group = slots[k].group if trainable else None
            moments = moment_pieces(path, ("optimizer", "state", keys[k]), st, 0, ref.numel)
        ambiguous = k is None and amb is not None and name in amb.names
        entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, trainable and not ambiguous,
                                    (module_piece(path, name, ref), *moments), group=group, ambiguous=ambiguous)
    return entries, [amb] if amb is not None else []
