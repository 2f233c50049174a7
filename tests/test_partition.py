"""Partition arithmetic against DeepSpeed 0.19.8's own formulas, and reshard plans with no files."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsckpt.errors import UnsupportedCheckpointError, UsageError
from dsckpt.model import Fragment, Kind, LogicalCheckpoint, Piece, Precision, Role, TensorEntry
from dsckpt.partition import (
    bf16_optimizer_group_padding,
    param_alignment_paddings,
    round_robin_order,
    zero3_partition_numel,
    zero3_spans,
    zero3_sub_groups,
    zero12_group_layout,
    zero12_param_slice_mappings,
)
from dsckpt.reshard import SourceFacts, describe_plan, plan_reshard

PROPS = settings(derandomize=True, max_examples=300, deadline=None)
numels_st = st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=12)
world_st = st.integers(min_value=1, max_value=17)


# --- DeepSpeed's own code, called or transcribed with line references -------------------------


def ds_flat_partitions(numels: list[int], world: int, paddings: list[int]) -> list[tuple[int, int]]:
    """stage_1_and_2.py:441-508 + runtime/utils.py:994-1005 (align_dense_tensors, called for real)
    + get_data_parallel_partitions (stage_1_and_2.py:2559-2577): (start, numel) per rank."""
    import torch
    from deepspeed.runtime.utils import align_dense_tensors

    tensors = []
    for n, pad in zip(numels, paddings):
        tensors.append(torch.zeros(n))
        if pad:
            tensors.append(torch.zeros(pad))
    total = sum(t.numel() for t in align_dense_tensors(tensors or [torch.zeros(0)], 2 * world))
    base, remaining = divmod(total, world)
    out, start = [], 0
    for r in range(world):
        size = base + (1 if r < remaining else 0)
        out.append((start, size))
        start += size
    return out


def ds_group_padding(unpadded: int, world: int, rank: int, partitions: list[tuple[int, int]]) -> int:
    """stage_1_and_2.py:540-551."""
    left = sum(n for _, n in partitions[:rank])
    size = partitions[rank][1]
    if unpadded <= left:
        return size
    if unpadded < left + size:
        return left + size - unpadded
    return 0


def ds_round_robin(n: int, world: int) -> list[int]:
    """DeepSpeedZeroOptimizer._round_robin_reorder (stage_1_and_2.py:901-922), called unbound."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    tensors, _ = DeepSpeedZeroOptimizer._round_robin_reorder(None, list(range(n)), world)
    return tensors


def ds_alignment_paddings(numels: list[int], element_size: int) -> list[int]:
    """stage_1_and_2.py:441-501."""
    alignment = 16 // math.gcd(16, element_size)
    out, offset = [], 0
    for i, n in enumerate(numels):
        offset += n
        pad = 0 if i == len(numels) - 1 else (-offset) % alignment
        out.append(pad)
        offset += pad
    return out


# --- properties ---------------------------------------------------------------------------------


@PROPS
@given(numels=numels_st, world=world_st, align=st.sampled_from([None, 2, 4]))
def test_zero12_layout_matches_deepspeed(numels, world, align):
    pads = ds_alignment_paddings(numels, align) if align else [0] * len(numels)
    layout = zero12_group_layout(numels, world, alignment_paddings=pads)
    parts = ds_flat_partitions(numels, world, pads)
    assert [layout.partition_numel] * world == [n for _, n in parts]
    assert layout.padded_numel == sum(n for _, n in parts)
    assert layout.padded_numel % (2 * world) == 0
    for r in range(world):
        assert layout.rank_padding(r) == ds_group_padding(layout.unpadded_numel, world, r, parts)


@PROPS
@given(numels=numels_st, element_size=st.sampled_from([1, 2, 4, 8]))
def test_param_alignment_paddings_match_deepspeed(numels, element_size):
    assert param_alignment_paddings(numels, element_size, enabled=True) == ds_alignment_paddings(numels, element_size)
    assert param_alignment_paddings(numels, element_size, enabled=False) == [0] * len(numels)


@PROPS
@given(n=st.integers(min_value=0, max_value=40), world=world_st)
def test_round_robin_order_matches_deepspeed(n, world):
    assert round_robin_order(n, world) == ds_round_robin(n, world)


