"""The parallel layout of a DeepSpeed save, described once: data, tensor, pipeline and expert parallelism. Pure
arithmetic, no I/O, no torch.

:class:`ParallelLayout` is the frozen description of the parallel dimensions of a run: ``dp`` (data-parallel ranks,
over which ZeRO partitions the dense param groups), ``tp`` (tensor-parallel ranks, each holding its local slices,
cut as :class:`ParamCut` s say), ``pp`` (pipeline stages) and ``ep`` (the expert-parallel
size of one expert param group: the experts of a MoE layer spread over ``ep`` ranks, whose expert param groups ZeRO
partitions over the ``expert_dp = dp / ep`` ranks holding the same experts). Its rank arithmetic says which global
rank is which :class:`RankCoordinate` and back, which data-parallel ranks hold an expert-parallel rank's experts (the
readers' direction) and which experts and partition a data-parallel rank holds (the ds_writers' direction).
:class:`ParallelTarget` is what a reshard writes, every dimension's cut in one record: the data-parallel size, the
:class:`TpLayout`, the pipeline :class:`StagePlan` and the expert cut (:class:`AutoEpLayout` or :class:`MoeLayout`).

Global ranks (DeepSpeed 0.19.8): the pipeline topology ``PipeModelDataParallelTopology`` orders ranks by axes
``['pipe', 'data', 'model']`` (``PipeDataParallelTopology``: ``['pipe', 'data']``; runtime/pipe/topology.py) and
AutoTP's mesh is ``(data_parallel, tensor_parallel)`` (utils/groups.py ``_init_tp_mesh_device``), so
``rank = (pp_stage * dp + dp_rank) * tp + tp_rank``. A coordinate's files are named by its data-parallel rank and its
model-parallel rank (engine.py ``_get_ckpt_name``; :mod:`dsckpt.layout` parses the names): the TP rank, or with
pipeline stages and no TP the stage (readers/pipeline.py).

Expert parallelism (``deepspeed.moe.layer.MoE``; utils/groups.py ``_create_expert_and_data_parallel``, legacy path:
no TP) is arithmetic on the data-parallel rank ``d`` (per pipeline stage, groups never cross a stage):

* default (E + D): expert-parallel groups ``[i*E, (i+1)*E)``, expert-data-parallel groups ``range(i, dp, E)``; so
  ``ep_rank = d % E`` and ``expert_dp_rank = d // E``;
* ``"use_data_before_expert_parallelism": true`` (D + E): with ``stride = dp / E``, expert-data-parallel groups
  ``[i*stride, (i+1)*stride)`` and expert-parallel groups ``range(i, dp, stride)``; so ``ep_rank = d // stride`` and
  ``expert_dp_rank = d % stride``.

A rank's rank inside a group (``dist.get_rank(group)``, used by ``_get_expert_parallel_rank`` /
``_get_expert_data_parallel_rank``) is its position in the group's sorted rank list.

Which experts an expert-parallel rank holds is a cut in the tensor-parallel vocabulary: stack a MoE layer's
``num_experts`` experts into one logical ``(num_experts, ...)`` tensor; expert-parallel rank ``r`` holds its dim-0
slice of ``num_experts / ep`` rows, i.e. a :class:`ParamCut` of kind ``COLUMN`` over the
expert index (:func:`expert_cut`). Its :meth:`ParamCut.rank_blocks` give local expert ``l``
of rank ``r`` the global id ``r * num_experts / ep + l`` -- the id ``engine.py::_save_moe_checkpoint`` writes into
``layer_{L}_expert_{E}_mp_rank_00_model_states.pt`` -- and the same blocks read backwards give a global expert's
owner and local id. The MoE reader maps local names to global ones (:func:`global_expert_name`), the MoE ds_writer
both ways (:func:`local_expert_name`).

How TP and MoE would compose (not implemented; the readers refuse MoE with TP): each TP rank's experts are cut
twice -- over the expert index by the expert-parallel rank (:func:`expert_cut`), and inside each expert by the TP
rank (a :class:`~dsckpt.parallel_layout.ParamCut` of the expert's weight) -- so an expert param's full-tensor
fragments come from composing the two cuts. DeepSpeed builds those groups differently (``mp_size > 1``:
TP-strided expert groups, or AutoEP folding tables; ``use_data_before_expert_parallelism`` refused), so
:class:`ParallelLayout` refuses ``ep > 1`` with ``tp > 1`` rather than apply the legacy arithmetic to them.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .optimizer_group import OptimizerGroup

__all__ = [
    "EXPERT_NAME",
    "PARTITION_METHODS",
    "AutoEpLayer",
    "AutoEpLayout",
    "MoeLayout",
    "ParallelLayout",
    "ParallelTarget",
    "ParamCut",
    "PipelineLayer",
    "PipelineLayout",
    "PipelineRecord",
    "RankCoordinate",
    "SplitKind",
    "StagePlan",
    "TpBlock",
    "TpLayout",
    "expert_cut",
    "expert_owner",
    "global_expert_id",
    "global_expert_name",
    "local_expert_name",
    "partition_balanced",
    "partition_uniform",
    "stacked_expert_cut",
    "stage_parts",
]

# --------------------------------------------------------------------------------------------
# Cuts: how one param's full tensor is split over the ranks of one dimension (TP slices, experts)

class SplitKind(enum.Enum):
    """How one param is cut across TP ranks."""

    REPLICATED = "replicated"  # every TP rank holds the full tensor (copies must agree)
    COLUMN = "column"  # split on dim 0 (column-parallel linear: q/k/v/gate/up)
    ROW = "row"  # split on dim 1 (row-parallel linear: o/down)
    VOCABULARY = "vocabulary"  # split on dim 0, rows past the original vocabulary size are padding
    SUB_PARAMS = "sub-params"  # fused sub-params (qkv, [gate; up]), each split on ``dim`` by its own widths


@dataclass(frozen=True)
class TpBlock:
    """Local flat elements ``[local_offset, local_offset + numel)`` of one TP rank's slice land in the flattened
    full tensor at ``full_offset``: contiguously when ``run_numel`` is 0, else in runs of ``run_numel`` elements
    ``full_stride`` apart (``numel`` is then a multiple of ``run_numel``)."""

    local_offset: int
    numel: int
    full_offset: int
    run_numel: int = 0
    full_stride: int = 0

    def full_index(self, k: int) -> int:
        """Full-tensor flat index of the block's ``k``-th element."""
        if not self.run_numel:
            return self.full_offset + k
        return self.full_offset + (k // self.run_numel) * self.full_stride + k % self.run_numel


@dataclass(frozen=True)
class ParamCut:
    """One param's cut: ``dim`` (None when replicated), the full shape, each rank's local shape, and per
    sub-param the width each rank holds along ``dim`` (one sub-param for a plain split). ``keep_rows``:
    vocabulary params keep the first ``keep_rows`` full rows (the rest are padding, :attr:`padding_rows`).
    ``category``: the ``universal_checkpoint_info`` pattern list that decided the cut (e.g.
    ``parameter_with_2_sub_params_cat_dim_0``; None for the default dim-0 split), which ds_to_universal's output
    keys depend on. ``sub_param_entry``: for the ``parameter_with_sub_params`` category, the record's entry that
    matched, as saved (``{"patterns": [...], "shape": [...], "partition_dim": d}``, the fields of DeepSpeed's
    ``SubparamShape``, which ds_to_universal writes back into the merged files); not compared."""

    name: str
    kind: SplitKind
    dim: int | None
    full_shape: tuple[int, ...]
    rank_shapes: tuple[tuple[int, ...], ...]
    sub_widths: tuple[tuple[int, ...], ...] = ()
    keep_rows: int | None = None
    category: str | None = None
    sub_param_entry: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def tp_size(self) -> int:
        return len(self.rank_shapes)

    def describe(self) -> str:
        if self.kind is SplitKind.REPLICATED:
            return "replicated"
        w = "/".join(str(s[self.dim]) for s in self.rank_shapes) if self.dim is not None else ""
        extra = f", {len(self.sub_widths)} sub-params" if self.kind is SplitKind.SUB_PARAMS else ""
        keep = f", {self.keep_rows} rows kept" if self.keep_rows is not None else ""
        return f"{self.kind.value} dim {self.dim} ({w}{extra}{keep})"

    @property
    def padding_rows(self) -> int:
        """Rows of the padded vocabulary past ``keep_rows`` (0 for other params)."""
        if self.keep_rows is None:
            return 0
        return sum(sum(ws) for ws in self.sub_widths) - self.keep_rows

    def padding_blocks(self, t: int) -> tuple[TpBlock, ...]:
        """Where TP rank ``t``'s local elements past ``keep_rows`` (vocabulary padding rows) go in the flattened
        padding rows ``[keep_rows, padded)`` of the full tensor (:attr:`~dsckpt.model.TensorEntry.padding`).
        Together with :meth:`rank_blocks` they cover every local element once."""
        if not self.padding_rows:
            return ()
        assert self.kind is SplitKind.VOCABULARY and self.dim == 0 and len(self.sub_widths) == 1
        inner = math.prod(self.full_shape[1:])
        ws = self.sub_widths[0]
        start = sum(ws[:t])
        first = max(start, self.keep_rows or 0)
        rows = start + ws[t] - first
        if rows <= 0:
            return ()
        return (TpBlock((first - start) * inner, rows * inner, (first - (self.keep_rows or 0)) * inner),)

    def rank_blocks(self, t: int) -> tuple[TpBlock, ...]:
        """Where TP rank ``t``'s local flat elements go in the flattened full tensor (padding rows: nowhere)."""
        local = self.rank_shapes[t]
        if self.kind is SplitKind.REPLICATED or self.dim is None:
            return (TpBlock(0, math.prod(local), 0),)
        d = self.dim
        full = self.full_shape
        outer = math.prod(full[:d])
        inner = math.prod(full[d + 1:])
        full_d = sum(sum(ws) for ws in self.sub_widths)  # before the vocabulary cut
        local_d = local[d]
        keep = self.keep_rows if self.keep_rows is not None else full_d
        out: list[TpBlock] = []
        local_pos = 0
        full_base = 0
        for ws in self.sub_widths:
            w = ws[t]
            full_pos = full_base + sum(ws[:t])
            if d == 0:
                w_kept = max(0, min(w, keep - full_pos))
                if w_kept:
                    out.append(TpBlock(local_pos * inner, w_kept * inner, full_pos * inner))
            elif w:
                if w == local_d:  # the whole local slice: one strided block
                    out.append(TpBlock(local_pos * inner, outer * w * inner, full_pos * inner,
                                       w * inner, full_d * inner))
                else:  # several sub-params cut on dim > 0: one block per outer index
                    for i in range(outer):
                        out.append(TpBlock((i * local_d + local_pos) * inner, w * inner,
                                           (i * full_d + full_pos) * inner))
            local_pos += w
            full_base += sum(ws)
        return tuple(out)


@dataclass(frozen=True)
class TpLayout:
    """The tensor-parallel dimension of a checkpoint: its size, where the record came from, and every param's cut."""

    tp_size: int
    source: str  # "autotp" (affine_map) or "megatron" (category patterns, client state)
    name_to_cut: Mapping[str, ParamCut]

    @property
    def vocab_rows(self) -> frozenset[int]:
        """The row counts of the (padded) vocabulary params: one count where the layout has a vocabulary,
        empty where it has none."""
        return frozenset(sum(c.sub_widths[0]) for c in self.name_to_cut.values() if c.keep_rows is not None)


@dataclass(frozen=True)
class MoeLayout:
    """How a DeepSpeed MoE checkpoint spreads its experts (see :mod:`dsckpt.parallel_layout`).

    ``group_ep_sizes``: per optimizer param group, the expert-parallel size of an expert group, or
    None for a dense group. ``layers``: per MoE layer, ``(expert name prefix ("...deepspeed_experts."),
    number of experts, expert-parallel size)``. Expert entries carry their global names; the files name
    them by local id (optimizer side) and global id (expert files).
    """

    group_ep_sizes: tuple[int | None, ...]
    layers: tuple[tuple[str, int, int], ...]
    data_before_expert: bool
    expert_files: tuple[Path, ...]
    expp_optim_files: tuple[Path, ...] = ()  # stage 0: per expert-parallel rank optimizer files

    @property
    def ep_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({e for e in self.group_ep_sizes if e is not None}))

    @property
    def num_experts(self) -> int:
        return sum(n for _, n, _ in self.layers)

    def expert_cut(self, prefix: str) -> ParamCut:
        """MoE layer ``prefix``'s experts cut over its expert-parallel ranks (:func:`expert_cut`)."""
        for p, n, ep in self.layers:
            if p == prefix:
                return expert_cut(p, n, ep)
        raise KeyError(prefix)


