"""DeepSpeed Mixture-of-Experts checkpoints (native ``deepspeed.moe.layer.MoE``) at ZeRO stage 1/2.

Files (DeepSpeed 0.19.8, engine.py:5040-5290, DEEPSPEED-NOTES 1.2/1.7):

* ``mp_rank_00_model_states.pt``: the dense module copy (experts removed), ``param_shapes`` per
  optimizer group -- the expert groups under rank 0's **local** names (``deepspeed_experts.0 ..``),
  which are the same on every rank -- and ``num_experts`` (per MoE layer);
* ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt``: the 16-bit (or fp32) module copy of global
  expert ``E`` of MoE layer ``L``, keyed by global names;
* ``[bf16_]zero_pp_rank_{d}_mp_rank_00_optim_states.pt``: per data-parallel rank ``d``. Dense groups
  are partitioned over all ``dp`` ranks as in ZeRO-1/2 (:mod:`.zero12`); an expert group
  (``param_groups[g]["moe"]``) over the expert-data-parallel group of ``d`` only
  (``partition_count[g]`` = ``dp / ep_size``), and holds the experts of ``d``'s expert-parallel rank
  under their local names. Which rank holds which experts is :mod:`dsckpt.parallel_layout`.

Bind, then prove: a wrong rank arithmetic would attach one expert's master to another's name. Every
expert master is therefore compared, on a window of every fragment, with its module copy from the
expert file (the copy is the master rounded to 16 bits, or equal in fp32 runs); if most elements do
not agree the checkpoint is refused instead of exporting wrong values (a few damaged elements are
left to ``scan``/``repair``).

Stage 0 (no ZeRO, engine.py ``_save_moe_checkpoint``): ``expp_rank_{R}_mp_rank_00_optim_states.pt``
holds ``{"optimizer": state_dict()}`` of expert-parallel rank R's engine (dense group + R's local
experts, written by its expert-data-parallel rank 0). fp32: the module copies are the masters; the torch
state indices are bound by shape and module order, as for dense stage 0. bf16/fp16 with torch's Adam:
``FP16_UnfusedOptimizer`` (engine.py ``DDP_BFLOAT16``/``FP16``), ``fp32_groups[g][i]`` per param beside the
inner ``optimizer_state_dict``, each master bound by value to its 16-bit copy (the dense module or the expert
file). With FusedAdam, ``FP16_Optimizer``: one flat ``fp32_groups_flat[g]`` per group, cut in module order and
each range proven by value (a MoE save clones every module tensor, so no view offset names a range:
:func:`_fused_moe`). ``BF16_Optimizer`` never runs there: bf16 with ``grad_accum_dtype`` fp32 and no ZeRO stops
``deepspeed.initialize`` ("unsupported mix of model_dtype=torch.bfloat16 and grad_accum_dtype=torch.float32").

``BF16_Optimizer`` (bf16 + ZeRO-1 + fp32 gradient accumulation, ``bf16_zero_pp_rank_*`` files without
``zero_stage``): the ZeRO-1 layout above, each rank's partitions keeping their padding. ZeRO-3 refuses native MoE in
0.19.8 (engine.py:2197-2218), so no such checkpoint exists.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..dtypes import DTYPES, from_float32, to_float32
from ..errors import CorruptCheckpointError, UnsupportedCheckpointError, first_of
from ..layout import CheckpointFiles, expect_dp_ranks
from ..model import Fragment, Kind, LogicalCheckpoint, Piece, Role, TensorEntry
from ..parallel_layout import (
    EXPERT_NAME,
    MoeLayout,
    ParallelLayout,
    ParamCut,
    expert_cut,
    global_expert_name,
    local_expert_name,
)
from ..partition import split_by_partitions
from ..tensor_ref import TensorRef
from .common import (
    FileCache,
    alias_entry,
    buffer_entries,
    dtype_name,
    is_floating,
    metadata_from_model_states,
    module_piece,
    optimizer_type,
    precision_of,
    step_of,
)
from .zero12 import OSD, read_expert_groups, zero12_optimizer_groups

__all__ = ["PROOF_WINDOW_NUMEL", "read_moe", "read_moe_stage0", "read_moe_zero12"]

PROOF_WINDOW_NUMEL = 4096  # elements compared per fragment, at its start and at its end
_GROUP_NAME = re.compile(r"^ep_size_(\d+)$")  # groups.py: group_name = f"ep_size_{expert_parallel_size_}"


def refuse_moe_without_zero(files: CheckpointFiles, why: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(
        f"'{files.tag_dir}' is a Mixture-of-Experts checkpoint saved without ZeRO (per expert-parallel-rank "
        f"'expp_rank_*' optimizer files) {why}; the files do not belong together or were damaged"
    )


def read_moe(files: CheckpointFiles, cache: FileCache) -> LogicalCheckpoint:
    """Any native MoE save: stage 0 (``expp_rank_*`` optimizer files) or ZeRO-1/2."""
    if files.ep_mp_to_expp_optim_states and not files.dp_mp_to_optim_states:
        return read_moe_stage0(files, cache)
    return read_moe_zero12(files, cache)


def read_moe_zero12(files: CheckpointFiles, cache: FileCache) -> LogicalCheckpoint:
    ms_path = files.mp_to_model_states[0]
    ms = cache.tree(ms_path)
    meta = metadata_from_model_states(ms)
    optim = files.dp_mp_to_optim_states
    if files.ep_mp_to_expp_optim_states or not optim:
        raise CorruptCheckpointError(
            f"'{files.tag_dir}' holds both ZeRO optimizer files and 'expp_rank_*' files (or neither); remove the "
            "stray files of another save or pick another tag")
    world = meta.dp_world_size or files.optim_dp_world_size
    expect_dp_ranks(files, "optimizer-state", optim, world)
    if files.optim_dp_world_size != world:
        raise CorruptCheckpointError(
            f"'{files.tag_dir}': {files.optim_dp_world_size} optimizer files but dp_world_size={world} "
            f"in {ms_path.name}; remove the stray files or pick another tag")
    optim_files = [optim[(d, 0)] for d in range(world)]
    eg = read_expert_groups(optim_files, cache, ms, ms_path, files.tag_dir, what="Mixture-of-Experts",
                            bf16_optimizer_ok=True)
    osd0, stage, param_shapes, param_groups, counts, parts = (eg.osd0, eg.stage, eg.param_shapes, eg.param_groups,
                                                              eg.partition_count, eg.parts)
    cfg = meta.ds_config or {}
    data_before = bool(cfg.get("use_data_before_expert_parallelism", False))
    align_pads = osd0.get("param_alignment_paddings")

    # ---- which groups hold experts, and their expert-parallel size
    group_ep: list[int | None] = []
    problems: list[str] = []
    for g, (shapes, pg) in enumerate(zip(param_shapes, param_groups)):
        is_moe = isinstance(pg, Mapping) and pg.get("moe") is True
        expert_names = [n for n in shapes if EXPERT_NAME.match(str(n))]
        if not is_moe:
            if expert_names:
                problems.append(f"group {g} is not marked 'moe' but holds expert params ({expert_names[0]})")
            if int(counts[g]) != world:
                problems.append(f"dense group {g} is partitioned over {counts[g]} ranks, not {world}")
            group_ep.append(None)
            continue
        if len(expert_names) != len(shapes):
            problems.append(f"expert group {g} holds non-expert params")
        c = int(counts[g])
        if c < 1 or world % c:
            problems.append(f"expert group {g} has partition_count {c}, which does not divide {world} ranks")
            group_ep.append(None)
            continue
        ep = world // c
        m = _GROUP_NAME.match(str(pg.get("name", "")))
        if m and int(m[1]) != ep:
            problems.append(f"expert group {g} is named '{pg.get('name')}' but is partitioned over {c} of {world} "
                            f"ranks (ep_size {ep})")
        group_ep.append(ep)
    if problems:
        raise CorruptCheckpointError(f"'{files.tag_dir}': " + "; ".join(problems))

    # ---- the expert files: global name -> module copy
    expert_refs, expert_order, prefix_experts = _expert_files(files, cache)

    # ---- masters and moments
    entries: dict[str, TensorEntry] = {}
    proofs: list[tuple[TensorEntry, int]] = []
    layers: dict[str, tuple[int, int]] = {}
    cuts: dict[str, ParamCut] = {}  # MoE layer prefix -> its experts cut over the expert-parallel ranks
    for g, shapes in enumerate(param_shapes):
        p_numel = parts.partition_numel[g]
        names = [(str(n), tuple(int(s) for s in shp)) for n, shp in shapes.items()]
        pads = [int(x) for x in align_pads[g]] if align_pads is not None else [0] * len(names)
        gep = group_ep[g]
        owners: list[tuple[int | None, list[int]]]
        if gep is None:
            owners = [(None, list(range(world)))]
        else:
            ep = gep
            topo = ParallelLayout(world, ep=ep, data_before_expert=data_before)
            owners = [(e, topo.expert_data_parallel_ranks(e)) for e in range(ep)]
            local_ids: dict[str, set[int]] = {}
            for n, _ in names:
                m = EXPERT_NAME.match(n)
                assert m is not None
                local_ids.setdefault(m["prefix"], set()).add(int(m["id"]))
            for prefix, ids in local_ids.items():
                n_experts = len(prefix_experts.get(prefix, ()))
                if ids != set(range(len(ids))) or n_experts != len(ids) * ep:
                    raise CorruptCheckpointError(
                        f"'{files.tag_dir}': MoE layer '{prefix}' has local experts {sorted(ids)} per rank and "
                        f"ep_size {ep}, so {len(ids) * ep} expert files, but {n_experts} were found; the save "
                        "is incomplete")
                layers[prefix] = (n_experts, ep)
                cuts[prefix] = expert_cut(prefix, n_experts, ep)
        for ep_rank, ranks in owners:
            starts = [k * p_numel for k in range(len(ranks))]
            offset = 0
            for i, (name, shape) in enumerate(names):
                numel = int(np.prod(shape, dtype=np.int64))
                spans = split_by_partitions(offset, numel, starts, [p_numel] * len(ranks))
                for sp in spans:
                    have = parts.stored_numels[g][ranks[sp.rank]]
                    if sp.src_offset + sp.numel > have:
                        raise CorruptCheckpointError(
                            f"{optim_files[ranks[sp.rank]]}: param '{name}' needs elements up to "
                            f"{sp.src_offset + sp.numel} of fp32 group {g}, the rank stores {have}")
                pieces = [Piece(Role.MASTER, "float32", tuple(
                    Fragment(optim_files[ranks[sp.rank]], (OSD, "single_partition_of_fp32_groups", g),
                             sp.src_offset, sp.numel, sp.dst_offset, ranks[sp.rank]) for sp in spans))]
                mk = parts.moment_keys[g]
                if mk is not None:
                    for sk in parts.state_keys[g]:
                        pieces.append(Piece(Role.OPTIM_STATE, parts.state_dtypes[g].get(sk, "float32"), tuple(
                            Fragment(optim_files[ranks[sp.rank]], (*mk, sk), sp.src_offset, sp.numel,
                                     sp.dst_offset, ranks[sp.rank]) for sp in spans), state_key=sk))
                if ep_rank is None:
                    full = name
                    ref = (ms.get("module") or {}).get(name)
                    if isinstance(ref, TensorRef):
                        pieces.append(module_piece(ms_path, name, ref))
                else:
                    prefix = EXPERT_NAME.match(name)["prefix"]  # type: ignore[index]
                    full = global_expert_name(name, ep_rank, cuts[prefix])
                    if full not in expert_refs:
                        raise CorruptCheckpointError(
                            f"'{files.tag_dir}': no expert file holds '{full}' (local '{name}' of expert-parallel "
                            f"rank {ep_rank}); the save is incomplete")
                    path, key, ref = expert_refs[full]
                    if ref.numel != numel:
                        raise CorruptCheckpointError(
                            f"{path}: '{full}' has {ref.numel} elements, the optimizer's '{name}' has {numel}")
                    pieces.append(Piece(Role.MODULE, dtype_name(ref.dtype_name), ((Fragment(path, key, 0, numel, 0)),)))
                if full in entries:
                    raise CorruptCheckpointError(f"'{files.tag_dir}': '{full}' is owned by two optimizer groups")
                entry = TensorEntry(full, shape, Kind.PARAM, True, tuple(pieces), group=g)
                entries[full] = entry
                if ep_rank is not None:
                    proofs.append((entry, ep_rank))
                offset += numel + pads[i]
            if offset > p_numel * len(ranks):
                raise CorruptCheckpointError(
                    f"{ms_path}: group {g} params need {offset} elements, the fp32 partitions hold "
                    f"{p_numel * len(ranks)}; 'param_shapes' does not match the optimizer files")
    _prove_expert_binding(files, cache, proofs, data_before)

    # ---- frozen params (experts: only in their expert file), tied params, buffers
    module = ms.get("module") or {}
    shared = ms.get("shared_params") or {}
    buffers = set(meta.buffer_names)
    for name, ref in module.items():
        if name in entries or name in buffers or name in shared or not isinstance(ref, TensorRef):
            continue
        entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, False, (module_piece(ms_path, name, ref),))
    for name, (path, key, ref) in expert_refs.items():
        if name not in entries:
            entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, False, (
                Piece(Role.MODULE, dtype_name(ref.dtype_name), ((Fragment(path, key, 0, ref.numel, 0)),)),))
    for alias, source in shared.items():
        if source not in entries:
            raise CorruptCheckpointError(f"{ms_path}: tied param '{alias}' points to unknown '{source}'")
        entries[alias] = alias_entry(alias, entries[source])
    for e in buffer_entries(ms_path, module, meta.buffer_names):
        entries[e.name] = e

    sample = next((r.dtype_name for r in module.values() if isinstance(r, TensorRef) and is_floating(r.dtype_name)),
                  None)
    moe = MoeLayout(group_ep_sizes=tuple(group_ep),
                    layers=tuple((p, n, ep) for p, (n, ep) in sorted(layers.items())),
                    data_before_expert=data_before,
                    expert_files=tuple(sorted(files.layer_expert_to_files.values())))
    return LogicalCheckpoint(
        root=files.root, tag=files.tag, tag_dir=files.tag_dir,
        layout="moe-zero1" if stage == 1 else "moe-zero2",
        zero_stage=stage, precision=precision_of(meta.ds_config, sample),
        dp_world_size=world, pp_world_size=1, tp_world_size=1,
        ds_version=meta.ds_version, global_steps=meta.global_steps, global_samples=meta.global_samples,
        optimizer_step=eg.optimizer_step,
        optimizer_wrapper="BF16_Optimizer" if eg.bf16_optimizer else "DeepSpeedZeroOptimizer",
        entries=tuple(_one_rank_order(entries, list(module), expert_order)),
        files=tuple(files.all_files()), ds_config=meta.ds_config, moe=moe,
        # the groups under global expert names: an expert group holds every EP rank's experts, each rank's in flat
        # order, as the entries were read (no ds_config: a round-robin reorder over all ranks is not an expert
        # group's, whose partitions span the expert-data-parallel ranks only)
        optimizer_groups=zero12_optimizer_groups(
            osd0.get("base_optimizer_state"),
            [[e.name for e in entries.values() if e.group == g and e.tied_to is None]
             for g in range(len(param_shapes))],
            None, world, False),
        optimizer_type=optimizer_type(meta.ds_config),
    )


def _expert_files(files: CheckpointFiles, cache: FileCache
                  ) -> tuple[dict[str, tuple[Path, tuple[Any, ...], TensorRef]], dict[str, tuple[int, int, int]],
                             dict[str, set[int]]]:
    """global expert param name -> (file, key, ref); name -> (layer, expert, position); prefix -> expert ids."""
    refs: dict[str, tuple[Path, tuple[Any, ...], TensorRef]] = {}
    order: dict[str, tuple[int, int, int]] = {}
    prefix_experts: dict[str, set[int]] = {}
    for (layer, expert, mp), path in sorted(files.layer_expert_to_files.items()):
        if mp != 0:
            continue
        for i, (key, ref) in enumerate(cache.tree(path).items()):
            m = EXPERT_NAME.match(str(key))
            if not isinstance(ref, TensorRef) or m is None or int(m["id"]) != expert:
                raise CorruptCheckpointError(
                    f"{path}: entry '{key}' is not a tensor of expert {expert}; the file does not belong to this name")
            refs[key] = (path, (key,), ref)
            order[key] = (layer, expert, i)
            prefix_experts.setdefault(m["prefix"], set()).add(expert)
    return refs, order, prefix_experts


def read_moe_stage0(files: CheckpointFiles, cache: FileCache) -> LogicalCheckpoint:
    """MoE without ZeRO: dense params from ``mp_rank_00`` (masters and moments from ``expp_rank_0``), expert
    params from their expert files under global names (masters and moments from their expert-parallel rank's
    file). fp32: the module copies are the masters, the torch optimizer's state indices are bound by shape and
    module order; 16-bit ``FP16_UnfusedOptimizer``: each ``fp32_groups[g][i]`` is bound to the one equally shaped
    param whose 16-bit copy it rounds to, as for dense stage 0 (:func:`.stage0._unfused`); ``FP16_Optimizer``:
    :func:`_fused_moe`."""
    from .stage0 import _optimizer_groups, _plain, _unfused, module_params_and_aliases

    ms_path = files.mp_to_model_states[0]
    ms = cache.tree(ms_path)
    meta = metadata_from_model_states(ms)
    cfg = meta.ds_config or {}
    lowp = any(isinstance(cfg.get(k), Mapping) and cfg[k].get("enabled") for k in ("bf16", "fp16", "bfloat16"))
    expp = files.ep_mp_to_expp_optim_states
    ep = len(expp)
    if sorted(expp) != [(r, 0) for r in range(ep)]:
        raise CorruptCheckpointError(
            f"'{files.tag_dir}': expert-parallel optimizer files for ranks {sorted(r for r, _ in expp)}, expected "
            f"0..{ep - 1}; the save is incomplete")
    module: Mapping[str, Any] = ms.get("module") or {}
    buffers = set(meta.buffer_names)
    dense, aliases = module_params_and_aliases(module, buffers)
    expert_refs, expert_order, prefix_experts = _expert_files(files, cache)
    layers: dict[str, tuple[int, int]] = {}
    for prefix, ids in prefix_experts.items():
        if ids != set(range(len(ids))) or len(ids) % ep:
            raise CorruptCheckpointError(
                f"'{files.tag_dir}': MoE layer '{prefix}' has expert files {sorted(ids)}, not 0..n-1 with n a "
                f"multiple of the {ep} expert-parallel optimizer files; the save is incomplete")
        layers[prefix] = (len(ids), ep)
    cuts = {prefix: expert_cut(prefix, n, ep) for prefix, (n, _) in layers.items()}
    entries: dict[str, TensorEntry] = {}
    ambiguous: list[str] = []
    group_ep: list[int | None] = []
    step = None
    optimizer0: Mapping[str, Any] = {}
    wrapper = "FP16_UnfusedOptimizer" if lowp else "torch optimizer"
    for r in range(ep):
        path = expp[(r, 0)]
        optimizer = cache.tree(path).get("optimizer")
        optimizer = optimizer if isinstance(optimizer, Mapping) else {}
        fused = lowp and isinstance(optimizer.get("fp32_groups_flat"), list)
        if r == 0 and fused:
            wrapper = "FP16_Optimizer"
        inner = optimizer.get("optimizer_state_dict") if lowp else optimizer
        if not isinstance(inner, Mapping) or "state" not in inner or (
                lowp and not isinstance(optimizer.get("fp32_groups_flat" if fused else "fp32_groups"), list)) or (
                lowp and (wrapper == "FP16_Optimizer") != fused):
            want = ("FP16_UnfusedOptimizer (fp32_groups) or FP16_Optimizer (fp32_groups_flat) state beside an "
                    "optimizer_state_dict, the same in every expp_rank file, as its ds_config's 16-bit precision "
                    "needs" if lowp else "plain torch optimizer state, as its fp32 ds_config needs")
            raise refuse_moe_without_zero(files, f"whose {path.name} holds no {want}")
        groups = inner.get("param_groups") or []
        if r == 0:
            optimizer0 = inner
            step = step_of(inner.get("state"))
            for pg in groups:
                m = _GROUP_NAME.match(str(pg.get("name", ""))) if isinstance(pg, Mapping) else None
                group_ep.append((int(m[1]) if m else ep) if isinstance(pg, Mapping) and pg.get("moe") else None)
            if any(e is not None and e != ep for e in group_ep):
                raise UnsupportedCheckpointError(
                    f"'{files.tag_dir}': expert groups of several expert-parallel sizes "
                    f"{sorted(e for e in set(group_ep) if e is not None)} "
                    "without ZeRO are not supported")
        # this rank's module as its engine saw it: dense params, then its local experts under local names
        local: dict[str, str] = {}
        for prefix, cut in cuts.items():
            for name in expert_refs:
                m = EXPERT_NAME.match(name)
                assert m is not None
                if m["prefix"] == prefix:
                    owner, local_name = local_expert_name(name, cut)
                    if owner == r:
                        local[local_name] = name
        local_names = sorted(local, key=lambda nm: expert_order[local[nm]])
        view = {**{nm: module[nm] for nm in dense}, **{nm: expert_refs[g][2] for nm, g in local.items()}}
        if fused:
            bound, amb = _fused_moe(path, view, dense, local_names, optimizer)
        else:
            bound, amb = (_unfused if lowp else _plain)(path, view, [*dense, *local_names], optimizer)
        if amb:
            ambiguous += [local.get(n, n) for a in amb for n in a.names]
        for n, e in bound.items():
            if n in local:
                g = local[n]
                epath, key, ref = expert_refs[g]
                copy = Piece(Role.MODULE, dtype_name(ref.dtype_name), (Fragment(epath, key, 0, ref.numel, 0),))
                moments = tuple(pc for pc in e.pieces if pc.role is not Role.MODULE)
                entries[g] = TensorEntry(g, e.shape, Kind.PARAM, e.trainable, (copy, *moments), group=e.group)
            elif r == 0:
                moments = tuple(pc for pc in e.pieces if pc.role is not Role.MODULE)
                entries[n] = TensorEntry(n, e.shape, Kind.PARAM, e.trainable,
                                         (module_piece(ms_path, n, module[n]), *moments), group=e.group)
    if ambiguous:
        raise UnsupportedCheckpointError(
            f"'{files.tag_dir}': the optimizer state of {', '.join(sorted(set(ambiguous)))} cannot be bound to one "
            "param by shape and order (stage-0 MoE); not read rather than guessed")
    for alias, source in aliases.items():
        entries[alias] = alias_entry(alias, entries[source])
    for e in buffer_entries(ms_path, module, meta.buffer_names):
        entries[e.name] = e
    sample = next((module[n].dtype_name for n in dense if is_floating(module[n].dtype_name)), None)
    moe = MoeLayout(group_ep_sizes=tuple(group_ep),
                    layers=tuple((p, n, e) for p, (n, e) in sorted(layers.items())),
                    data_before_expert=bool(cfg.get("use_data_before_expert_parallelism", False)),
                    expert_files=tuple(sorted(files.layer_expert_to_files.values())),
                    expp_optim_files=tuple(expp[(r, 0)] for r in range(ep)))
    ordered = _one_rank_order(entries, list(module), expert_order)
    return LogicalCheckpoint(
        root=files.root, tag=files.tag, tag_dir=files.tag_dir, layout="moe-stage0", zero_stage=0,
        precision=precision_of(meta.ds_config, sample), dp_world_size=meta.dp_world_size or 1,
        pp_world_size=1, tp_world_size=1, ds_version=meta.ds_version, global_steps=meta.global_steps,
        global_samples=meta.global_samples, optimizer_step=step, optimizer_wrapper=wrapper,
        entries=tuple(ordered), files=tuple(files.all_files()), ds_config=meta.ds_config, moe=moe,
        # every rank's torch optimizer has the same groups (rank 0's hyper-parameters and step): the dense group, and
        # the expert group holding every EP rank's experts under global names, in global expert order
        optimizer_groups=_optimizer_groups(optimizer0, entries, [e.name for e in ordered], by_module_order=True),
        optimizer_type=optimizer_type(meta.ds_config),
    )


def _one_rank_order(entries: dict[str, TensorEntry], module_names: list[str],
                    expert_order: dict[str, tuple[int, int, int]]) -> list[TensorEntry]:
    """The state-dict order of the same model on one rank: each MoE layer's experts (by global id)
    right after the last dense name of that layer (its gate: ``MOELayer`` registers ``gate`` before
    ``experts``); names the module lacks go last."""
    experts = sorted((n for n in entries if n in expert_order), key=lambda n: expert_order[n])
    by_layer: dict[str, list[str]] = {}
    for n in experts:
        by_layer.setdefault(n.split(".experts.deepspeed_experts.")[0] + ".", []).append(n)
    names = [n for n in module_names if n in entries]
    for layer_prefix, block in by_layer.items():
        last = max((i for i, n in enumerate(names) if n.startswith(layer_prefix)), default=len(names) - 1)
        names[last + 1:last + 1] = block
    seen = set(names)
    names += [n for n in entries if n not in seen]
    return [entries[n] for n in names]


def _prove_expert_binding(files: CheckpointFiles, cache: FileCache, proofs: list[tuple[TensorEntry, int]],
                          data_before: bool) -> None:
    """Every expert master must agree with the module copy in the expert file that the rank arithmetic
    bound it to (the copy is the master rounded to 16 bits, or equal in fp32 runs), on a window at both
    ends of every fragment. *Most* elements must agree, not all: a few damaged values (an inf planted by
    an overflow, a flipped bit) are what ``scan`` reports and ``repair`` fixes, so they must not make the
    checkpoint unreadable; a wrong binding pairs two independently trained experts, which agree on next
    to nothing. Experts that never diverged (DeepSpeed deep-copies one expert into every slot) agree
    either way, and then the values are the same whichever is bound. Collects all failures."""
    failed = []
    for entry, ep_rank in proofs:
        master, copy = entry.piece(Role.MASTER), entry.piece(Role.MODULE)
        assert master is not None and copy is not None
        cfrag = copy.fragments[0]
        cref = cache.tensor(cfrag.file, cfrag.key)
        agree = compared = 0
        for f in master.fragments:
            mref = cache.tensor(f.file, f.key)
            k = min(f.numel, PROOF_WINDOW_NUMEL)
            windows = {(f.src_offset, f.dst_offset), (f.src_offset + f.numel - k, f.dst_offset + f.numel - k)}
            for src, dst in sorted(windows):
                n = _agreeing(mref, src, cref, dst, k)
                if n is None:
                    agree, compared = 0, max(compared, 1)
                    break
                agree, compared = agree + n, compared + k
        if 2 * agree <= compared:
            failed.append(f"'{entry.name}' (expert-parallel rank {ep_rank}, {copy.fragments[0].file.name}: "
                          f"{agree} of {compared} elements agree)")
    if failed:
        shown = first_of(failed, 5)
        raise CorruptCheckpointError(
            f"'{files.tag_dir}': the fp32 masters of {shown} do not match the expert files' copies, so the "
            f"expert-parallel rank arithmetic (use_data_before_expert_parallelism={data_before}) does not fit "
            "this save or the files are damaged; nothing is read rather than experts mixed up")


def _agreeing(master: TensorRef, src: int, copy: TensorRef, dst: int, numel: int) -> int | None:
    """How many of ``master[src:src+numel]`` cast to ``copy``'s dtype equal ``copy[dst:dst+numel]``
    (bits; any NaN equals any NaN); None if the dtypes cannot be compared."""
    if master.dtype_name != "float32" or copy.dtype_name not in ("float32", "bfloat16", "float16"):
        return None
    x = from_float32(master.read_numpy(src, numel), copy.dtype_name)
    y = copy.read_numpy(dst, numel)
    if copy.dtype_name == "float32":
        x, y = x.view(np.uint32), y.view(np.uint32)
    else:
        x, y = x.view(np.uint16), y.view(np.uint16)
    nan_x = np.isnan(to_float32(x.view(DTYPES[copy.dtype_name].numpy), copy.dtype_name))
    nan_y = np.isnan(to_float32(y.view(DTYPES[copy.dtype_name].numpy), copy.dtype_name))
    return int(np.count_nonzero((x == y) | (nan_x & nan_y)))



def _fused_moe(path: Path, view: Mapping[str, Any], dense: list[str], local_names: list[str],
               optimizer: Mapping[str, Any]) -> tuple[dict[str, TensorEntry], list[Any]]:
    """``FP16_Optimizer`` (FusedAdam) in one ``expp_rank_*`` file: ``fp32_groups_flat[g]`` is group ``g``'s params
    concatenated, unpadded, in the order they were handed to the optimizer (fused_optimizer.py:89-103), one dense
    group, then the expert group (``split_params_into_different_moe_groups_for_optimizer``). A MoE save clones every
    module tensor (``_save_moe_checkpoint``: ``clone_tensors_for_torch_save``), so unlike a dense stage-0 save no
    view offset into the flat buffer names a range: each group is cut in module order (the order
    ``model.parameters()`` hands the params over), then every range is proven by value -- rounded to 16 bits it must
    equal its own param's copy and no other equally shaped one's (:func:`.stage0._bind`). Several dense groups
    (nothing says which dense params each holds) are refused; not one range agreeing means the order does not hold:
    refused too."""
    flats = optimizer["fp32_groups_flat"]
    inner = optimizer.get("optimizer_state_dict") or {}
    groups = inner.get("param_groups") or []
    is_expert = [isinstance(pg, Mapping) and pg.get("moe") is True for pg in groups]
    if len(groups) != len(flats) or is_expert not in ([False], [False, True]):
        raise UnsupportedCheckpointError(
            f"{path}: {len(flats)} fp32_groups_flat for param groups with 'moe' flags {is_expert}; only one dense "
            "group followed by one expert group (as split_params_into_different_moe_groups_for_optimizer builds "
            "them from one group) can be bound: the flat masters do not say which dense params each group holds")
    entries: dict[str, TensorEntry] = {}
    ambiguities: list[Any] = []
    for g, names in enumerate((dense, local_names)[:len(flats)]):
        bound, amb = _flat_group_in_module_order(path, g, flats[g], names, view, inner)
        entries.update(bound)
        ambiguities += amb
    return entries, ambiguities


def _flat_group_in_module_order(path: Path, g: int, flat: Any, names: list[str], view: Mapping[str, Any],
                                inner: Mapping[str, Any]) -> tuple[dict[str, TensorEntry], list[Any]]:
    """Group ``g``'s flat master ``flat`` cut into ``names`` in order, each range proven by value
    (:func:`_fused_moe`)."""
    from ..binding import Slot
    from .stage0 import _bind, _lowp_dtype, _value_candidates, moment_pieces
    from .values import fingerprint_16bit, fingerprint_rounded

    if not isinstance(flat, TensorRef) or flat.dtype_name != "float32":
        raise CorruptCheckpointError(f"{path}: fp32_groups_flat[{g}] is not an fp32 tensor")
    shapes = [tuple(view[n].shape) for n in names]
    offsets, total = [], 0
    for n in names:
        offsets.append(total)
        total += view[n].numel
    if total != flat.numel:
        raise CorruptCheckpointError(
            f"{path}: fp32_groups_flat[{g}] has {flat.numel} elements, its {len(names)} params {total}; the file does "
            "not belong to these model and expert files")
    lowp = _lowp_dtype(view, names)
    slots = [Slot(g, i, shape, f"optimizer.fp32_groups_flat[{g}][{off}:{off + view[n].numel}]")
             for i, (n, shape, off) in enumerate(zip(names, shapes, offsets))]
    prints = [fingerprint_rounded(flat, lowp, off, view[n].numel) if lowp else None for n, off in zip(names, offsets)]
    value_cands = _value_candidates(prints, [fingerprint_16bit(view[n]) for n in names])
    if value_cands is None or (names and not any(value_cands)):
        raise CorruptCheckpointError(
            f"{path}: no range of fp32_groups_flat[{g}], cut in module order, rounds to its param's 16-bit copy; the "
            "params were handed to the optimizer in another order or the files are damaged, so nothing is bound "
            "rather than guessed")
    proof = _bind(slots, shapes, value_cands, [(n,) for n in names], what=f"fp32 master (fp32_groups_flat[{g}])",
                  exact=[p.exact if p is not None else False for p in prints])
    params = inner["param_groups"][g].get("params")
    k = params[0] if isinstance(params, list) and len(params) == 1 else None
    state = (inner.get("state") or {}).get(k) if k is not None else None
    entries = {}
    for i, j in proof.param_of.items():
        name, off, numel = names[j], offsets[i], view[names[j]].numel
        master = Piece(Role.MASTER, "float32", (Fragment(path, ("optimizer", "fp32_groups_flat", g), off, numel, 0),))
        moments = moment_pieces(path, ("optimizer", "optimizer_state_dict", "state", k), state, off, numel,
                                 flat.numel) if k is not None else []
        entries[name] = TensorEntry(name, shapes[j], Kind.PARAM, True, (master, *moments), group=g)
    return entries, [proof.ambiguity] if proof.ambiguity is not None else []
