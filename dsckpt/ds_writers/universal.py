"""Universal checkpoint writer: the folder DeepSpeed's ``ds_to_universal`` writes (the mirror of
:mod:`dsckpt.readers.universal`), planned from the logical checkpoint, streamed from byte ranges.

What DeepSpeed 0.19.8 writes and its loader reads (checkpoint/ds_to_universal.py,
checkpoint/universal_checkpoint.py ``load_hp_checkpoint_state``, runtime/base_optimizer.py
``load_hp_checkpoint_state_from_checkpoint_dir``, runtime/zero/stage3.py
``load_hp_checkpoint_state_from_checkpoint_dir_stage3``), by source family:

ZeRO-1/2 and ``BF16_Optimizer`` sources (loaded by ZeRO-1/2 or ``BF16_Optimizer`` engines)
  * ``zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt = {"cat_dim": 0, "param": <fp32, param shape>}``: one file per
    per-element optimizer state, named by its key (``momentum_buffer.pt``, ``sum.pt``, ...: the loader reads
    every ``<key>.pt`` in the folder);
    (the loader reads ``param`` and cuts it with ``cat_dim``, ``chunk(tp_world_size)[tp_rank]``);
  * ``zero/<param>/step.pt``: the param group's ``step``, bare (the loader sets each group's step from it),
    where the optimizer keeps one: a tensor, or the Python int that FusedLamb, DeepSpeedCPULion and FusedAdam keep
    (``ds_to_universal`` saves it as it is, and the loader hands back what it unpickles);
  * ``zero/<name>/fp32.pt = {"param": module[name].float()}`` for every other module tensor
    (buffers, frozen params, tied aliases; never read by the loader); under tensor parallelism the module of
    ``mp_rank_00_model_states.pt`` (the first file ds_to_universal reads), i.e. TP rank 0's local tensor, unmerged;
  * ``zero/optimizer_state.pt``: rank 0's ZeRO optimizer dict without ``base_optimizer_state``,
    ``param_slice_mappings``, ``single_partition_of_fp32_groups``, plus ``param_groups`` (the loader
    reads the loss scaler, ``clip_grad``, ``ds_version`` and the groups' hyperparameters);
  * ``mp_rank_00_model_states.pt`` copied (global steps, LR scheduler, client state come from it).
AutoEP (both families): each stacked expert param whole, ``{"param": <[num_experts, ...]>, "cat_dim": 0,
"is_expert_param": True, "ep_num_experts": n}``; the per-expert files are not copied.
ZeRO-3 sources (loaded by ZeRO-3 engines)
  * ``zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt``: the whole param as a bare flat fp32 tensor;
  * ``zero/optimizer_state.pt``: rank 0's whole ZeRO-3 optimizer dict (its partitions included, as
    DeepSpeed writes it) plus ``param_groups``; the loader takes Adam's step from
    ``["optimizer_state_dict"]["state"][0]["step"]``;
  * every rank's ``zero_pp_rank_{d}_mp_rank_00_model_states.pt`` copied (the loader reads rank 0's).

``latest_universal`` (the tag) goes beside the tag folder. Buffers and frozen params are in the
copied model-states files (and, from ZeRO-1/2, in ``zero/<name>/fp32.pt``) although DeepSpeed's
universal loader restores neither (README, "Universal checkpoints").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..layout import OSD, UNIVERSAL_DIR, UNIVERSAL_OPTIMIZER_STATE
from ..model import Kind, LogicalCheckpoint, Precision, Role
from ..readers.common import lookup
from ..tensor_ref import TensorRef
from .plan import FlatSpec, LayoutPlan, UniversalTarget, coalesce, range_copies, rank_of

__all__ = ["CastFile", "StateFile", "StepFile", "UniversalPlan", "plan_universal", "universal_tp_keys",
           "universal_trees"]

MASTER_FILE = "fp32"  # zero/<param>/fp32.pt; each optimizer state goes to zero/<param>/<state key>.pt
# ds_to_universal.py _save_optimizer_state: what a ZeRO-1/2 optimizer_state.pt leaves out
SHARDED_KEYS = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")


@dataclass(frozen=True)
class StateFile:
    """``zero/<name>/<state>.pt``: one whole fp32 param state assembled from ``spec``'s ranges."""

    name: str
    state: str  # "fp32", or the optimizer state key: "exp_avg", "exp_avg_sq", ...
    spec: FlatSpec
    shape: tuple[int, ...]  # as written: the param's shape (ZeRO-1/2 source) or flat (ZeRO-3 source)
    wrapped: bool  # {"cat_dim": 0, "param": t} (ZeRO-1/2 source) or the bare tensor (ZeRO-3 source)
    # A tensor-parallel source: {**dict(tp_keys), "param": t} at the full shape (vocabulary padding cut), any
    # stage; ``tp_keys`` are the keys ds_to_universal.merge_tp_slices writes before "param" (universal_tp_keys).
    merged_tp: bool = False
    tp_keys: tuple[tuple[str, Any], ...] = ()
    # An AutoEP stacked expert param, any stage: {"param": t, **dict(expert_keys)} at the full [num_experts, ...]
    # shape (ds_to_universal 0.19.8: cat_dim 0, is_expert_param True, ep_num_experts)
    expert_keys: tuple[tuple[str, Any], ...] = ()

    @property
    def path(self) -> str:
        return f"{UNIVERSAL_DIR}/{self.name}/{self.state}.pt"