@dataclass(frozen=True)
class AutoEpLayer:
    """One AutoEP MoE layer (``AutoEPMoELayer``, DeepSpeed 0.19.8): its module path, the ``moe_layer_id`` that names
    its expert files (``layer_{id}_expert_{E}_...``), its experts and expert-parallel size, and its stacked expert
    params (``{expert_key_prefix}.w1/w2/w3``, each a ``(num_experts, ...)`` logical tensor)."""

    module_path: str
    layer_id: int
    num_experts: int
    ep_size: int
    expert_key_prefix: str
    param_names: tuple[str, ...]


@dataclass(frozen=True)
class AutoEpLayout:
    """How a DeepSpeed AutoEP checkpoint spreads its experts: expert parallelism as a cut over the expert index.

    Every expert param is one stacked ``(num_experts, ...)`` tensor; expert-parallel rank ``r`` holds a dim-0 slice of
    it (its local experts, ``[E_local, ...]`` under the same name on every rank): ``name_to_cut`` gives each expert
    param's :class:`ParamCut` (kind ``COLUMN``, dim 0, :func:`stacked_expert_cut`), read from the checkpoint's own
    record (``ds_autoep_layers``: placement descriptors and affine maps). ``ep_size`` / ``expert_dp``: the
    expert-parallel size and the number of ranks holding the same experts (ZeRO partitions the expert groups over
    them; dense groups over all ``ep_size * expert_dp`` ranks). ``preset``: DeepSpeed's ``preset_model`` (None when
    the run let AutoEP detect it). ``expert_files``: the ``layer_*_expert_*`` module copies (ZeRO-1/2)."""

    ep_size: int
    expert_dp: int
    preset: str | None
    layers: tuple[AutoEpLayer, ...]
    name_to_cut: Mapping[str, ParamCut]
    expert_files: tuple[Path, ...] = ()

    @property
    def num_experts(self) -> int:
        return sum(layer.num_experts for layer in self.layers)

    @property
    def expert_param_names(self) -> tuple[str, ...]:
        return tuple(n for layer in self.layers for n in layer.param_names)