@PROPS
@given(numels=numels_st, world=world_st)
def test_bf16_optimizer_padding_matches_deepspeed(numels, world):
    layout = zero12_group_layout(numels, world)
    # bf16_optimizer.py:209-215: all padding recorded on the last rank.
    for r in range(world):
        want = layout.padded_numel - sum(numels) if r == world - 1 else 0
        assert bf16_optimizer_group_padding(layout, r) == want


@PROPS
@given(numels=numels_st, world=world_st, rr=st.booleans(), aligned=st.booleans())
def test_param_slice_mappings_match_deepspeed(numels, world, rr, aligned):
    """Against _init_lp_to_hp_mapping + get_hp_fragment_mapping, called on real tensors."""
    import torch
    from deepspeed.utils.mixed_precision_linkage import _init_lp_to_hp_mapping

    order = round_robin_order(len(numels), world) if rr else list(range(len(numels)))
    flat_numels = [numels[i] for i in order]
    pads = ds_alignment_paddings(flat_numels, 2) if aligned else [0] * len(numels)
    layout = zero12_group_layout(flat_numels, world, alignment_paddings=pads)
    offsets = [0] * len(numels)
    for pos, i in enumerate(order):
        offsets[i] = layout.param_offsets[pos]
    use_offsets = any(pads)
    for r in range(world):
        start = r * layout.partition_numel
        params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
        linked = _init_lp_to_hp_mapping(params, start, layout.partition_numel, None,
                                        offsets if use_offsets else None)
        want = []
        for p, lp_start in linked:
            lo = max(lp_start, start)
            hi = min(lp_start + p.numel(), start + layout.partition_numel)
            want.append((next(i for i, q in enumerate(params) if q is p), lo - start, hi - lo))
        got = zero12_param_slice_mappings(numels, start, layout.partition_numel,
                                          offsets if use_offsets else None)
        assert [(m.index, m.start, m.numel) for m in got] == want