@dataclass(frozen=True)
class StepFile:
    """``zero/<name>/step.pt``: the ``step`` at ``key`` of ``file`` (the param's group), a tensor or a number."""

    name: str
    file: Path
    key: tuple[Any, ...]

    @property
    def path(self) -> str:
        return f"{UNIVERSAL_DIR}/{self.name}/step.pt"


@dataclass(frozen=True)
class CastFile:
    """``zero/<name>/fp32.pt = {"param": <module tensor at key of file>.float()}`` (ZeRO-1/2 sources; under tensor
    parallelism TP rank 0's local tensor, as ds_to_universal writes it)."""

    name: str
    file: Path
    key: tuple[Any, ...]
    dtype: str  # the stored dtype, cast to float32

    @property
    def path(self) -> str:
        return f"{UNIVERSAL_DIR}/{self.name}/fp32.pt"


@dataclass(frozen=True)
class UniversalPlan:
    """Every file of a universal checkpoint folder (see the module docstring)."""

    source_root: Path
    source_tag_dir: Path
    tag: str  # the source's tag
    out_tag: str  # the universal folder's name, written into latest_universal
    source_stage: int
    optimizer_wrapper: str
    precision: Precision
    source_world_size: int
    state_files: tuple[StateFile, ...]
    step_files: tuple[StepFile, ...]
    cast_files: tuple[CastFile, ...]
    model_files: tuple[Path, ...]  # copied model-states files
    optimizer_source: Path  # source rank 0's optimizer file
    notes: tuple[str, ...] = field(default_factory=tuple)
    autoep: bool = False  # an AutoEP source: record and partition counts as ds_to_universal rewrites them
    # A stage-0 source: the ZeRO-1 files dsckpt writes from it at its own size (never on disk), whose model states
    # and rank 0's optimizer dict the folder holds, as ds_to_universal would from those files; ``zero_source`` is the
    # stage-0 checkpoint as read, which the trees are built from (build_jobs).
    zero_layout: LayoutPlan | None = None
    zero_source: LogicalCheckpoint | None = None

    @property
    def zero3(self) -> bool:
        return self.source_stage == 3

    @property
    def copied_nbytes(self) -> int:
        return 4 * sum(f.spec.numel for f in self.state_files)

    def describe(self) -> list[str]:
        lines = [(f"universal checkpoint from {self.source_tag_dir} (ZeRO stage {self.source_stage}, "
                 f"{self.precision.value}, {self.optimizer_wrapper}, {self.source_world_size} ranks) "
                 f"as '{self.out_tag}'")]
        lines += [f"note: {n}" for n in self.notes]
        for f in self.state_files:
            lines.append(f"  {f.path}: float32{list(f.shape)} from "
                         + ", ".join(f"{c.file.name}[{c.src_offset}:{c.src_offset + c.numel})" for c in f.spec.copies))
        lines += [f"  {f.path}: Adam step from {f.file.name}" for f in self.step_files]
        lines += [f"  {f.path}: {f.dtype} module copy as float32" for f in self.cast_files]
        if self.zero_layout is not None:
            lines.append(f"  {UNIVERSAL_DIR}/{UNIVERSAL_OPTIMIZER_STATE}: from {self.optimizer_source.name}'s "
                         "optimizer, as ZeRO-1 files hold it")
            lines += [f"  {p.name} as ZeRO-1 writes it (param_shapes, no optimizer)" for p in self.model_files]
        else:
            lines.append(f"  {UNIVERSAL_DIR}/{UNIVERSAL_OPTIMIZER_STATE}: from {self.optimizer_source.name}")
            lines += [f"  copy {p.name}" for p in self.model_files]
        return lines