# engine.py::_save_moe_checkpoint: moe_str_prefix = '.deepspeed_moe.experts.deepspeed_experts.'
EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(?P<id>\d+)(?P<rest>\..+)$")


@dataclass(frozen=True)
class RankCoordinate:
    """One rank's place on every parallel dimension. ``ep``/``expert_dp``: its expert-parallel rank (which experts)
    and expert-data-parallel rank (which ZeRO partition of the expert groups); 0 and ``dp`` without experts."""

    dp: int
    tp: int = 0
    pp: int = 0
    ep: int = 0
    expert_dp: int = 0


@dataclass(frozen=True)
class ParallelLayout:
    """The parallel dimensions of a run: ``dp`` data-parallel ranks, ``tp`` tensor-parallel ranks, ``pp`` pipeline
    stages, ``ep`` expert-parallel size of an expert group (1: experts not split), ``data_before_expert``: ds_config
    ``use_data_before_expert_parallelism``. The world size is ``dp * tp * pp``."""

    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    data_before_expert: bool = False

    def __post_init__(self) -> None:
        if min(self.dp, self.tp, self.pp, self.ep) < 1:
            raise ValueError(f"parallel sizes must be >= 1: dp {self.dp}, tp {self.tp}, pp {self.pp}, ep {self.ep}")
        if self.dp % self.ep:
            raise ValueError(f"ep_size {self.ep} does not divide data-parallel size {self.dp}")
        if self.ep > 1 and self.tp > 1:
            raise ValueError("expert parallelism with tensor parallelism (DeepSpeed's TP-strided expert groups) "
                             "is not modelled")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same experts: the ZeRO ``partition_count`` of an expert param group."""
        return self.dp // self.ep

    # ---- global rank <-> coordinate

    def coordinate(self, rank: int) -> RankCoordinate:
        """Global ``rank``'s coordinate (``rank = (pp * dp + dp_rank) * tp + tp_rank``)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        t = rank % self.tp
        d = rank // self.tp % self.dp
        s = rank // (self.tp * self.dp)
        return RankCoordinate(d, t, s, self.expert_parallel_rank(d), self.expert_data_parallel_rank(d))

    def global_rank(self, c: RankCoordinate) -> int:
        return (c.pp * self.dp + c.dp) * self.tp + c.tp

    # ---- experts: the ds_writers' direction (a data-parallel rank's experts and partition) ...

    def expert_parallel_rank(self, dp_rank: int) -> int:
        """``groups._get_expert_parallel_rank``: which experts data-parallel rank ``dp_rank`` holds."""
        if self.data_before_expert:
            return dp_rank // self.expert_dp
        return dp_rank % self.ep

    def expert_data_parallel_rank(self, dp_rank: int) -> int:
        """``groups._get_expert_data_parallel_rank``: ``dp_rank``'s ZeRO partition index of the expert groups."""
        if self.data_before_expert:
            return dp_rank % self.expert_dp
        return dp_rank // self.ep

    # ---- ... and the readers' direction (who holds an expert-parallel rank's partitions)

    def expert_data_parallel_ranks(self, ep_rank: int) -> list[int]:
        """The data-parallel ranks holding expert-parallel rank ``ep_rank``'s experts, in partition order (index
        ``k`` holds partition ``k`` of each expert param group): the inverse of the two maps above."""
        if not 0 <= ep_rank < self.ep:
            raise ValueError(f"expert-parallel rank {ep_rank} is outside ep_size {self.ep}")
        if self.data_before_expert:
            return [ep_rank * self.expert_dp + k for k in range(self.expert_dp)]
        return [k * self.ep + ep_rank for k in range(self.expert_dp)]


