"""DeepSpeed AutoEP checkpoints (expert parallelism for Hugging Face MoE models, DeepSpeed 0.19.8) at ZeRO-1/2/3.

AutoEP (``"expert_parallel": {"enabled": true, "autoep_size": E, ...}``) replaces each HF MoE block with an
``AutoEPMoELayer``: the router becomes ``<mlp>.router.gate.weight`` (also reachable as ``<mlp>.gate.gate.weight``,
an alias module the layer sets for transformers' output recorders: the same tensor, saved twice in ``module``) and
the experts become three stacked tensors ``<mlp>.experts.w1/w2/w3`` (``[E_local, ffn, hidden]``,
``[E_local, hidden, ffn]``, ``[E_local, ffn, hidden]``) holding expert-parallel rank ``r``'s local experts, under the
same name on every rank. What the files hold (tests/fixtures/README.md, "AutoEP fixtures"):

* ``ds_autoep_layers`` in the model-states files: per MoE layer its module path, ``moe_layer_id``, experts,
  ``ep_size``, ``expert_key_prefix``, a placement descriptor (which global experts each EP rank holds, in local
  order) and an affine map per expert param (deepspeed/checkpoint/autoep_affine.py), ``checkpoint_format``
  (``per_expert_files`` at ZeRO-1/2, ``zero3_partitioned`` at ZeRO-3);
* ZeRO-1/2: ``mp_rank_00_model_states.pt`` (dense module copy, experts removed; ``param_shapes`` lists the expert
  group under the local shapes), ``layer_{L}_expert_{X}_mp_rank_00_model_states.pt`` (16-bit or fp32 module copy
  of global expert ``X`` of layer ``L``: ``<prefix>.w1.X`` ...), and the optimizer files: dense groups partitioned
  over all ranks, the expert group (``moe: True``, ``ep_size_E``) over the ranks holding the same experts;
* ZeRO-3: per rank model states (``param_shapes`` per sub-group, expert params under local shapes) and optimizer
  files whose expert sub-groups are partitioned over the expert-data-parallel group
  (``ds_zero_partition_groups``).

Placement comes from the record, never from shapes: each expert param is a :class:`~dsckpt.parallel_layout.ParamCut`
over the expert index (:func:`~dsckpt.parallel_layout.stacked_expert_cut`), checked against the placement
descriptor and the saved affine map; which ranks hold an EP rank's experts is DeepSpeed's group arithmetic
(:class:`~dsckpt.parallel_layout.ParallelLayout`, the same ``_create_expert_and_data_parallel`` as native MoE),
proven at ZeRO-1/2 by value against the expert files. Placements that are not contiguous and uniform, expert tensor
parallelism, AutoEP with AutoTP (``folding``) and unknown record versions are refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError, first_of
from ..layout import OSD, CheckpointFiles, expect_dp_ranks
from ..model import Fragment, Kind, LogicalCheckpoint, Piece, Role, TensorEntry
from ..parallel_layout import (
    AutoEpLayer,
    AutoEpLayout,
    ParallelLayout,
    ParamCut,
    stacked_expert_cut,
)
from ..partition import split_by_partitions, zero3_partition_numel, zero3_spans
from ..tensor_parallel import affine_disagreement, compose
from ..tensor_ref import TensorRef
from .common import (
    ADAM_STATE_KEYS,
    FileCache,
    is_floating,
    metadata_from_model_states,
    optimizer_type,
    precision_of,
    step_of,
)
from .moe import PROOF_WINDOW_NUMEL, _agreeing
from .zero12 import module_side_entries, read_expert_groups, zero12_optimizer_groups

__all__ = ["autoep_layout_from_record", "entry_order", "is_autoep", "placeholder_router_aliases", "read_autoep",
           "router_aliases"]

_FORMATS = {"per_expert_files": (1, 2), "zero3_partitioned": (3,)}


def is_autoep(model_states: Mapping[str, Any]) -> bool:
    return bool(model_states.get("ds_autoep_layers"))


def _refuse(where: Any, what: str) -> UnsupportedCheckpointError:
    return UnsupportedCheckpointError(f"{where}: {what}; dsckpt reads AutoEP checkpoints as DeepSpeed 0.19.8 writes "
                                      "them (contiguous expert placement, no expert tensor parallelism, no AutoTP)")


def autoep_layout_from_record(record: Any, expert_shapes: Mapping[str, tuple[int, ...]], *, where: Any, world: int,
                              stage: int, preset: str | None) -> AutoEpLayout:
    """The :class:`AutoEpLayout` from a ``ds_autoep_layers`` record and the expert params' *local* shapes (from
    ``param_shapes``). Every expert param must be named by exactly one layer's affine map, every layer's placement
    must be contiguous and uniform (``ep_rank r`` holds experts ``[r * n, (r + 1) * n)``: what ``AutoEPMoELayer``
    writes in 0.19.8) and agree with its affine maps; collects every problem, then raises once."""
    if not isinstance(record, list) or not record:
        raise CorruptCheckpointError(f"{where}: 'ds_autoep_layers' is not a non-empty list of layer records")
    problems: list[str] = []
    layers: list[AutoEpLayer] = []
    cuts: dict[str, ParamCut] = {}
    ep_sizes: set[int] = set()
    for i, entry in enumerate(record):
        if not isinstance(entry, Mapping):
            problems.append(f"layer record {i} is not a dict")
            continue
        try:
            path, lid = str(entry["module_path"]), int(entry["moe_layer_id"])
            n, ep, prefix = int(entry["num_experts"]), int(entry["ep_size"]), str(entry["expert_key_prefix"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"layer record {i} lacks module_path / moe_layer_id / num_experts / ep_size / "
                            "expert_key_prefix")
            continue
        fmt = entry.get("checkpoint_format", "per_expert_files")
        if fmt not in _FORMATS:
            problems.append(f"layer '{path}' has checkpoint_format {fmt!r}, which is unknown")
            continue
        if stage not in _FORMATS[fmt]:
            problems.append(f"layer '{path}' has checkpoint_format {fmt!r} in a ZeRO stage {stage} save")
        if ep < 1 or n < 1 or n % ep:
            problems.append(f"layer '{path}': {n} experts over ep_size {ep}")
            continue
        ep_sizes.add(ep)
        placement = entry.get("expert_placement")
        if placement is not None:
            why = _placement_problem(placement, n, ep)
            if why:
                problems.append(f"layer '{path}': {why}")
                continue
        maps = entry.get("affine_maps")
        params = maps.get("params") if isinstance(maps, Mapping) else None
        if not isinstance(maps, Mapping) or not isinstance(params, Mapping) or maps.get("version") != 1:
            problems.append(f"layer '{path}' has no affine maps of version 1 (got "
                            f"{maps.get('version') if isinstance(maps, Mapping) else maps!r})")
            continue
        names = []
        for name, amap in params.items():
            name = str(name)
            if not name.startswith(prefix + "."):
                problems.append(f"layer '{path}': affine map for '{name}' outside its prefix '{prefix}'")
                continue
            local = expert_shapes.get(name)
            if local is None:
                problems.append(f"layer '{path}': '{name}' has an affine map but no optimizer-side param")
                continue
            try:
                cut = stacked_expert_cut(name, (n, *local[1:]), ep)
            except ValueError as e:
                problems.append(str(e))
                continue
            if cut.rank_shapes[0] != tuple(local):
                problems.append(f"'{name}': the record gives {n // ep} experts per rank, param_shapes {list(local)}")
                continue
            why = affine_disagreement(cut, amap)
            if why is not None:
                problems.append(f"'{name}': {why}")
                continue
            cuts[name] = cut
            names.append(name)
        layers.append(AutoEpLayer(path, lid, n, ep, prefix, tuple(names)))
    strays = sorted(set(expert_shapes) - set(cuts))
    if strays:
        problems.append(f"expert params {', '.join(strays[:4])} are in no layer's record")
    if len(ep_sizes) > 1:
        problems.append(f"layers of several expert-parallel sizes {sorted(ep_sizes)}")
    if problems:
        raise _refuse(where, "the AutoEP record (ds_autoep_layers) does not say how to rebuild "
                      + first_of(problems, 6, "; "))
    ep = ep_sizes.pop()
    if world % ep:
        raise CorruptCheckpointError(f"{where}: ep_size {ep} does not divide the {world} ranks of the save")
    return AutoEpLayout(ep, world // ep, preset, tuple(layers), cuts)


def _placement_problem(placement: Any, n: int, ep: int) -> str | None:
    if not isinstance(placement, Mapping) or placement.get("version") != 1:
        return "its expert_placement is not a version-1 descriptor"
    ranks = placement.get("ranks")
    if placement.get("num_experts") != n or placement.get("ep_size") != ep or not isinstance(ranks, list) \
            or len(ranks) != ep:
        return "its expert_placement disagrees with num_experts / ep_size"
    per = n // ep
    by_rank = {r.get("rank"): r.get("experts") for r in ranks if isinstance(r, Mapping)}
    for r in range(ep):
        if by_rank.get(r) != list(range(r * per, (r + 1) * per)):
            return (f"EP rank {r} holds experts {by_rank.get(r)}, not the contiguous [{r * per}, {(r + 1) * per}) "
                    "(non-uniform or permuted placements are not supported)")
    return None


def _preset(cfg: Mapping[str, Any] | None) -> str | None:
    ep = (cfg or {}).get("expert_parallel")
    return str(ep["preset_model"]) if isinstance(ep, Mapping) and ep.get("preset_model") else None


def _refuse_unsupported(cfg: Mapping[str, Any] | None, ms: Mapping[str, Any], where: Any, mp: int) -> None:
    ep = (cfg or {}).get("expert_parallel")
    etp = int(ep.get("expert_tensor_parallel_size", 1) or 1) if isinstance(ep, Mapping) else 1
    if etp > 1:
        raise _refuse(where, f"expert tensor parallelism (expert_tensor_parallel_size {etp}) is not supported")
    if mp > 1 or ms.get("folding"):
        raise _refuse(where, "AutoEP together with AutoTP (tensor parallelism, 'folding' metadata) is not supported")


def router_aliases(module: Mapping[str, Any], trainable: set[str], layers: Sequence[AutoEpLayer]) -> dict[str, str]:
    """Module tensors that are another name of a trainable param: ``AutoEPMoELayer`` registers its router a second
    time under the HF router name (``setattr(self, "gate", self.router)``), so ``state_dict()`` holds
    ``<mlp>.gate.gate.weight`` beside ``<mlp>.router.gate.weight``; DeepSpeed saves the two as separate copies and
    does not list them in ``shared_params``. Bound by name (``<mlp>.<alias>.<rest>`` for ``<mlp>.router.<rest>``
    inside an AutoEP layer) and proven by value: equal shape, dtype and bytes."""
    out: dict[str, str] = {}
    for name, ref in module.items():
        if name in trainable or not isinstance(ref, TensorRef):
            continue
        layer = next((la for la in layers if name.startswith(la.module_path + ".")), None)
        if layer is None:
            continue
        alias, _, rest = name[len(layer.module_path) + 1:].partition(".")
        src = f"{layer.module_path}.router.{rest}"
        sref = module.get(src)
        if alias == "router" or src not in trainable or not isinstance(sref, TensorRef):
            continue
        if (sref.shape, sref.dtype_name) == (ref.shape, ref.dtype_name) and \
                sref.read_numpy(0, sref.numel).tobytes() == ref.read_numpy(0, ref.numel).tobytes():
            out[name] = src
    return out


def placeholder_router_aliases(module: Mapping[str, Any], entries: Mapping[str, TensorEntry],
                               layers: Sequence[AutoEpLayer]) -> dict[str, TensorEntry]:
    """The router alias (see :func:`router_aliases`) of a ZeRO-3 save, where it is a 0-element placeholder like every
    param: bound by name alone, as ``AutoEPMoELayer`` sets it (there are no values to compare)."""
    from .common import alias_entry

    out = {}
    for name in module:
        layer = next((la for la in layers if name.startswith(la.module_path + ".")), None)
        if name in entries or layer is None:
            continue
        alias, _, rest = name[len(layer.module_path) + 1:].partition(".")
        src = f"{layer.module_path}.router.{rest}"
        if alias != "router" and src in entries:
            out[name] = alias_entry(name, entries[src])
    return out


def entry_order(entries: Mapping[str, TensorEntry], module_names: list[str],
                layers: Sequence[AutoEpLayer]) -> list[TensorEntry]:
    """The engine's state-dict order: each layer's expert params right after the last module name of that layer
    (the router and its alias), as ``AutoEPMoELayer`` registers ``router`` before ``experts``."""
    names = [n for n in module_names if n in entries]
    for layer in layers:
        last = max((i for i, n in enumerate(names) if n.startswith(layer.module_path + ".")), default=len(names) - 1)
        names[last + 1:last + 1] = [n for n in layer.param_names if n in entries]
    seen = set(names)
    names += [n for n in entries if n not in seen]
    return [entries[n] for n in names]


def read_autoep(files: CheckpointFiles, cache: FileCache) -> LogicalCheckpoint:
    if files.dp_mp_to_zero3_model_states:
        return _read_zero3(files, cache)
    return _read_zero12(files, cache)


def _full_fragments(frags: Sequence[Fragment], cut: ParamCut | None, ep_rank: int | None) -> tuple[Fragment, ...]:
    if cut is None or ep_rank is None:
        return tuple(frags)
    blocks = cut.rank_blocks(ep_rank)
    return tuple(g for f in frags for g in compose(f, blocks))


def _read_zero12(files: CheckpointFiles, cache: FileCache) -> LogicalCheckpoint:
    ms_path = files.mp_to_model_states[0]
    ms = cache.tree(ms_path)
    meta = metadata_from_model_states(ms)
    cfg = meta.ds_config or {}
    _refuse_unsupported(cfg, ms, ms_path, max(files.mp_world_size, meta.mp_world_size or 1))
    optim = files.dp_mp_to_optim_states
    world = meta.dp_world_size or files.optim_dp_world_size
    expect_dp_ranks(files, "optimizer-state", optim, world)
    optim_files = [optim[(d, 0)] for d in range(world)]
    eg = read_expert_groups(optim_files, cache, ms, ms_path, files.tag_dir, what="AutoEP")
    osd0, stage, param_shapes, param_groups, counts, parts = (eg.osd0, eg.stage, eg.param_shapes, eg.param_groups,
                                                              eg.partition_count, eg.parts)
    expert_groups = [g for g, pg in enumerate(param_groups) if isinstance(pg, Mapping) and pg.get("moe") is True]
    expert_shapes = {str(n): tuple(int(x) for x in s) for g in expert_groups for n, s in param_shapes[g].items()}
    layout = autoep_layout_from_record(ms.get("ds_autoep_layers"), expert_shapes, where=ms_path, world=world,
                                       stage=stage, preset=_preset(cfg))
    topo = ParallelLayout(world, ep=layout.ep_size,
                          data_before_expert=bool(cfg.get("use_data_before_expert_parallelism", False)))
    for g, c in enumerate(counts):
        want = layout.expert_dp if g in expert_groups else world
        if int(c) != want:
            raise CorruptCheckpointError(f"'{files.tag_dir}': param group {g} is partitioned over {c} ranks, the "
                                         f"AutoEP record says {want}; the files disagree")
    align_pads = osd0.get("param_alignment_paddings")
    expert_copies = _expert_files(files, cache, layout)

    entries: dict[str, TensorEntry] = {}
    for g, shapes in enumerate(param_shapes):
        p_numel = parts.partition_numel[g]
        names = [(str(n), tuple(int(s) for s in shp)) for n, shp in shapes.items()]
        pads = [int(x) for x in align_pads[g]] if align_pads is not None else [0] * len(names)
        owners: list[tuple[int | None, list[int]]] = (
            [(e, topo.expert_data_parallel_ranks(e)) for e in range(layout.ep_size)] if g in expert_groups
            else [(None, list(range(world)))])
        frags: dict[str, dict[tuple[Role, str | None], list[Fragment]]] = {}
        for ep_rank, ranks in owners:
            starts = [k * p_numel for k in range(len(ranks))]
            offset = 0
            for i, (name, shape) in enumerate(names):
                numel = math.prod(shape)
                cut = layout.name_to_cut.get(name) if ep_rank is not None else None
                spans = split_by_partitions(offset, numel, starts, [p_numel] * len(ranks))
                for sp in spans:
                    have = parts.stored_numels[g][ranks[sp.rank]]
                    if sp.src_offset + sp.numel > have:
                        raise CorruptCheckpointError(
                            f"{optim_files[ranks[sp.rank]]}: param '{name}' needs elements up to "
                            f"{sp.src_offset + sp.numel} of fp32 group {g}, the rank stores {have}")
                keys: dict[tuple[Role, str | None], tuple[Any, ...]] = {
                    (Role.MASTER, None): (OSD, "single_partition_of_fp32_groups", g)}
                mk = parts.moment_keys[g]
                if mk is not None:
                    keys.update({(Role.OPTIM_STATE, sk): (*mk, sk) for sk in parts.state_keys[g]})
                for copy, kpath in keys.items():
                    local = [Fragment(optim_files[ranks[sp.rank]], kpath, sp.src_offset, sp.numel, sp.dst_offset,
                                      ranks[sp.rank]) for sp in spans]
                    frags.setdefault(name, {}).setdefault(copy, []).extend(_full_fragments(local, cut, ep_rank))
                offset += numel + pads[i]
            if offset > p_numel * len(ranks):
                raise CorruptCheckpointError(
                    f"{ms_path}: group {g} params need {offset} elements, the fp32 partitions hold "
                    f"{p_numel * len(ranks)}; 'param_shapes' does not match the optimizer files")
        for name, shape in names:
            cut = layout.name_to_cut.get(name)
            full_shape = cut.full_shape if cut is not None and g in expert_groups else shape
            pieces = [Piece(role, "float32", tuple(sorted(fs, key=lambda f: f.dst_offset)), state_key=sk)
                      for (role, sk), fs in frags[name].items()]
            if g in expert_groups:
                if name not in expert_copies:
                    raise CorruptCheckpointError(f"'{files.tag_dir}': no expert file holds '{name}'")
                pieces.append(expert_copies[name])
            else:
                ref = (ms.get("module") or {}).get(name)
                if not isinstance(ref, TensorRef):
                    raise CorruptCheckpointError(f"{ms_path}: 'param_shapes' names '{name}' but the saved module "
                                                 "has no tensor of that name; the file is damaged")
                pieces.append(Piece(Role.MODULE, ref.dtype_name, (Fragment(ms_path, ("module", name), 0, ref.numel,
                                                                           0),)))
            entries[name] = TensorEntry(name, full_shape, Kind.PARAM, True, tuple(pieces), group=g)
    _prove_expert_binding(files, cache, [entries[n] for n in layout.expert_param_names], topo)

    module = ms.get("module") or {}
    aliases = router_aliases(module, set(entries), layout.layers)
    ms_view = {**ms, "shared_params": {**(ms.get("shared_params") or {}), **aliases}}
    entries = module_side_entries(ms_path, ms_view, meta.buffer_names, entries)
    sample = next((r.dtype_name for r in module.values() if isinstance(r, TensorRef) and is_floating(r.dtype_name)),
                  None)
    return LogicalCheckpoint(
        root=files.root, tag=files.tag, tag_dir=files.tag_dir, layout=f"autoep-zero{stage}", zero_stage=stage,
        precision=precision_of(meta.ds_config, sample), dp_world_size=world, pp_world_size=1, tp_world_size=1,
        ds_version=meta.ds_version, global_steps=meta.global_steps, global_samples=meta.global_samples,
        optimizer_step=eg.optimizer_step, optimizer_wrapper="DeepSpeedZeroOptimizer",
        entries=tuple(entry_order(entries, list(module), layout.layers)), files=tuple(files.all_files()),
        ds_config=meta.ds_config,
        autoep=AutoEpLayout(layout.ep_size, layout.expert_dp, layout.preset, layout.layers, layout.name_to_cut,
                            tuple(sorted(files.layer_expert_to_files.values()))),
        # flat order (no ds_config: a round-robin reorder over all ranks is not the expert group's, see moe.py)
        optimizer_groups=zero12_optimizer_groups(osd0.get("base_optimizer_state"), param_shapes, None, world, False),
        optimizer_type=optimizer_type(meta.ds_config),
    )


def _expert_files(files: CheckpointFiles, cache: FileCache, layout: AutoEpLayout) -> dict[str, Piece]:
    """Per expert param, its module copy gathered from the ``layer_{L}_expert_{X}`` files (key ``<param>.X``, one
    expert's ``[ffn, hidden]`` slice each), placed at expert ``X`` of the stacked tensor. Every file of every layer
    must be there and hold exactly that layer's params for that expert."""
    by_id = {la.layer_id: la for la in layout.layers}
    got: dict[str, list[Fragment]] = {}
    dtypes: dict[str, str] = {}
    problems: list[str] = []
    seen: set[tuple[int, int]] = set()
    for (lid, x, mp), path in sorted(files.layer_expert_to_files.items()):
        layer = by_id.get(lid)
        if mp != 0 or layer is None or not 0 <= x < layer.num_experts:
            problems.append(f"{path.name} belongs to no expert of the AutoEP record")
            continue
        seen.add((lid, x))
        tree = cache.tree(path)
        want = {f"{n}.{x}": n for n in layer.param_names}
        if not isinstance(tree, Mapping) or set(map(str, tree)) != set(want):
            problems.append(f"{path.name} holds {sorted(map(str, tree))[:3] if isinstance(tree, Mapping) else tree!r}, "
                            f"not {sorted(want)}")
            continue
        for key, name in want.items():
            ref = tree[key]
            cut = layout.name_to_cut[name]
            expert_numel = math.prod(cut.full_shape[1:])
            if not isinstance(ref, TensorRef) or ref.numel != expert_numel:
                problems.append(f"{path.name}: '{key}' is not a tensor of {expert_numel} elements")
                continue
            got.setdefault(name, []).append(Fragment(path, (key,), 0, expert_numel, x * expert_numel))
            dtypes[name] = ref.dtype_name
    missing = [f"layer_{la.layer_id}_expert_{x}" for la in layout.layers for x in range(la.num_experts)
               if (la.layer_id, x) not in seen]
    if missing:
        problems.append(f"expert files {', '.join(missing[:4])} are missing")
    if problems:
        raise CorruptCheckpointError(f"'{files.tag_dir}': " + "; ".join(problems[:5]) + "; the save is incomplete or "
                                     "its files come from different runs")
    return {n: Piece(Role.MODULE, dtypes[n], tuple(fs)) for n, fs in got.items()}


def _prove_expert_binding(files: CheckpointFiles, cache: FileCache, entries: Sequence[TensorEntry],
                          topo: ParallelLayout) -> None:
    """Each expert master (placed by the group arithmetic and the record's cut) must agree with the expert files'
    module copy (the master rounded to 16 bits, or equal in fp32) on a window at both ends of every fragment; most
    elements, not all (a few damaged values are scan's and repair's business). Collects every failure."""
    failed = []
    for entry in entries:
        master, copy = entry.piece(Role.MASTER), entry.piece(Role.MODULE)
        assert master is not None and copy is not None
        agree = compared = 0
        for f in master.fragments:
            k = min(f.numel, PROOF_WINDOW_NUMEL)
            ends = {(f.src_offset, f.dst_offset), (f.src_offset + f.numel - k, f.dst_offset + f.numel - k)}
            for src, dst in sorted(ends):
                c = next((c for c in copy.fragments if c.dst_offset <= dst and dst + k <= c.dst_offset + c.numel), None)
                if c is None:  # the window spans two expert files: compare its first expert's part
                    c = next(c for c in copy.fragments if c.dst_offset <= dst < c.dst_offset + c.numel)
                    k = c.dst_offset + c.numel - dst
                n = _agreeing(cache.tensor(f.file, f.key), src, cache.tensor(c.file, c.key),
                              c.src_offset + dst - c.dst_offset, k)
                if n is None:
                    agree, compared = 0, max(compared, 1)
                    break
                agree, compared = agree + n, compared + k
        if 2 * agree <= compared:
            failed.append(f"'{entry.name}' ({agree} of {compared} elements agree)")
    if failed:
        raise CorruptCheckpointError(
            f"'{files.tag_dir}': the fp32 masters of {', '.join(failed[:5])} do not match the expert files' copies, "
            f"so the expert-parallel rank arithmetic (use_data_before_expert_parallelism={topo.data_before_expert}) "
            "does not fit this save or the files are damaged; nothing is read rather than experts mixed up")


def _read_zero3(files: CheckpointFiles, cache: FileCache) -> LogicalCheckpoint:
    """ZeRO-3: every rank's model-states file carries the AutoEP record with its own ``ep_rank``; the optimizer
    files' ``ds_zero_partition_groups`` say, per sub-group, which ranks partition it (all ranks for the dense
    sub-groups, the ranks holding one EP rank's experts for an ``autoep_expert`` sub-group) and this rank's
    partition index. Each param of a sub-group is split into ``ceil(numel / partition_count)`` pieces as in plain
    ZeRO-3; an expert param's pieces are in the EP rank's local coordinates, placed by its cut."""
    from .zero3 import zero3_module_side_entries, zero3_optimizer_groups

    ms_files = files.dp_mp_to_zero3_model_states
    ms0_path = ms_files[(0, 0)]
    ms0 = cache.tree(ms0_path)
    meta = metadata_from_model_states(ms0)
    cfg = meta.ds_config or {}
    _refuse_unsupported(cfg, ms0, ms0_path, max(files.mp_world_size, meta.mp_world_size or 1))
    world = meta.dp_world_size or (max(d for d, _ in ms_files) + 1)
    expect_dp_ranks(files, "ZeRO-3 model-state", ms_files, world)
    expect_dp_ranks(files, "optimizer-state", files.dp_mp_to_optim_states, world)
    model_paths = [ms_files[(d, 0)] for d in range(world)]
    optim_paths = [files.dp_mp_to_optim_states[(d, 0)] for d in range(world)]
    param_shapes = ms0.get("param_shapes")
    if not isinstance(param_shapes, list):
        raise CorruptCheckpointError(f"{ms0_path}: no 'param_shapes'; not a ZeRO-3 model-states file")
    osds = [cache.tree(p).get(OSD) for p in optim_paths]
    groups_of: list[list[Mapping[str, Any]]] = []
    for p, osd in zip(optim_paths, osds):
        pg = osd.get("ds_zero_partition_groups") if isinstance(osd, Mapping) else None
        if not isinstance(osd, Mapping) or "fp32_flat_groups" not in osd or len(osd["fp32_flat_groups"]) != len(
                param_shapes):
            raise CorruptCheckpointError(f"{p}: no 'fp32_flat_groups' of {len(param_shapes)} sub-groups; not a "
                                         "ZeRO-3 optimizer file of this save")
        if not isinstance(pg, list) or len(pg) != len(param_shapes) or not all(isinstance(g, Mapping) for g in pg):
            raise CorruptCheckpointError(f"{p}: no 'ds_zero_partition_groups' record per sub-group (AutoEP ZeRO-3 "
                                         "writes one); the file is damaged or not an AutoEP save")
        groups_of.append(pg)
    expert_subgroups = [s for s, g in enumerate(groups_of[0]) if "autoep_expert" in (g.get("families") or [])]
    expert_shapes = {str(n): tuple(int(x) for x in shp) for s in expert_subgroups for n, shp in param_shapes[s].items()}
    layout = autoep_layout_from_record(ms0.get("ds_autoep_layers"), expert_shapes, where=ms0_path, world=world,
                                       stage=3, preset=_preset(cfg))
    # each rank's own record: its EP rank (the same for every layer), and the same placement as rank 0's
    ep_rank_of: list[int] = []
    for mp in model_paths:
        rec = cache.tree(mp).get("ds_autoep_layers")
        eps = {int(e.get("ep_rank", -1)) for e in rec} if isinstance(rec, list) and all(
            isinstance(e, Mapping) for e in rec) else set()
        if len(eps) != 1 or not 0 <= next(iter(eps)) < layout.ep_size:
            raise CorruptCheckpointError(f"{mp}: its AutoEP record gives EP ranks {sorted(eps)}, not one of "
                                         f"0..{layout.ep_size - 1}")
        if [e.get("expert_placement") for e in rec] != [e.get("expert_placement") for e in ms0["ds_autoep_layers"]]:
            raise CorruptCheckpointError(f"{mp}: its AutoEP expert placement differs from {ms0_path.name}'s")
        ep_rank_of.append(eps.pop())

    inner = osds[0].get(OSD) or {}
    state_keys = sorted((inner.get("state") or {}).keys())
    entries: dict[str, TensorEntry] = {}
    for s, shapes in enumerate(param_shapes):
        expert = s in expert_subgroups
        # owners: per EP rank (or once, for a dense sub-group) the files in partition order
        owners: dict[int | None, list[int]] = {}
        for r in range(world):
            g = groups_of[r][s]
            ranks = [int(x) for x in g.get("partition_ranks") or []]
            key = ep_rank_of[r] if expert else None
            if r not in ranks or int(g.get("partition_count", -1)) != len(ranks) or \
                    ranks.index(r) != int(g.get("partition_rank", -1)):
                raise CorruptCheckpointError(f"{optim_paths[r]}: sub-group {s}'s partition record {dict(g)} does not "
                                             f"hold rank {r} at its partition_rank")
            if owners.setdefault(key, ranks) != ranks:
                raise CorruptCheckpointError(f"'{files.tag_dir}': sub-group {s} is partitioned over {owners[key]} on "
                                             f"one rank and {ranks} on rank {r}; the files disagree")
        if expert and sorted(k for k in owners if k is not None) != list(range(layout.ep_size)):
            raise CorruptCheckpointError(f"'{files.tag_dir}': expert sub-group {s} is held by EP ranks "
                                         f"{sorted(k for k in owners if k is not None)}, not all {layout.ep_size}")
        if not expert and len(owners[None]) != world:
            raise CorruptCheckpointError(f"'{files.tag_dir}': dense sub-group {s} is partitioned over "
                                         f"{owners[None]}, not all {world} ranks")
        frags: dict[str, dict[tuple[Role, str | None], list[Fragment]]] = {}
        used: dict[int, int] = {}
        for ep_rank, ranks in owners.items():
            pc = len(ranks)
            offset = 0
            for name, shape in shapes.items():
                name = str(name)
                numel = math.prod(int(x) for x in shape)
                cut = layout.name_to_cut.get(name) if ep_rank is not None else None
                spans = zero3_spans(numel, pc, offset)
                keys: dict[tuple[Role, str | None], tuple[Any, ...]] = {
                    (Role.MASTER, None): (OSD, "fp32_flat_groups", s)}
                if s < len(state_keys):
                    keys.update({(Role.OPTIM_STATE, sk): (OSD, OSD, "state", state_keys[s], sk)
                                 for sk in ADAM_STATE_KEYS})
                for copy, kpath in keys.items():
                    local = [Fragment(optim_paths[ranks[sp.rank]], kpath, sp.src_offset, sp.numel, sp.dst_offset,
                                      ranks[sp.rank]) for sp in spans]
                    frags.setdefault(name, {}).setdefault(copy, []).extend(_full_fragments(local, cut, ep_rank))
                offset += zero3_partition_numel(numel, pc)
            for r in ranks:
                used[r] = offset
        for r, need in used.items():
            stored = osds[r]["fp32_flat_groups"][s]
            if not isinstance(stored, TensorRef) or stored.numel < need:
                raise CorruptCheckpointError(
                    f"{optim_paths[r]}: fp32 sub-group {s} holds "
                    f"{stored.numel if isinstance(stored, TensorRef) else 0} elements, 'param_shapes' needs {need}"
                    + ("; it was swapped to NVMe (offloaded_tensors/), which dsckpt does not read yet"
                       if isinstance(stored, TensorRef) and stored.numel == 0 else ""))
        for name, shape in shapes.items():
            name = str(name)
            cut = layout.name_to_cut.get(name)
            full_shape = cut.full_shape if expert and cut is not None else tuple(int(x) for x in shape)
            pieces = tuple(Piece(role, "float32", tuple(sorted(fs, key=lambda f: f.dst_offset)), state_key=sk)
                           for (role, sk), fs in frags[name].items())
            entries[name] = TensorEntry(name, full_shape, Kind.PARAM, True, pieces, group=s)

    entries.update(zero3_module_side_entries(ms0_path, ms0, model_paths, meta.buffer_names, entries, cache))
    module0 = ms0.get("module") or {}
    entries.update(placeholder_router_aliases(module0, entries, layout.layers))
    return LogicalCheckpoint(
        root=files.root, tag=files.tag, tag_dir=files.tag_dir, layout="autoep-zero3", zero_stage=3,
        precision=precision_of(meta.ds_config, None), dp_world_size=world, pp_world_size=1, tp_world_size=1,
        ds_version=meta.ds_version, global_steps=meta.global_steps, global_samples=meta.global_samples,
        optimizer_step=step_of(inner.get("state")), optimizer_wrapper="DeepSpeedZeroOptimizer_Stage3",
        entries=tuple(entry_order(entries, list(module0), layout.layers)), files=tuple(files.all_files()),
        ds_config=meta.ds_config, autoep=layout,
        optimizer_groups=zero3_optimizer_groups(inner, param_shapes), optimizer_type=optimizer_type(meta.ds_config),
    )