def plan_universal(ckpt: LogicalCheckpoint, target: UniversalTarget, *, optimizer_files: tuple[Path, ...],
                   model_files: tuple[Path, ...], zero_layout: LayoutPlan | None = None) -> UniversalPlan:
    """Plan the universal folder of ``ckpt`` as ``target`` decided it (:func:`.target.resolve_universal`, whose rows
    :func:`.target.refuse_universal` refused what cannot be written): a ZeRO-1/2/3 (or ``BF16_Optimizer``)
    checkpoint whose files use ``target.source_stage``'s layout. Pure: no file is opened. ``optimizer_files`` in rank
    order.

    A stage-0 source (``target.from_zero1``; ds_to_universal reads none) is written as the universal folder of the
    ZeRO-1 files ``zero_layout`` plans from it at its own size (:func:`dsckpt.reshard.plan_universal_reshard`): its
    trainable params' fp32 masters (the module weights at fp32), optimizer states and steps come from the stage-0
    files (:func:`~.stage0.stage0_as_zero_source`), ``zero/optimizer_state.pt`` and the model states from the
    ZeRO-1 trees; ``model_files`` are the stage-0 model-states files they replace. A bf16 pipeline without ZeRO
    (``BF16_Optimizer`` files, model states with ``param_shapes`` None) goes the same way."""
    tp = ckpt.tensor_parallel
    stage0 = target.from_zero1
    assert not stage0 or zero_layout is not None, "a stage-0 source's universal folder is that of its ZeRO-1 files"
    zero_source = None
    if stage0:
        from .stage0 import stage0_as_zero_source

        zero_source = ckpt  # as read: what build_jobs takes with zero_layout, as reshard's own writes do
        ckpt, _ = stage0_as_zero_source(ckpt)  # fp32: the module weights as the master
    zero3 = target.zero3
    states: list[StateFile] = []
    steps: list[StepFile] = []
    casts: list[CastFile] = []
    written: set[str] = set()
    for e in ckpt.entries:
        if e.kind is not Kind.PARAM or not e.trainable or e.tied_to is not None:
            continue
        if not e.state_keys:
            raise CorruptCheckpointError(f"'{ckpt.tag_dir}': param '{e.name}' has no optimizer state values")
        for state in (MASTER_FILE, *e.state_keys):
            piece = e.piece(Role.MASTER) if state == MASTER_FILE else e.state_piece(state)
            if piece is None:
                raise CorruptCheckpointError(f"'{ckpt.tag_dir}': param '{e.name}' has no {state} values")
            spec = FlatSpec(e.numel, "float32", coalesce(range_copies(piece, 0, e.numel, 0, e.name)))
            cut = target.expert_cuts.get(e.name)
            if cut is not None:
                states.append(StateFile(e.name, state, spec, e.shape, True, expert_keys=(
                    ("cat_dim", 0), ("is_expert_param", True), ("ep_num_experts", cut.full_shape[0]))))
            elif tp is not None:
                keys = universal_tp_keys(tp.name_to_cut[e.name], tp.source)
                assert keys is not None
                states.append(StateFile(e.name, state, spec, e.shape, True, merged_tp=True, tp_keys=keys))
            else:
                states.append(StateFile(e.name, state, spec, (e.numel,) if zero3 else e.shape, not zero3))
        written.add(e.name)
        if not zero3:
            group = next((g for g in ckpt.optimizer_groups if g.index == e.group), None)
            if group is None or group.step is not None:  # SGD, Adagrad ... keep no step: nor does the folder
                first = e.state_pieces[0].fragments[0]
                steps.append(StepFile(e.name, first.file, (*first.key[:-1], "step")))
    # ds_to_universal.py:1210-1226: every other module tensor, upcast -- except in a pipeline run, whose model states
    # hold no module ('module' None: the weights are in the layer files, which it neither reads nor copies). It walks
    # the sorted mp_rank_*_model_states.pt files and keeps the first copy of each name: under tensor parallelism TP
    # rank 0's local tensor, unmerged (a TP-split frozen param's rank-0 slice, a replicated buffer whole).
    module_only: list[str] = []
    tp0_file = min((p.name for p in model_files), default=None) if tp is not None else None
    if not zero3 and not target.pipeline:
        for e in ckpt.entries:
            if e.name in written:
                continue
            if tp is not None:
                module_only.append(e.name)
                local = {(f.file, f.key) for p in e.pieces if p.role is Role.MODULE for f in p.fragments
                         if f.file.name == tp0_file}
                dtypes = {p.dtype for p in e.pieces if p.role is Role.MODULE}
                if len(local) != 1 or len(dtypes) != 1:
                    raise UnsupportedCheckpointError(
                        f"cannot write a universal checkpoint of '{ckpt.tag_dir}': '{e.name}' (a buffer or frozen "
                        f"param) has no single module copy in TP rank 0's {tp0_file} to write zero/<name>/fp32.pt "
                        "from, as ds_to_universal does")
                (file, key), = local
                casts.append(CastFile(e.name, file, key, dtypes.pop()))
                continue
            piece = e.piece(Role.MODULE)
            if piece is None or len(piece.fragments) != 1 or piece.fragments[0].src_offset != 0:
                raise CorruptCheckpointError(f"'{ckpt.tag_dir}': '{e.name}' has no whole module copy to write "
                                             "zero/<name>/fp32.pt from")
            f = piece.fragments[0]
            casts.append(CastFile(e.name, f.file, f.key, piece.dtype))
    notes = ["DeepSpeed's universal loader restores trainable params and Adam state only: buffers and frozen "
             "params keep the new model's values (they are in the copied model-states files"
             + (" and zero/<name>/fp32.pt" if not zero3 else "") + ")",
             "load with \"checkpoint\": {\"load_universal\": true} under ZeRO stage "
             + ("3" if zero3 else "1 or 2") + ", on any data-parallel size"]
    if module_only:
        notes.append(f"zero/<name>/fp32.pt of {', '.join(module_only[:5])}"
                     + (f" and {len(module_only) - 5} more" if len(module_only) > 5 else "")
                     + f" (buffers, frozen params) hold TP rank 0's local tensor from {tp0_file}, unmerged, as "
                     "ds_to_universal 0.19.8 writes them; DeepSpeed's universal loader does not read these files, and "
                     "each TP rank's own copy is in the copied model-states files")
    if stage0:
        notes.append("a ZeRO stage 0 save, which ds_to_universal does not read: written as the universal folder of "
                     "the ZeRO-1 files of the same run (reshard --zero-stage 1), from the same masters, optimizer "
                     "states and steps")
    listed = [c.name for c in tp.name_to_cut.values() if isinstance(_sub_param_sizes(c), list)] if tp else []
    if listed:
        # universal_checkpoint.py load_hp_checkpoint_state: sub_dim_sizes = shape[partition_dim], wrapped in a tuple
        # unless it is one; a list of sizes is then narrowed as one size and the load fails
        notes.append(f"the record lists the sub-param sizes of {', '.join(listed[:5])} as a list, which DeepSpeed "
                     "0.19.8's universal loader does not take (it reads them from a tuple): written as ds_to_universal "
                     "writes them, but load_universal will fail on them as on ds_to_universal's folder")
    return UniversalPlan(
        source_root=ckpt.root, source_tag_dir=ckpt.tag_dir, tag=ckpt.tag, out_tag=f"{ckpt.tag}_universal",
        source_stage=target.source_stage, optimizer_wrapper=ckpt.optimizer_wrapper, precision=ckpt.precision,
        source_world_size=ckpt.dp_world_size, state_files=tuple(states), step_files=tuple(steps),
        cast_files=tuple(casts), model_files=tuple(sorted(model_files, key=rank_of)),
        optimizer_source=min(optimizer_files or model_files, key=rank_of), notes=tuple(notes),
        autoep=target.autoep, zero_layout=zero_layout if stage0 else None, zero_source=zero_source)