# --------------------------------------------------------------------------------------------
# The expert index as a tensor-parallel cut


def expert_cut(prefix: str, num_experts: int, ep_size: int) -> ParamCut:
    """MoE layer ``prefix``'s experts over ``ep_size`` expert-parallel ranks: a dim-0 (``COLUMN``) cut of the
    stacked expert index, ``num_experts / ep_size`` experts per rank."""
    if ep_size < 1 or num_experts < 1 or num_experts % ep_size:
        raise ValueError(f"{num_experts} experts do not split over ep_size {ep_size}")
    n = num_experts // ep_size
    return ParamCut(prefix, SplitKind.COLUMN, 0, (num_experts,), ((n,),) * ep_size, ((n,) * ep_size,))


def stacked_expert_cut(name: str, full_shape: tuple[int, ...], ep_size: int) -> ParamCut:
    """A stacked expert param ``name`` of full shape ``(num_experts, ...)`` over ``ep_size`` expert-parallel ranks,
    each holding ``num_experts / ep_size`` consecutive experts: the same ``COLUMN`` cut over the expert index as
    :func:`expert_cut`, with each expert's own dims kept whole (AutoEP's grouped expert tensors)."""
    num_experts = full_shape[0] if full_shape else 0
    if ep_size < 1 or num_experts < 1 or num_experts % ep_size:
        raise ValueError(f"'{name}': {num_experts} experts do not split over ep_size {ep_size}")
    n = num_experts // ep_size
    local = (n, *full_shape[1:])
    return ParamCut(name, SplitKind.COLUMN, 0, tuple(full_shape), (local,) * ep_size, ((n,) * ep_size,))


