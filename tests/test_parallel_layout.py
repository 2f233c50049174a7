"""dsckpt.parallel_layout: the one description of data, tensor, pipeline and expert parallelism.

Exact values, the readers' and ds_writers' directions as inverses of each other, and agreement with DeepSpeed
0.19.8's own arithmetic: ``utils/groups.py::_create_expert_and_data_parallel`` (run in-process with a stand-in for
``deepspeed.comm`` that records the groups instead of creating them), the pipeline topologies of
``runtime/pipe/topology.py``, and the ranks the real MoE fixture runs recorded (truth.json).
"""

from __future__ import annotations

import itertools
import json

import pytest
from conftest import FIXTURES

from dsckpt.parallel_layout import (
    AutoEpLayout,
    MoeLayout,
    ParallelLayout,
    ParallelTarget,
    RankCoordinate,
    SplitKind,
    StagePlan,
    TpBlock,
    TpLayout,
    expert_cut,
    expert_owner,
    global_expert_id,
    global_expert_name,
    local_expert_name,
)
from dsckpt.tensor_parallel import tp_layout_from_record

# (dp, ep) with ep dividing dp
SIZES = [(dp, ep) for dp in range(1, 13) for ep in range(1, dp + 1) if dp % ep == 0]


def test_exact_expert_ranks_e_plus_d_and_d_plus_e() -> None:
    ed = ParallelLayout(8, ep=2)
    assert [ed.expert_parallel_rank(d) for d in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [ed.expert_data_parallel_rank(d) for d in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert ed.expert_data_parallel_ranks(1) == [1, 3, 5, 7]
    assert ed.expert_dp == 4
    de = ParallelLayout(8, ep=2, data_before_expert=True)
    assert [de.expert_parallel_rank(d) for d in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [de.expert_data_parallel_rank(d) for d in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert de.expert_data_parallel_ranks(1) == [4, 5, 6, 7]
    assert ParallelLayout(6, ep=3).expert_data_parallel_ranks(2) == [2, 5]
    assert ParallelLayout(6, ep=3, data_before_expert=True).expert_data_parallel_ranks(2) == [4, 5]


@pytest.mark.parametrize("data_before", [False, True])
@pytest.mark.parametrize(("dp", "ep"), SIZES)
def test_reader_and_writer_directions_are_inverse(dp: int, ep: int, data_before: bool) -> None:
    """Writer direction: data-parallel rank -> (expert-parallel rank, partition index). Reader direction:
    (expert-parallel rank, partition index) -> data-parallel rank. Each undoes the other, and together they are a
    bijection between the dp ranks and the ep x expert_dp grid."""
    lay = ParallelLayout(dp, ep=ep, data_before_expert=data_before)
    grid = {}
    for d in range(dp):
        e, k = lay.expert_parallel_rank(d), lay.expert_data_parallel_rank(d)
        assert 0 <= e < ep and 0 <= k < lay.expert_dp
        assert lay.expert_data_parallel_ranks(e)[k] == d
        grid[(e, k)] = d
    assert sorted(grid) == list(itertools.product(range(ep), range(dp // ep)))
    for e in range(ep):
        ranks = lay.expert_data_parallel_ranks(e)
        assert len(ranks) == lay.expert_dp
        assert [(lay.expert_parallel_rank(d), lay.expert_data_parallel_rank(d)) for d in ranks] == \
            [(e, k) for k in range(lay.expert_dp)]


# --------------------------------------------------------------------------------------------
# DeepSpeed's own group construction


class _RecordingComm:
    """Stands in for ``deepspeed.comm`` inside ``utils/groups.py``: ``new_group`` returns the rank list."""

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank = world, rank

    def is_initialized(self) -> bool:
        return True

    def get_world_size(self, group=None) -> int:
        return self.world if group is None else len(group)

    def get_rank(self, group=None) -> int:
        return self.rank if group is None else sorted(group).index(self.rank)

    def new_group(self, ranks):
        return list(ranks)


def _deepspeed_expert_ranks(monkeypatch: pytest.MonkeyPatch, world: int, ep: int, pp: int, data_before: bool,
                            rank: int) -> tuple[int, int]:
    """``(groups._get_expert_parallel_rank, groups._get_expert_data_parallel_rank)`` of global ``rank`` as
    DeepSpeed 0.19.8 builds the groups (legacy path: no model parallelism)."""
    groups = pytest.importorskip("deepspeed.utils.groups")
    comm = _RecordingComm(world, rank)
    with monkeypatch.context() as m:
        m.setattr(groups, "dist", comm)
        for attr in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                     "_EXPERT_DATA_PARALLEL_GROUP_RANKS"):
            m.setattr(groups, attr, {})
        m.setattr(groups, "mpu", None)
        groups._create_expert_and_data_parallel(ep, mp_size=None, pp_size=pp, use_data_before_expert_parallel_=data_before)
        name = f"ep_size_{ep}"
        return groups._get_expert_parallel_rank(name), groups._get_expert_data_parallel_rank(name)


@pytest.mark.parametrize("data_before", [False, True])
@pytest.mark.parametrize(("dp", "ep", "pp"), [(1, 1, 1), (2, 2, 1), (4, 2, 1), (4, 4, 1), (6, 3, 1), (8, 2, 1),
                                              (8, 4, 1), (12, 6, 1), (16, 2, 1), (4, 2, 2), (6, 2, 2), (4, 4, 3)])
def test_expert_ranks_agree_with_deepspeed_groups(monkeypatch: pytest.MonkeyPatch, dp: int, ep: int, pp: int,
                                                  data_before: bool) -> None:
    lay = ParallelLayout(dp, pp=pp, ep=ep, data_before_expert=data_before)
    for rank in range(lay.world_size):
        c = lay.coordinate(rank)
        assert (c.ep, c.expert_dp) == _deepspeed_expert_ranks(monkeypatch, lay.world_size, ep, pp, data_before, rank)


@pytest.mark.parametrize(("pp", "dp", "tp"), [(1, 4, 1), (2, 2, 1), (3, 2, 2), (2, 3, 4), (1, 2, 4)])
def test_global_rank_coordinates_agree_with_deepspeed_topology(pp: int, dp: int, tp: int) -> None:
    topology = pytest.importorskip("deepspeed.runtime.pipe.topology")
    topo = topology.PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    lay = ParallelLayout(dp, tp=tp, pp=pp)
    for rank in range(lay.world_size):
        want = topo.get_coord(rank)
        c = lay.coordinate(rank)
        assert (c.pp, c.dp, c.tp) == (want.pipe, want.data, want.model)
        assert lay.global_rank(c) == rank
    if tp == 1:
        two = topology.PipeDataParallelTopology(num_pp=pp, num_dp=dp)
        assert [lay.coordinate(r).dp for r in range(lay.world_size)] == \
            [two.get_coord(r).data for r in range(lay.world_size)]


@pytest.mark.parametrize(("dp", "tp"), [(1, 1), (1, 2), (2, 2), (3, 2), (2, 4)])
def test_global_rank_coordinates_agree_with_autotp_groups(monkeypatch: pytest.MonkeyPatch, dp: int, tp: int) -> None:
    """AutoTP's explicit-group fallback (``_init_tp_groups_with_new_group``, which mirrors its 2-D device mesh
    ``(data_parallel, tensor_parallel)``): a rank's data-parallel and TP rank are its positions in its groups."""
    groups = pytest.importorskip("deepspeed.utils.groups")
    lay = ParallelLayout(dp, tp=tp)
    for rank in range(lay.world_size):
        with monkeypatch.context() as m:
            comm = _RecordingComm(lay.world_size, rank)
            m.setattr(groups, "dist", comm)
            for attr in ("_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GROUP"):
                m.setattr(groups, attr, None)
            data_group, tp_group = groups._init_tp_groups_with_new_group(tp, dp)
            c = lay.coordinate(rank)
            assert (c.dp, c.tp, c.pp) == (comm.get_rank(data_group), comm.get_rank(tp_group), 0)


def test_expert_ranks_agree_with_the_fixture_runs() -> None:
    """What ``groups._get_expert_parallel_rank`` / ``_get_expert_data_parallel_rank`` returned on every rank of the
    real MoE fixture runs (generate_moe.py records them)."""
    checked = 0
    for path in sorted(FIXTURES.glob("moe_*/truth.json")):
        meta = json.loads(path.read_text())
        moe = meta["moe"]
        lay = ParallelLayout(meta["dp_world_size"], ep=moe["ep_size"],
                             data_before_expert=bool(meta["config"].get("use_data_before_expert_parallelism")))
        for r in moe["ranks"]:
            c = lay.coordinate(r["rank"])
            assert (c.ep, c.expert_dp) == (r["ep_rank"], r["exp_dp_rank"]), path.parent.name
            checked += 1
    assert checked >= 8


# --------------------------------------------------------------------------------------------
# The expert index as a tensor-parallel cut


@pytest.mark.parametrize(("num_experts", "ep"), [(1, 1), (4, 1), (4, 2), (4, 4), (12, 3), (16, 8)])
def test_expert_cut_maps_local_to_global_as_deepspeed_names_expert_files(num_experts: int, ep: int) -> None:
    cut = expert_cut("m.", num_experts, ep)
    n = num_experts // ep
    assert (cut.kind, cut.dim, cut.full_shape, cut.tp_size) == (SplitKind.COLUMN, 0, (num_experts,), ep)
    seen = set()
    for r in range(ep):
        assert cut.rank_blocks(r) == (TpBlock(0, n, r * n),)
        for local in range(n):
            g = global_expert_id(cut, r, local)
            assert g == r * n + local  # engine.py::_save_moe_checkpoint: expp_rank * num_local_experts + local
            assert expert_owner(cut, g) == (r, local)
            seen.add(g)
    assert seen == set(range(num_experts))
    with pytest.raises(ValueError):
        global_expert_id(cut, 0, n)
    with pytest.raises(ValueError):
        expert_owner(cut, num_experts)


def test_expert_cut_is_the_tp_column_cut_of_the_stacked_experts() -> None:
    """The same ParamCut a TP record gives a dim-0 split of the stacked (num_experts, 3) tensor, per expert row."""
    stacked = tp_layout_from_record({}, {"w": [(2, 3)] * 4}, where="test").name_to_cut["w"]
    cut = expert_cut("w", 8, 4)
    assert (stacked.kind, stacked.dim, stacked.sub_widths) == (cut.kind, cut.dim, cut.sub_widths)
    for r in range(4):
        (b,) = cut.rank_blocks(r)
        assert stacked.rank_blocks(r) == (TpBlock(b.local_offset * 3, b.numel * 3, b.full_offset * 3),)


def test_expert_names_round_trip() -> None:
    cut = expert_cut("moe.deepspeed_moe.experts.deepspeed_experts.", 6, 3)
    local = "moe.deepspeed_moe.experts.deepspeed_experts.1.fc.weight"
    assert global_expert_name(local, 2, cut) == "moe.deepspeed_moe.experts.deepspeed_experts.5.fc.weight"
    assert local_expert_name("moe.deepspeed_moe.experts.deepspeed_experts.5.fc.weight", cut) == (2, local)
    for g in range(6):
        name = f"moe.deepspeed_moe.experts.deepspeed_experts.{g}.fc.bias"
        r, loc = local_expert_name(name, cut)
        assert global_expert_name(loc, r, cut) == name
    with pytest.raises(ValueError):
        global_expert_name("moe.gate.wg.weight", 0, cut)


def test_layout_refuses_what_it_does_not_model() -> None:
    with pytest.raises(ValueError, match="does not divide"):
        ParallelLayout(6, ep=4)
    with pytest.raises(ValueError, match="not modelled"):
        ParallelLayout(4, tp=2, ep=2)
    with pytest.raises(ValueError):
        ParallelLayout(0)
    with pytest.raises(ValueError):
        ParallelLayout(4, ep=2).expert_data_parallel_ranks(2)
    with pytest.raises(ValueError):
        ParallelLayout(2, tp=2).coordinate(4)
    with pytest.raises(ValueError):
        expert_cut("p.", 6, 4)
    assert ParallelLayout(3).coordinate(2) == RankCoordinate(dp=2, tp=0, pp=0, ep=0, expert_dp=2)


@pytest.mark.parametrize(("pp", "tp"), [(1, 1), (1, 4), (3, 1), (2, 2), (3, 4)])
def test_parallel_target_model_parallel_ranks_are_the_topology_file_ranks(pp: int, tp: int) -> None:
    """A reshard target's model-parallel rank ``m`` (its ``mp_rank_{m:02d}`` files) is (stage, TP rank) as every global
    rank of that stage and TP rank names its files: ``m = stage * tp + tp_rank`` (PipeModelDataParallelTopology)."""
    dp = 2
    stages = StagePlan(((("w",),),) * pp, tuple(range(pp)), ((),) * pp, pp) if pp > 1 else None
    target = ParallelTarget(dp, TpLayout(tp, "autotp", {}) if tp > 1 else None, stages)
    assert (target.tp_size, target.pp_size, target.mp_size) == (tp, pp, tp * pp)
    assert target.model_parallel == (tp > 1 or pp > 1)
    topo = ParallelLayout(dp, tp=tp, pp=pp)
    for r in range(topo.world_size):
        c = topo.coordinate(r)
        assert target.coordinate(c.pp * tp + c.tp) == (c.pp, c.tp)


def test_parallel_target_expert_cut_says_its_kind_and_size() -> None:
    assert ParallelTarget(4).ep_size is None and not ParallelTarget(4).model_parallel
    autoep = AutoEpLayout(2, 2, None, (), {})
    moe = MoeLayout((None, 4), (("m.deepspeed_moe.experts.deepspeed_experts.", 8, 4),), False, ())
    assert ParallelTarget(4, experts=autoep).ep_size == 2
    assert ParallelTarget(4, experts=moe).ep_size == 4