@PROPS
@given(numels=numels_st, world=world_st, size=st.one_of(st.none(), st.integers(min_value=0, max_value=400)))
def test_zero3_sub_groups_match_deepspeed(numels, world, size):
    """DeepSpeedZeRoOffload._create_fp16_sub_groups (stage3.py:1210-1233), called unbound."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    class P:
        def __init__(self, i, n):
            self.i, self.n = i, n

        def partition_numel(self):
            return zero3_partition_numel(self.n, world)

    class Self:
        sub_group_size = size

    params = [P(i, n) for i, n in enumerate(numels)]
    want = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(Self(), params)
    assert zero3_sub_groups(numels, world, size) == [[p.i for p in g] for g in want]


@PROPS
@given(numel=st.integers(min_value=1, max_value=500), world=world_st)
def test_zero3_spans_cover_param_once(numel, world):
    per = zero3_partition_numel(numel, world)
    assert per == math.ceil(numel / world)  # partition_parameters.py:1690-1696
    spans = zero3_spans(numel, world, 0)
    assert sum(s.numel for s in spans) == numel
    assert [s.dst_offset for s in spans] == [s.rank * per for s in spans]


# --- plans without files ------------------------------------------------------------------------

SRC = Path("/ckpt/global_step9")


def _fake_zero12(world: int, numels: dict[str, int], *, groups: list[list[str]] | None = None) -> LogicalCheckpoint:
    groups = groups or [list(numels)]
    entries = []
    for g, names in enumerate(groups):
        layout = zero12_group_layout([numels[n] for n in names], world)
        starts = [r * layout.partition_numel for r in range(world)]
        for name, off in zip(names, layout.param_offsets):
            from dsckpt.partition import split_by_partitions

            spans = split_by_partitions(off, numels[name], starts, [layout.partition_numel] * world)
            pieces = []
            for role, state, key in (
                    (Role.MASTER, None, ("optimizer_state_dict", "single_partition_of_fp32_groups", g)),
                    (Role.OPTIM_STATE, "exp_avg", ("optimizer_state_dict", "base_optimizer_state", "state", g,
                                                   "exp_avg")),
                    (Role.OPTIM_STATE, "exp_avg_sq", ("optimizer_state_dict", "base_optimizer_state", "state", g,
                                                      "exp_avg_sq"))):
                pieces.append(Piece(role, "float32", tuple(
                    Fragment(SRC / f"zero_pp_rank_{s.rank}_mp_rank_00_optim_states.pt", key, s.src_offset,
                             s.numel, s.dst_offset, s.rank) for s in spans), state_key=state))
            entries.append(TensorEntry(name, (numels[name],), Kind.PARAM, True, tuple(pieces), group=g))
    files = tuple([SRC / "mp_rank_00_model_states.pt"]
                  + [SRC / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)])
    return LogicalCheckpoint(
        root=SRC.parent, tag=SRC.name, tag_dir=SRC, layout="zero2", zero_stage=2, precision=Precision.FP32,
        dp_world_size=world, pp_world_size=1, tp_world_size=1, ds_version="0.19.8", global_steps=9,
        global_samples=72, optimizer_step=9, optimizer_wrapper="DeepSpeedZeroOptimizer",
        entries=tuple(entries), files=files, ds_config={"zero_optimization": {"stage": 2}})


def _assemble(plan, role_attr: str, numel_total: int) -> dict[tuple, int]:
    """Which source element each target element (rank, group, offset) comes from."""
    out = {}
    for r in plan.ranks:
        for g in r.groups:
            spec = g.master if role_attr == "master" else g.state_specs[role_attr]
            for c in spec.copies:
                for k in range(c.numel):
                    out[(r.rank, g.group, c.dst_offset + k)] = (c.file.name, c.src_offset + k)
    return out


@pytest.mark.parametrize(("src", "dst"), [(8, 4), (4, 3), (2, 3), (3, 2), (4, 1), (1, 4), (5, 5)],
                         ids=lambda v: str(v))
def test_plan_zero12_moves_every_element_once(src, dst):
    numels = {"a": 37, "b": 5, "c": 101, "d": 1}
    ckpt = _fake_zero12(src, numels)
    plan = plan_reshard(ckpt, dst)
    assert plan.has_work == (src != dst)
    assert len(plan.ranks) == dst
    layout = zero12_group_layout(list(numels.values()), dst)
    for r in plan.ranks:
        (g,) = r.groups
        assert g.partition_numel == layout.partition_numel
        assert g.master.numel == layout.partition_numel - layout.rank_padding(r.rank)
        assert g.state_specs["exp_avg"].numel == layout.partition_numel
        assert g.padding_numel == layout.rank_padding(r.rank)
        assert g.master.copied_numel == g.master.numel  # no alignment padding: all of it is params
    # every source element lands exactly once, at its flat position in the new layout
    for attr in ("master", "exp_avg", "exp_avg_sq"):
        moved = _assemble(plan, attr, sum(numels.values()))
        assert len(moved) == sum(numels.values())
        assert len(set(moved.values())) == len(moved)
        src_layout = zero12_group_layout(list(numels.values()), src)
        for (rank, _, off), (fname, src_off) in moved.items():
            src_rank = int(fname.split("_")[3])
            assert rank * layout.partition_numel + off == src_rank * src_layout.partition_numel + src_off


def test_plan_zero12_round_robin_reorders_for_new_size():
    numels = {"w0": 7, "w1": 7, "w2": 7, "w3": 9, "w4": 3}
    # Saved at 2 ranks under round_robin_gradients: flat order w0 w2 w4 w1 w3.
    flat2 = ["w0", "w2", "w4", "w1", "w3"]
    ckpt = _fake_zero12(2, numels, groups=[flat2])
    facts = SourceFacts(group_flat_order=(tuple(flat2),), subgroup_to_group=(0,), round_robin=True)
    plan = plan_reshard(ckpt, 3, facts=facts)
    assert [n for n, _ in plan.param_shapes[0]] == ["w0", "w3", "w1", "w4", "w2"]
    # DeepSpeed's saved mapping walks bit16 order with cumulative offsets (its round-robin quirk).
    maps = [m for r in plan.ranks for m in r.groups[0].slice_mappings]
    assert maps[0] == ("w0", 0, 7)


def test_plan_refuses_tensor_parallel_and_bad_size():
    ckpt = _fake_zero12(2, {"a": 4})
    from dataclasses import replace

    with pytest.raises(UnsupportedCheckpointError, match="tensor parallel size 2"):
        plan_reshard(replace(ckpt, tp_world_size=2), 4)
    with pytest.raises(UsageError, match="positive integer"):
        plan_reshard(ckpt, 0)


def test_describe_plan_names_ranges():
    plan = plan_reshard(_fake_zero12(4, {"a": 37, "b": 5}), 3)
    text = "\n".join(describe_plan(plan))
    assert "from 4 to 3 ranks" in text
    assert "rank 2: zero_pp_rank_2_mp_rank_00_optim_states.pt" in text
    assert "<- zero_pp_rank_" in text