def _block(cut: ParamCut, ep_rank: int) -> TpBlock:
    (b,) = cut.rank_blocks(ep_rank)  # a dim-0 cut of a 1-d index: one contiguous block per rank
    return b


def global_expert_id(cut: ParamCut, ep_rank: int, local_id: int) -> int:
    """Local expert ``local_id`` of expert-parallel rank ``ep_rank`` -> its global id."""
    b = _block(cut, ep_rank)
    if not 0 <= local_id - b.local_offset < b.numel:
        raise ValueError(f"'{cut.name}': expert-parallel rank {ep_rank} holds {b.numel} experts, not {local_id + 1}")
    return b.full_index(local_id - b.local_offset)


def expert_owner(cut: ParamCut, global_id: int) -> tuple[int, int]:
    """Global expert ``global_id`` -> ``(expert-parallel rank, local id)``: :func:`global_expert_id` inverted."""
    for r in range(cut.tp_size):
        b = _block(cut, r)
        if b.full_offset <= global_id < b.full_offset + b.numel:
            return r, b.local_offset + global_id - b.full_offset
    raise ValueError(f"'{cut.name}': no expert-parallel rank holds expert {global_id} of {cut.full_shape[0]}")


def global_expert_name(local_name: str, ep_rank: int, cut: ParamCut) -> str:
    """The name a one-rank model gives local expert param ``local_name`` of expert-parallel rank ``ep_rank``."""
    m = EXPERT_NAME.match(local_name)
    if m is None:
        raise ValueError(f"'{local_name}' is not an expert parameter name")
    return f"{m['prefix']}{global_expert_id(cut, ep_rank, int(m['id']))}{m['rest']}"