def universal_tp_keys(cut: Any, source: str) -> tuple[tuple[str, Any], ...] | None:
    """The keys DeepSpeed 0.19.8's ``ds_to_universal.merge_tp_slices`` writes before ``"param"`` in a merged
    tensor-parallel state file of the param cut by ``cut`` (a :class:`~dsckpt.parallel_layout.ParamCut`), in its
    order; None where dsckpt cannot write them (a ``parameter_with_sub_params`` entry that is not what
    ``SubparamShape`` holds, :func:`_subparam_shape`).

    An AutoTP affine map decides the merge and adds no category key; a Megatron-style record adds ``cat_dim``
    (0 for column-parallel and vocabulary params, 1 for row-parallel ones), ``param_n_sub_params: 2`` for
    ``parameter_with_2_sub_params_cat_dim_0``, ``sub_param_shape`` (the record's entry as a pickled
    ``deepspeed.checkpoint.universal_checkpoint.SubparamShape``, no ``cat_dim``) for ``parameter_with_sub_params``,
    nothing for replicated params. Either way a vocabulary param is cut to ``original_vocab_size`` rows and marked
    ``vocab_tensor: True`` (the universal loader re-pads it with zeros for the loading model's TP size,
    checkpoint/universal_checkpoint.py ``load_hp_checkpoint_state``)."""
    from ..parallel_layout import SplitKind

    vocab: tuple[tuple[str, Any], ...] = (("vocab_tensor", True),) if cut.kind is SplitKind.VOCABULARY else ()
    if source == "autotp" or cut.kind is SplitKind.REPLICATED:
        return vocab
    if cut.category == "parameter_with_2_sub_params_cat_dim_0":
        return (("cat_dim", 0), ("param_n_sub_params", 2), *vocab)
    if cut.kind is SplitKind.SUB_PARAMS:
        shape = _subparam_shape(cut)
        return None if shape is None else (("sub_param_shape", shape), *vocab)
    return (("cat_dim", cut.dim), *vocab)


def _subparam_shape(cut: Any) -> Any:
    """The ``SubparamShape`` ds_to_universal 0.19.8 (``merge_tp_slices``) writes for ``cut``'s
    ``parameter_with_sub_params`` entry, or None where it is not one dsckpt can write as ds_to_universal does.

    ``merge_tp_slices`` builds ``SubparamShape(**entry)`` and, at universal checkpoint version 0.4 (which the
    ``sub_param_shard_widths`` the readers require come with), writes that object back unchanged: the record's own
    values, lists and tuples as saved. So the entry must hold exactly the dataclass's fields, and its
    ``shape[partition_dim]`` the sub-param sizes (a list or tuple of ints: a scalar there is the pre-0.4 count of
    equal sub-params, which ds_to_universal rewrites) that the cut's widths add up to on ``partition_dim``."""
    from ..stand_ins import SUBPARAM_SHAPE_FIELDS, subparam_shape

    entry = cut.sub_param_entry
    if not isinstance(entry, Mapping) or set(entry) != set(SUBPARAM_SHAPE_FIELDS):
        return None
    patterns, shape, dim = (entry[k] for k in SUBPARAM_SHAPE_FIELDS)
    sizes = _sub_param_sizes(cut)
    if type(dim) is not int or dim != cut.dim or not isinstance(sizes, (list, tuple)):
        return None
    if [sum(w) for w in cut.sub_widths] != list(sizes) or not all(type(n) is int for n in sizes):
        return None
    return subparam_shape(patterns, shape, dim)


def _sub_param_sizes(cut: Any) -> Any:
    """``shape[partition_dim]`` of ``cut``'s ``parameter_with_sub_params`` entry (the sub-param sizes, as recorded),
    with ``partition_dim`` the cut's dim; None without such an entry."""
    entry = cut.sub_param_entry
    if not isinstance(entry, Mapping) or cut.dim is None:
        return None
    shape = entry.get("shape")
    return shape[cut.dim] if isinstance(shape, (list, tuple)) and 0 <= cut.dim < len(shape) else None


# --------------------------------------------------------------------------------------------
# Trees