def local_expert_name(global_name: str, cut: ParamCut) -> tuple[int, str]:
    """Global expert param ``global_name`` -> ``(expert-parallel rank holding it, its local name there)``."""
    m = EXPERT_NAME.match(global_name)
    if m is None:
        raise ValueError(f"'{global_name}' is not an expert parameter name")
    r, local = expert_owner(cut, int(m["id"]))
    return r, f"{m['prefix']}{local}{m['rest']}"


# --------------------------------------------------------------------------------------------
# Pipeline stages: a cut of the layer list, so of the params (PipelineModule, DeepSpeed 0.19.8)

PARTITION_METHODS = ("parameters", "uniform", "type:REGEX")


def partition_uniform(num_items: int, num_parts: int) -> tuple[int, ...]:
    """``deepspeed.runtime.utils.partition_uniform``: ``num_parts + 1`` boundaries; the first ``num_items %
    num_parts`` parts get one item more."""
    if num_items <= num_parts:
        return tuple(min(p, num_items) for p in range(num_parts + 1))
    chunk, residual = divmod(num_items, num_parts)
    return tuple(p * chunk + min(p, residual) for p in range(num_parts + 1))


def partition_balanced(weights: Sequence[int | float], num_parts: int) -> tuple[int, ...]:
    """``deepspeed.runtime.utils.partition_balanced``: the linear partition that minimises the spread (max - min) of
    the parts' weight sums, by the same dynamic programme -- float64 sums, ties going to the last split point
    ``k`` tried (its ``>=``) -- so that equal costs pick the same boundaries DeepSpeed picks."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = math.inf
    prefix = [0.0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + float(w)  # numpy.cumsum of the weights as float64
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = 0.0
    dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                seg = prefix[i] - prefix[k]
                max_sum = max(dp_max[k][j - 1], seg)
                min_sum = min(dp_min[k][j - 1], seg)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j] = cost
                    dp_max[i][j] = max_sum
                    dp_min[i][j] = min_sum
                    position[i][j] = k
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(position[parts[-1]][j])
    return tuple(reversed(parts))


def stage_parts(method: str, num_stages: int, trainable_numels: Sequence[int],
                layer_types: Sequence[str | None] | None = None) -> tuple[int, ...]:
    """The stage boundaries ``PipelineModule._partition_layers`` computes: stage ``s`` holds layers
    ``[parts[s], parts[s + 1])``. ``trainable_numels``: per layer spec, the trainable elements DeepSpeed's
    ``_count_layer_params`` counts (0 for functions; a ``TiedLayerSpec`` counts its module at every use).
    ``layer_types``: per layer, the class (or function) name ``_find_layer_type`` matches, for ``type:REGEX``
    (searched case-insensitively, as DeepSpeed's ``regex.IGNORECASE`` search does). Raises ``ValueError`` for an
    unknown method or a ``type:`` pattern matching no layer."""
    method = method.lower()
    if num_stages < 1:
        raise ValueError(f"the number of pipeline stages must be >= 1, got {num_stages}")
    if method == "uniform":
        return partition_uniform(len(trainable_numels), num_stages)
    if method == "parameters":
        return partition_balanced(list(trainable_numels), num_stages)
    if method.startswith("type:"):
        if layer_types is None:
            raise ValueError(f"partition method '{method}' needs the layers' type names")
        pattern = re.compile(method.split(":")[1], re.IGNORECASE)
        binary = [1 if t is not None and pattern.search(t) else 0 for t in layer_types]
        if not any(binary):
            raise ValueError(f"partition method '{method}' matches none of the layer types")
        return partition_balanced(binary, num_stages)
    raise ValueError(f"partition method '{method}' is not one of DeepSpeed's: parameters, uniform, type:REGEX")


@dataclass(frozen=True)
class PipelineLayer:
    """One entry of a ``PipelineModule``'s layer list as the checkpoint shows it: ``param_names`` are the params it
    owns in ``PipelineModule.state_dict()`` names (``"{index}.{param}"``, or for a ``TiedLayerSpec`` use the tied
    module's ``"tied_modules.{key}.{param}"``), ``trainable_numel`` what the ``parameters`` method counts for it,
    ``tied_key`` the ``TiedLayerSpec`` key (None otherwise), ``has_file`` whether ``layer_{index:02d}-...`` exists
    (functions and tied uses with a ``forward_fn`` have none)."""

    index: int
    param_names: tuple[str, ...]
    trainable_numel: int
    tied_key: str | None = None
    has_file: bool = True


@dataclass(frozen=True)
class PipelineLayout:
    """The pipeline dimension: the layer list and its stage boundaries ``parts`` (``PipelineModule.parts``: stage
    ``s`` holds layers ``[parts[s], parts[s + 1])``). A stage is a cut of the params: :meth:`stage_param_names` are
    the params a stage's module holds, in the module's own order (its ``tied_modules`` first, in order of first use
    on the stage, then the numbered layers in order) -- the order DeepSpeed's optimizer sees them in when the
    optimizer is built from ``model.parameters()``. A tied module's params belong to every stage that uses it;
    the first such stage is the one whose layer file holds its module copy. ``method``: the partition method the
    boundaries were computed with (None: as found in the checkpoint)."""

    layers: tuple[PipelineLayer, ...]
    parts: tuple[int, ...]
    method: str | None = None

    @property
    def num_stages(self) -> int:
        return len(self.parts) - 1

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def stage_of_layer(self, index: int) -> int:
        for s in range(self.num_stages):
            if self.parts[s] <= index < self.parts[s + 1]:
                return s
        raise ValueError(f"layer {index} lies outside the stage boundaries {list(self.parts)}")

    def stage_layers(self, stage: int) -> tuple[PipelineLayer, ...]:
        return self.layers[self.parts[stage]:self.parts[stage + 1]]

    def stage_param_names(self, stage: int) -> tuple[str, ...]:
        layers = self.stage_layers(stage)
        tied: list[str] = []
        seen: set[str] = set()
        for layer in layers:
            if layer.tied_key is not None and layer.tied_key not in seen:
                seen.add(layer.tied_key)
                tied.extend(layer.param_names)
        own = [n for layer in layers if layer.tied_key is None for n in layer.param_names]
        return (*tied, *own)

    def stages_of(self, name: str) -> tuple[int, ...]:
        """The stages holding param ``name`` (several for a tied module's param)."""
        return tuple(s for s in range(self.num_stages) if name in self.stage_param_names(s))

    def describe(self) -> str:
        return ", ".join(f"stage {s}: layers {self.parts[s]}-{self.parts[s + 1] - 1}" if self.parts[s + 1] >
                         self.parts[s] else f"stage {s}: no layers" for s in range(self.num_stages))


@dataclass(frozen=True)
class PipelineRecord:
    """What a pipeline checkpoint's files say about its stages (read by ``readers/pipeline.py``), before any
    partition method is assumed: the layers that have a ``layer_XX-...`` file, and per stage its
    ``mp_rank_{s:02d}_model_states.pt`` and its optimizer param groups' trainable params in flat order
    (``param_shapes``). ``tied``: per ``TiedLayerSpec`` key, its module's params and trainable elements. Layers
    without a file (functions, tied uses with a ``forward_fn``) and the stage boundaries are not stored: a
    partition method rebuilds them (:func:`dsckpt.pipeline_stages.plan_stages`)."""

    layers: tuple[PipelineLayer, ...]
    stage_group_orders: tuple[tuple[tuple[str, ...], ...], ...]
    stage_model_files: tuple[Path, ...]
    layer_files: tuple[Path, ...]
    tied: tuple[tuple[str, tuple[str, ...], int], ...] = ()
    stage_buffers: tuple[tuple[str, ...], ...] = ()
    #: per stage, its optimizer's param groups (:class:`dsckpt.model.OptimizerGroup`), () without optimizer files;
    #: merged into the checkpoint's ``optimizer_groups`` by :func:`dsckpt.readers.common.merge_stage_groups`
    stage_optimizer_groups: tuple[tuple[OptimizerGroup, ...], ...] = ()
    #: with tensor parallelism (Megatron-DeepSpeed's ``PipeModelDataParallelTopology``): the TP size, and every
    #: model-parallel rank's ``mp_rank_{m:02d}_model_states.pt`` in rank order, ``m = stage * tp_size + t``; the fields
    #: above are then TP rank 0's (its ``layer_XX-model_00-...`` files among ``layer_files``, which lists every TP
    #: rank's) and :meth:`tp_rank` gives another TP rank's
    tp_size: int = 1
    mp_model_files: tuple[Path, ...] = ()
    #: DeepSpeed's own fp32 stage-0 save (no file names its params, dsckpt.readers.pipeline_binding): the tied
    #: modules' TiedLayerSpec keys it was read with (layer index, key), and the layers of tied modules no key was
    #: given for (named with a stand-in key: a rewrite would state a name the files do not)
    tied_keys: tuple[tuple[int, str], ...] = ()
    unkeyed_tied: tuple[int, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stage_group_orders)

    def tp_rank(self, t: int) -> PipelineRecord:
        """TP rank ``t``'s record: its stages' model-states files and its layer files (``-model_{t:02d}-``); the
        stages hold the same params on every TP rank (local slices of them)."""
        if self.tp_size == 1:
            return self
        mark = f"-model_{t:02d}-"
        return dataclasses.replace(
            self, stage_model_files=tuple(self.mp_model_files[s * self.tp_size + t] for s in range(self.num_stages)),
            layer_files=tuple(p for p in self.layer_files if mark in p.name), tp_size=1, mp_model_files=())

    def stage_params(self, stage: int) -> tuple[str, ...]:
        return tuple(n for g in self.stage_group_orders[stage] for n in g)


@dataclass(frozen=True)
class StagePlan:
    """Per target stage: its optimizer groups' trainable params in flat order, the source stage whose files are its
    template (hyperparameters, scheduler, scalars) and the buffers its module holds. ``source`` / ``target``: the
    layouts rebuilt by the partition method (None where the stage count is kept and no method was named: then each
    stage keeps its own params)."""

    group_orders: tuple[tuple[tuple[str, ...], ...], ...]
    templates: tuple[int, ...]
    buffers: tuple[tuple[str, ...], ...]
    source_pp_size: int
    source: PipelineLayout | None = None
    target: PipelineLayout | None = None

    @property
    def pp_size(self) -> int:
        return len(self.group_orders)

    def note(self, layer_files_recut: bool = False) -> str:
        """What the plan does to the stages; ``layer_files_recut``: another TP size re-cuts the layer files
        (:func:`dsckpt.ds_writers.layer_file_trees`, named in a note of their own), so none is copied."""
        files = "re-cut for the new TP size" if layer_files_recut else "copied unchanged"
        if self.target is None:
            return f"pipeline stages kept at {self.pp_size}: each stage keeps its params; layer files {files}"
        return (f"pipeline stages {self.source_pp_size} -> {self.pp_size} (partition_method '{self.target.method}', "
                f"{self.target.num_layers} layers): {self.target.describe()}; layer files {files}")


# --------------------------------------------------------------------------------------------
# A reshard's target: every dimension's cut, in one record


@dataclass(frozen=True)
class ParallelTarget:
    """The parallel layout a reshard writes, every dimension in one record: ``dp`` data-parallel ranks (per
    model-parallel rank), over which ZeRO partitions each rank's params; ``tp`` the tensor-parallel cut of every param
    (None: no tensor parallelism, one TP rank holding whole params); ``stages`` the pipeline cut (which params, groups
    and buffers each stage holds; None: no pipeline); ``experts`` the expert cut written anew -- an
    :class:`AutoEpLayout` (AutoEP: its stacked expert params cut at the target's expert-parallel size, always
    re-planned), or a :class:`MoeLayout` at another expert-parallel size (native MoE, ``--ep-size``); None where the
    checkpoint's experts keep their cut or it has none.

    Model-parallel rank ``m = stage * tp_size + t`` (:meth:`coordinate`) of a target with TP or stages is an ordinary
    data-parallel checkpoint of that stage's params and TP rank ``t``'s slices of them (``ds_writers.retarget``)."""

    dp: int
    tp: TpLayout | None = None
    stages: StagePlan | None = None
    experts: AutoEpLayout | MoeLayout | None = None

    @property
    def tp_size(self) -> int:
        return self.tp.tp_size if self.tp is not None else 1

    @property
    def pp_size(self) -> int:
        return self.stages.pp_size if self.stages is not None else 1

    @property
    def model_parallel(self) -> bool:
        """True when the target is written per model-parallel rank (a TP cut or pipeline stages)."""
        return self.tp is not None or self.stages is not None

    @property
    def mp_size(self) -> int:
        return self.pp_size * self.tp_size

    def coordinate(self, mp_rank: int) -> tuple[int, int]:
        """Model-parallel rank ``mp_rank``'s (pipeline stage, TP rank)."""
        return divmod(mp_rank, self.tp_size)

    @property
    def ep_size(self) -> int | None:
        """The expert-parallel size of ``experts`` (None without)."""
        if isinstance(self.experts, AutoEpLayout):
            return self.experts.ep_size
        if isinstance(self.experts, MoeLayout):
            return self.experts.layers[0][2]
        return None