def universal_trees(plan: UniversalPlan, cache: Any) -> Iterator[tuple[str, Any]]:
    """``(path relative to the universal folder, tree)`` for every file of ``plan``. Reads source trees
    (pickles) through ``cache``, no tensor bytes."""
    from ..writers.torch_stream import CastTensor
    from .common import own_copy, streamed

    zero_trees: dict[str, Any] = {}
    if plan.zero_layout is not None:  # a stage-0 source: its ZeRO-1 files' trees (their partitions never read)
        from . import build_jobs

        assert plan.zero_source is not None
        zero_trees = {p.name: t for p, t in build_jobs(plan.zero_layout, plan.zero_source, Path(), cache)}
    for f in plan.state_files:
        t = streamed(f.spec, cache, shape=f.shape)
        if f.expert_keys:
            yield f.path, {"param": t, **dict(f.expert_keys)}
        elif f.merged_tp:
            yield f.path, {**dict(f.tp_keys), "param": t}
        else:
            yield f.path, ({"cat_dim": 0, "param": t} if f.wrapped else t)
    for s in plan.step_files:
        step = lookup(cache.tree(s.file), s.key, s.file)
        if isinstance(step, int) and not isinstance(step, bool):
            # FusedLamb, DeepSpeedCPULion and FusedAdam (FP16_Optimizer) keep their step as a Python int:
            # ds_to_universal saves it as it is (_save_checkpoint(step.pt, step)), and DeepSpeed's universal loader
            # puts what it unpickles back into the optimizer's state (base_optimizer.py: state['step'] = steps[0])
            yield s.path, step
            continue
        if not isinstance(step, TensorRef):
            raise UnsupportedCheckpointError(
                f"cannot write a universal checkpoint of '{plan.source_tag_dir}': the step of '{s.name}''s param group "
                f"in '{s.file}' is a {type(step).__name__}, neither a tensor nor an int; reshard it as ZeRO files "
                "instead (reshard -n N)")
        yield s.path, own_copy(step)
    for c in plan.cast_files:
        yield c.path, {"param": CastTensor(cache.tensor(c.file, c.key))}
    opt = optimizer_state_tree(plan, zero_trees[_rank0_optim_file(plan.zero_layout)] if plan.zero_layout is not None
                               else cache.tree(plan.optimizer_source))
    if plan.autoep and not plan.zero3:  # ZeroCheckpoint._update_partition_count: every group at the source's DP size
        opt["partition_count"] = [plan.source_world_size] * len(opt.get("partition_count") or [])
    yield f"{UNIVERSAL_DIR}/{UNIVERSAL_OPTIMIZER_STATE}", opt
    for p in plan.model_files:
        tree = dict(zero_trees[p.name] if plan.zero_layout is not None else cache.tree(p))
        yield p.name, (_autoep_model_states(tree, plan.zero3) if plan.autoep else tree)


def _rank0_optim_file(layout: LayoutPlan) -> str:
    """The name of (model-parallel rank 0's) data-parallel rank 0's optimizer file in a ZeRO-1/2 plan."""
    part = layout.mp_ranks[0] if layout.mp_ranks else layout
    name = part.ranks[0].optim_file
    assert name is not None
    return name


# deepspeed/checkpoint/deepspeed_checkpoint.py AUTOEP_METADATA_FIELDS: what ds_to_universal keeps of a ZeRO-1/2 record
_AUTOEP_ZERO12_FIELDS = ("moe_layer_id", "module_path", "expert_key_prefix", "num_experts", "num_local_experts",
                         "ep_size")


def _autoep_model_states(tree: dict[str, Any], zero3: bool) -> dict[str, Any]:
    """A copied AutoEP model-states file as ds_to_universal 0.19.8 writes it: ``universal_checkpoint_info`` gets the
    expert-parameter pattern and the AutoEP record (at ZeRO-1/2 cut to ``_AUTOEP_ZERO12_FIELDS``)."""
    record = tree.get("ds_autoep_layers")
    if not zero3 and isinstance(record, list):
        record = [{k: e[k] for k in _AUTOEP_ZERO12_FIELDS if k in e} if isinstance(e, Mapping) else e for e in record]
    uci = dict(tree.get("universal_checkpoint_info") or {})
    uci["expert_parameter_patterns"] = [r".*\.experts\.w[123]$" if zero3 else r"\.experts\.w[123]$"]
    uci["ds_autoep_layers"] = record
    return {**tree, "universal_checkpoint_info": uci}


def optimizer_state_tree(plan: UniversalPlan, src0: Mapping[str, Any]) -> dict[str, Any]:
    """``zero/optimizer_state.pt`` from source rank 0's optimizer file (ds_to_universal.py
    ``_save_optimizer_state`` / ``_save_optimizer_state_stage3``)."""
    osd = src0.get(OSD)
    if not isinstance(osd, Mapping):
        raise CorruptCheckpointError(f"{plan.optimizer_source}: no '{OSD}'")
    if plan.zero3:
        inner = osd.get(OSD)
        if not isinstance(inner, Mapping) or "param_groups" not in inner:
            raise CorruptCheckpointError(f"{plan.optimizer_source}: no '{OSD}.{OSD}.param_groups'")
        return {**osd, "param_groups": inner["param_groups"]}
    base = osd.get("base_optimizer_state")
    if not isinstance(base, Mapping) or "param_groups" not in base:
        raise CorruptCheckpointError(f"{plan.optimizer_source}: no '{OSD}.base_optimizer_state.param_groups'")
    out = {k: v for k, v in osd.items() if k not in SHARDED_KEYS}
    out["param_groups"] = base["param_groups"]
    return out
