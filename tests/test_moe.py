"""DeepSpeed Mixture-of-Experts (issue 10): info, scan, repair and reshard on the real ``moe_*`` fixtures,
and real DeepSpeed resuming resharded MoE checkpoints. Export (to-fp32), verify and diff run over the
MoE fixtures in the generic parametrized tests (test_to_fp32.py, test_verify.py, test_diff.py).

Expert tensors carry their *global* expert ids everywhere (what a one-rank model with every expert
calls them), although the optimizer files hold them under local ids: in ``moe_s1_bf16_w4_ep2``
(4 ranks, ep_size 2, 4 experts) ranks 1 and 3 hold experts 2 and 3 as local 0 and 1, the expert group
partitioned over those two ranks (truth.json "moe": ranks)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import all_fixtures, ids, parsed_file, tree_differences
from ds_launch import DEEPSPEED, run_check_script
from safetensors.torch import load_file, save_file
from scan_helpers import copy_fixture, plant, read_copy

from dsckpt.api import to_fp32
from dsckpt.checkpoint import open_checkpoint
from dsckpt.cli import main
from dsckpt.errors import UnsupportedCheckpointError
from dsckpt.model import Precision, Role
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.repair import prepare_repair, run_repair
from dsckpt.reshard import plan_reshard, read_source_facts, run_reshard
from dsckpt.scan import Check, StoredKind, scan

REPO = Path(__file__).resolve().parent.parent
MOE = [f for f in all_fixtures() if "moe" in f.meta]
EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts."


def _fx(name):
    fx = next((f for f in MOE if f.name == name), None)
    if fx is None:
        pytest.skip(f"fixture {name} not generated yet")
    return fx


def _rank_of(fx, ep_rank: int, exp_dp_rank: int) -> int:
    """The data-parallel rank the engine reported for (expert-parallel rank, expert-data-parallel rank)."""
    (r,) = [x["rank"] for x in fx.meta["moe"]["ranks"] if (x["ep_rank"], x["exp_dp_rank"]) == (ep_rank, exp_dp_rank)]
    return r


def _optim_file(ckpt: Path, fx, rank: int) -> Path:
    prefix = "bf16_" if fx.meta["dtype"] == "bf16" else ""
    return ckpt / fx.meta["tag"] / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


# --- info ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fx", MOE, ids=ids(MOE))
def test_info_shows_experts(fx):
    m = fx.meta["moe"]
    res = CliRunner().invoke(main, ["info", "--json", str(fx.ckpt)])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["moe"] == {
        "num_experts": m["num_experts"],
        "layers": [{"prefix": EXPERT, "num_experts": m["num_experts"], "ep_size": m["ep_size"],
                    "local_experts": m["num_local_experts"], "expert_dp_size": m["expert_dp_size"]}],
        "ep_sizes": [m["ep_size"]], "use_data_before_expert_parallelism": False,
        "expert_files": m["num_experts"]}
    assert sorted(t["name"] for t in s["tensors"]) == sorted(fx.meta["params"])
    res = CliRunner().invoke(main, ["info", str(fx.ckpt)])
    assert res.exit_code == 0 and res.stderr == ""
    assert (f"experts      {EXPERT}{{0..{m['num_experts'] - 1}}}: {m['num_experts']} experts (global ids), "
            f"expert-parallel size {m['ep_size']} ({m['num_local_experts']} per rank), "
            f"expert-data-parallel size {m['expert_dp_size']}") in res.stdout.splitlines()


def test_info_of_dense_checkpoint_has_no_moe():
    dense = next(f for f in all_fixtures() if f.name == "s2_fp32_w4")
    s = json.loads(CliRunner().invoke(main, ["info", "--json", str(dense.ckpt)]).stdout)
    assert s["moe"] is None


# --- scan ------------------------------------------------------------------------------------------

# moe_s1_bf16_w4_ep2: expert 3 = local expert 1 of expert-parallel rank 1; its group (param_shapes order: local
# 0 weight+bias, local 1 weight+bias: 64+8+64+8 elements) splits 72/72 over the expert-data-parallel ranks, so
# element 5 of expert 3's weight (flat 77) is in partition 1; expert 0 = local 0 of ep rank 0, its bias at
# flat 64..72 (partition 0).
SCAN_PLANTS = [
    (f"{EXPERT}3.weight", Role.MASTER, 5, StoredKind.MASTER, (1, 1)),
    (f"{EXPERT}3.weight", "exp_avg_sq", 5, StoredKind.EXP_AVG_SQ, (1, 1)),
    (f"{EXPERT}0.bias", "exp_avg", 2, StoredKind.EXP_AVG, (0, 0)),
    (f"{EXPERT}2.weight", Role.MODULE, 7, StoredKind.PARAM, None),
]


@pytest.mark.parametrize("name,role,index,kind,owner", SCAN_PLANTS, ids=[f"{p[0][len(EXPERT):]}-{getattr(p[1], 'value', p[1])}"
                                                                         for p in SCAN_PLANTS])
def test_scan_finds_planted_value_under_global_expert_name(tmp_path, name, role, index, kind, owner):
    fx = _fx("moe_s1_bf16_w4_ep2")
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, name, role, index, math.nan)
    (f,) = scan(ckpt, nonfinite_only=True).findings
    if owner is None:  # the 16-bit module copy lives in the expert file named by the global id
        expert_id = int(name[len(EXPERT):].split(".")[0])
        want_file = ckpt / fx.meta["tag"] / f"layer_0_expert_{expert_id}_mp_rank_00_model_states.pt"
    else:
        want_file = _optim_file(ckpt, fx, _rank_of(fx, *owner))
    assert (f.check, f.name, f.kind, f.file, f.count, f.nan, f.first_indices) == (
        Check.NONFINITE, name, kind, want_file, 1, 1, (index,))
    if owner is not None:
        assert f.rank == _rank_of(fx, *owner)


def test_scan_flags_expert_copy_disagreeing_with_its_master(tmp_path):
    fx = _fx("moe_s2_bf16_w2_ep2")
    ckpt = copy_fixture(fx, tmp_path)
    master = fx.truth()[f"param/{EXPERT}1.weight"].reshape(-1)
    plant(ckpt, f"{EXPERT}1.weight", Role.MASTER, 4, float(master[4]) * 2 + 1)
    assert scan(ckpt, nonfinite_only=True).clean
    (f,) = scan(ckpt).findings
    assert (f.check, f.name, f.kind, f.dtype, f.count, f.first_indices) == (
        Check.MISMATCH, f"{EXPERT}1.weight", StoredKind.PARAM, "bfloat16", 1, (4,))


def test_cli_scan_moe_clean_exit_0():
    fx = _fx("moe_s1_bf16_w4_ep2")
    res = CliRunner().invoke(main, ["scan", str(fx.ckpt)])
    assert res.exit_code == 0, res.output


# --- repair ----------------------------------------------------------------------------------------


def _fp32(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / f"fp32-{len(list(tmp.glob('fp32-*')))}.safetensors"
    to_fp32(ckpt, out)
    return load_file(str(out))


def test_expert_module_copy_repaired_from_its_master(tmp_path):
    fx = _fx("moe_s1_bf16_w4_ep2")
    ckpt = copy_fixture(fx, tmp_path)
    name = f"{EXPERT}3.weight"
    files = plant(ckpt, name, Role.MODULE, 11, -math.inf)
    assert [p.name for p in files] == ["layer_0_expert_3_mp_rank_00_model_states.pt"]
    plan, _ = prepare_repair(ckpt, "master")
    (patch,) = plan.patches
    assert (patch.name, [t.role for t in patch.targets], patch.indices.tolist()) == (name, [Role.MODULE], [11])
    out = tmp_path / "fixed"
    run_repair(plan, out)
    assert scan(out).clean
    assert torch.equal(open_checkpoint(out).tensor(name, role=Role.MODULE), fx.truth()[f"lowp/{name}"])
    got = _fp32(out, tmp_path)
    assert got.keys() == fx.expected_fp32().keys()
    assert all(torch.equal(t, fx.expected_fp32()[n]) for n, t in got.items())


def test_expert_master_repaired_from_fp32_source_by_global_name(tmp_path):
    fx = _fx("moe_s2_bf16_w2_ep2")
    ckpt = copy_fixture(fx, tmp_path)
    name = f"{EXPERT}2.bias"  # expert-parallel rank 1's local expert 0: rank 1's file
    plant(ckpt, name, Role.MASTER, 3, math.nan)
    original = fx.expected_fp32()
    sd = {k: v.contiguous() for k, v in original.items()}
    sd[name] = original[name] + 0.5
    save_file(sd, str(tmp_path / "source.safetensors"))
    plan, _ = prepare_repair(ckpt, tmp_path / "source.safetensors")
    (patch,) = plan.patches
    assert patch.name == name and patch.indices.tolist() == [3]
    assert sorted(t.role.value for t in patch.targets) == ["master", "module"]
    out = tmp_path / "fixed"
    run_repair(plan, out)
    assert scan(out).clean
    got = _fp32(out, tmp_path)
    want = original[name].clone()
    want[3] = sd[name][3]
    assert torch.equal(got.pop(name), want)
    assert all(torch.equal(t, original[n]) for n, t in got.items())


def test_stage0_expert_moment_found_in_its_expert_parallel_ranks_file(tmp_path):
    """No ZeRO: expert 3's Adam state lives in expp_rank_1 (expert-parallel rank 1 holds experts 2, 3)."""
    fx = _fx("moe_s0_fp32_w2_ep2")
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, f"{EXPERT}3.bias", "exp_avg_sq", 6, math.inf)
    (f,) = scan(ckpt, nonfinite_only=True).findings
    assert (f.name, f.kind, f.file.name, f.posinf, f.first_indices) == (
        f"{EXPERT}3.bias", StoredKind.EXP_AVG_SQ, "expp_rank_1_mp_rank_00_optim_states.pt", 1, (6,))


def test_stage0_fp32_expert_repaired_from_source(tmp_path):
    """fp32 without ZeRO: the expert file's weight is the master; repair writes the source's value there."""
    fx = _fx("moe_s0_fp32_w2_ep2")
    ckpt = copy_fixture(fx, tmp_path)
    name = f"{EXPERT}1.weight"
    (changed,) = plant(ckpt, name, Role.MODULE, 9, math.nan)
    assert changed.name == "layer_0_expert_1_mp_rank_00_model_states.pt"
    original = fx.expected_fp32()
    sd = {k: v.contiguous() for k, v in original.items()}
    sd[name] = original[name] - 1.0
    save_file(sd, str(tmp_path / "source.safetensors"))
    plan, _ = prepare_repair(ckpt, tmp_path / "source.safetensors")
    (patch,) = plan.patches
    assert (patch.name, [t.role for t in patch.targets], patch.indices.tolist()) == (name, [Role.MODULE], [9])
    run_repair(plan, tmp_path / "fixed")
    assert scan(tmp_path / "fixed").clean
    got = _fp32(tmp_path / "fixed", tmp_path)
    want = original[name].clone()
    want.view(-1)[9] = sd[name].view(-1)[9]
    assert torch.equal(got.pop(name), want)
    assert all(torch.equal(t, original[n]) for n, t in got.items())


# --- reshard (library) -----------------------------------------------------------------------------


def _reshard(src: Path, out: Path, world_size: int):
    cache = FileCache()
    ckpt = read_checkpoint(src, cache=cache)
    plan = plan_reshard(ckpt, world_size, facts=read_source_facts(ckpt, cache))
    return plan, run_reshard(plan, out, cache=cache)


@pytest.mark.parametrize("fx", MOE, ids=ids(MOE))
def test_reshard_keeps_experts_moments_and_expert_parallel_size(fx, tmp_path):
    """Every role (master, both moments, 16-bit copy) of every expert survives a reshard to twice the
    size and back, and each target rank file holds its expert-parallel rank's experts."""
    ep = fx.ep_size
    world = 2 * fx.meta["dp_world_size"]
    plan, _ = _reshard(fx.ckpt, tmp_path / "up", world)
    assert any("expert-parallel size kept" in n for n in plan.notes)
    up = read_checkpoint(tmp_path / "up")
    assert up.dp_world_size == world and up.moe is not None and up.moe.ep_sizes == (ep,)
    _reshard(tmp_path / "up", tmp_path / "back", fx.meta["dp_world_size"])
    truth = fx.truth()
    stage0 = fx.meta["stage"] == 0
    module_is_master = stage0 and fx.meta["dtype"] == "fp32"  # fp32 without ZeRO: the module weights are the masters
    for path in (tmp_path / "up", tmp_path / "back"):
        c = open_checkpoint(path)
        for name in fx.meta["params"]:
            for role, key in ((Role.MODULE if module_is_master else Role.MASTER, "param"), ("exp_avg", "exp_avg"),
                              ("exp_avg_sq", "exp_avg_sq"), (Role.MODULE, "lowp")):
                assert torch.equal(read_copy(c.logical.entry(name), c.cache, role), truth[f"{key}/{name}"]), \
                    (path.name, name, role)
    if stage0:  # the expp_rank_{R} files belong to expert-parallel ranks: copied, one per ep rank
        tag = fx.meta["tag"]
        got = sorted(p.name for p in (tmp_path / "up" / tag).glob("expp_rank_*"))
        assert got == [f"expp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ep)]
        return
    # the saved size again: the files DeepSpeed wrote (test_reshard's same-size test compares them all)
    from dsckpt import parsed_tree, safe_load

    n_local = fx.meta["moe"]["num_local_experts"]
    for r in range(world):
        osd = parsed_tree.materialize(safe_load.load(_optim_file(tmp_path / "up", fx, r)))["optimizer_state_dict"]
        assert osd["partition_count"] == [world, world // ep]
        expert_group = osd["single_partition_of_fp32_groups"][1]
        ep_rank, k = r % ep, r // ep  # default topology: expert-parallel groups are consecutive ranks
        local = [truth[f"param/{EXPERT}{ep_rank * n_local + i}.{p}"].reshape(-1)
                 for i in range(n_local) for p in ("weight", "bias")]  # param_shapes order
        flat = torch.cat(local)
        part = -(-flat.numel() // (2 * (world // ep))) * 2  # padded to 2 * expert-dp size, split evenly
        assert torch.equal(expert_group, flat[k * part:(k + 1) * part]), r


def test_reshard_refuses_a_size_the_expert_parallel_size_does_not_divide(tmp_path):
    fx = _fx("moe_s2_bf16_w2_ep2")
    r = CliRunner().invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "o"), "-n", "3"])
    assert r.exit_code == 3
    err = r.stderr.strip()
    assert "\n" not in err and "expert-parallel size 2" in err and "pick a multiple of 2" in err
    assert not (tmp_path / "o").exists()


def test_reshard_dry_run_names_expert_files(tmp_path):
    fx = _fx("moe_s2_bf16_w2_ep2")
    r = CliRunner().invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "o"), "-n", "4", "--dry-run"])
    assert r.exit_code == 1, r.output
    assert "expert-parallel size kept at 2 (expert-data-parallel 1 -> 2)" in r.stdout
    assert "copy layer_0_expert_0_mp_rank_00_model_states.pt, layer_0_expert_1" in r.stdout


# --- refusals --------------------------------------------------------------------------------------


def test_stage0_moe_precision_must_match_its_optimizer_files(tmp_path):
    """Stage-0 MoE in bf16/fp16 keeps FP16_UnfusedOptimizer or FP16_Optimizer state in the expp_rank_* files, fp32 a
    plain torch optimizer's. The real fp32 stage-0 save, its config switched to bf16, must be refused, not read as either."""
    from dsckpt import parsed_tree, safe_load, safe_save

    fx = _fx("moe_s0_fp32_w2_ep2")
    ckpt = copy_fixture(fx, tmp_path)
    ms = ckpt / fx.meta["tag"] / "mp_rank_00_model_states.pt"
    tree = parsed_tree.materialize(safe_load.load(ms))
    tree["ds_config"]["bf16"] = {"enabled": True}
    safe_save.save(tree, ms)
    r = CliRunner().invoke(main, ["info", str(ckpt)])
    assert r.exit_code == 3
    err = r.stderr.strip()
    assert "\n" not in err and "saved without ZeRO" in err
    assert ("whose expp_rank_0_mp_rank_00_optim_states.pt holds no FP16_UnfusedOptimizer (fp32_groups) or "
            "FP16_Optimizer (fp32_groups_flat) state beside an optimizer_state_dict") in err


def test_zero3_autoep_checkpoint_is_refused(tmp_path):
    """DeepSpeed 0.19.8 refuses native MoE at ZeRO-3 (engine.py _validate_zero3_moe_compatibility); only
    AutoEP layers train there. Their checkpoints are read (tests/test_autoep.py); a ``ds_autoep_layers`` record
    whose files do not hold AutoEP's partition records is refused, naming AutoEP."""
    from dsckpt import parsed_tree, safe_load, safe_save

    fx = next(f for f in all_fixtures() if f.name == "s3_fp32_w2")
    ckpt = copy_fixture(fx, tmp_path)
    for f in sorted((ckpt / fx.meta["tag"]).glob("zero_pp_rank_*_model_states.pt")):
        tree = parsed_tree.materialize(safe_load.load(f))
        tree["ds_autoep_layers"] = [{"name": "layers.0.mlp"}]
        tree["num_experts"] = [4]
        safe_save.save(tree, f)
    r = CliRunner().invoke(main, ["info", str(ckpt)])
    assert r.exit_code == 3
    err = r.stderr.strip()
    assert "\n" not in err and "no 'ds_zero_partition_groups' record per sub-group (AutoEP ZeRO-3 writes one)" in err


# --- ZeRO stage changes (issue 32) -----------------------------------------------------------------


def _convert(src: Path, out: Path, world_size: int, stage: int, ep_size: int | None = None):
    cache = FileCache()
    ckpt = read_checkpoint(src, cache=cache)
    plan = plan_reshard(ckpt, world_size, zero_stage=stage, ep_size=ep_size, facts=read_source_facts(ckpt, cache))
    return plan, run_reshard(plan, out, cache=cache, verify="full")


def _assert_every_role_is_the_truth(path: Path, fx) -> None:
    """Every param's master (the module weight at stage 0 fp32), both moments and 16-bit copy, read back from
    ``path`` under global expert names, equal ``fx``'s truth bit for bit."""
    truth = fx.truth()
    c = open_checkpoint(path)
    stage0 = c.logical.zero_stage == 0 and c.logical.precision is Precision.FP32
    for name in fx.meta["params"]:
        for role, key in ((Role.MODULE if stage0 else Role.MASTER, "param"), ("exp_avg", "exp_avg"),
                          ("exp_avg_sq", "exp_avg_sq"), (Role.MODULE, "lowp")):
            assert torch.equal(read_copy(c.logical.entry(name), c.cache, role), truth[f"{key}/{name}"]), (name, role)


STAGE_CHANGES = [(f, s) for f in MOE for s in (0, 1, 2) if s != f.meta["stage"]]


@pytest.mark.parametrize("fx,stage", STAGE_CHANGES, ids=[f"{f.name}-to-stage{s}" for f, s in STAGE_CHANGES])
def test_moe_stage_change(fx, stage, tmp_path):
    """Native MoE written for another of ZeRO-0/1/2 at twice its size: every role of every expert and dense param
    is the truth, the expert-parallel size is kept, and the files are the target stage's (stage 0: one
    expp_rank_* optimizer file per expert-parallel rank; ZeRO: one optimizer file per rank)."""
    ep, world = fx.ep_size, 2 * fx.meta["dp_world_size"]
    plan, result = _convert(fx.ckpt, tmp_path / "out", world, stage)
    assert result.verified_tensors > 0 and plan.changes_layout
    back = read_checkpoint(tmp_path / "out")
    assert (back.zero_stage, back.dp_world_size, back.moe.ep_sizes) == (stage, world, (ep,))
    assert back.optimizer_step == int(fx.meta["optimizer_step"][0])
    _assert_every_role_is_the_truth(tmp_path / "out", fx)
    names = sorted(p.name for p in (tmp_path / "out" / fx.meta["tag"]).iterdir())
    experts = [f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in range(fx.meta["moe"]["num_experts"])]
    if stage == 0:
        optim = [f"expp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(ep)]
    else:
        optim = sorted(_optim_file(tmp_path / "out", fx, r).name for r in range(world))
    assert names == sorted([*optim, *experts, "mp_rank_00_model_states.pt"])


@pytest.mark.parametrize("name", ["moe_s0_fp32_w2_ep2", "moe_s0_bf16_w2_ep2", "moe_s0_bf16_w2_ep2_fused"])
def test_moe_stage0_through_zero_and_back_is_the_same_files(name, tmp_path):
    """Stage-0 MoE (ep 2) -> ZeRO-2 on 4 ranks (expert-data-parallel 2) -> stage 0 on 2 ranks gives back the
    files DeepSpeed wrote, every one, key for key and bit for bit: the expp_rank_* optimizer files with each rank's
    experts under local names (bf16: FP16_UnfusedOptimizer's fp32_groups, loss-scale fields and inner state, or
    FP16_Optimizer's flat fp32_groups_flat per group and clip_grad),
    mp_rank_00 with rank 0's optimizer, the expert files."""
    fx = _fx(name)
    _convert(fx.ckpt, tmp_path / "zero", 4, 2)
    _convert(tmp_path / "zero", tmp_path / "back", 2, 0)
    tag = fx.meta["tag"]
    names = sorted(p.name for p in (fx.ckpt / tag).iterdir())
    assert sorted(p.name for p in (tmp_path / "back" / tag).iterdir()) == names
    for n in names:
        assert tree_differences(parsed_file(fx.ckpt / tag / n), parsed_file(tmp_path / "back" / tag / n)) == [], n


STAGE0_MOE = ["moe_s0_fp32_w2_ep2", "moe_s0_bf16_w2_ep2", "moe_s0_bf16_w2_ep2_fused"]


@pytest.mark.parametrize("name", STAGE0_MOE)
def test_moe_stage0_to_another_expert_parallel_size_and_back(name, tmp_path):
    """Stage-0 MoE (ep 2) written at ep 1 without ZeRO: one expp_rank file holding every expert under local names
    (its expert group renamed ep_size_1), every role the truth; written back at ep 2 it is the files DeepSpeed wrote,
    bit for bit. ep 4 with ZeRO-2 on 4 ranks: every role the truth."""
    fx = _fx(name)
    tag = fx.meta["tag"]
    _convert(fx.ckpt, tmp_path / "e1", 2, 0, ep_size=1)
    e1 = read_checkpoint(tmp_path / "e1")
    assert (e1.zero_stage, e1.moe.ep_sizes, e1.moe.layers[0][1:]) == (0, (1,), (4, 1))
    _assert_every_role_is_the_truth(tmp_path / "e1", fx)
    assert sorted(p.name for p in (tmp_path / "e1" / tag).glob("expp_rank_*")) == [
        "expp_rank_0_mp_rank_00_optim_states.pt"]
    groups = e1.optimizer_groups
    assert [g.hyperparam("name") for g in groups] == ["dense", "ep_size_1"]
    _convert(tmp_path / "e1", tmp_path / "back", 2, 0, ep_size=2)
    names = sorted(p.name for p in (fx.ckpt / tag).iterdir())
    assert sorted(p.name for p in (tmp_path / "back" / tag).iterdir()) == names
    for n in names:
        assert tree_differences(parsed_file(fx.ckpt / tag / n), parsed_file(tmp_path / "back" / tag / n)) == [], n
    _convert(fx.ckpt, tmp_path / "z2", 4, 2, ep_size=4)
    assert read_checkpoint(tmp_path / "z2").moe.ep_sizes == (4,)
    _assert_every_role_is_the_truth(tmp_path / "z2", fx)


def test_moe_stage_change_with_another_expert_parallel_size(tmp_path):
    fx = _fx("moe_s1_bf16_w4_ep2")
    _convert(fx.ckpt, tmp_path / "out", 4, 2, ep_size=4)
    back = read_checkpoint(tmp_path / "out")
    assert (back.zero_stage, back.moe.ep_sizes) == (2, (4,))
    _assert_every_role_is_the_truth(tmp_path / "out", fx)


@pytest.mark.parametrize("name,stage,why", [
    ("moe_s2_bf16_w2_ep2", 3, "DeepSpeed 0.19.8 has no native MoE at ZeRO-3"),
    ("moe_s0_fp32_w2_ep2", 3, "DeepSpeed 0.19.8 has no native MoE at ZeRO-3"),
])
def test_moe_stage_changes_refused_by_name(name, stage, why):
    cache = FileCache()
    ckpt = read_checkpoint(_fx(name).ckpt, cache=cache)
    with pytest.raises(UnsupportedCheckpointError, match=why):
        plan_reshard(ckpt, 4, zero_stage=stage, facts=read_source_facts(ckpt, cache))


# --- real DeepSpeed --------------------------------------------------------------------------------

# target world size -> (fixture, chain of world sizes before it); one launch per target size.
DS_MOE_CASES: dict[int, list[tuple[str, tuple[int, ...]]]] = {
    # expert-data-parallel 1 -> 2; stage 0: the expp_rank_{0,1} files serve two ranks each
    4: [("moe_s2_bf16_w2_ep2", ()), ("moe_s0_fp32_w2_ep2", ()), ("moe_s0_bf16_w2_ep2", ()),
        ("moe_s1_bf16_w2_ep2_bf16opt", ())],  # BF16_Optimizer kept: expert-data-parallel 1 -> 2
    2: [("moe_s1_bf16_w4_ep2", ()), ("moe_s2_fp32_w2_ep1", (3,))],  # 2 -> 1; ep 1 via 3 ranks
}
NEGATIVE = f"{EXPERT}3.weight"  # planted into a resharded copy: the check must catch it



@pytest.fixture(scope="module")
def ds_moe_runs(tmp_path_factory):
    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    base = tmp_path_factory.mktemp("ds_moe")
    runs = {}
    for world, cases in DS_MOE_CASES.items():
        pairs = []
        for name, chain in cases:
            src = _fx(name).ckpt
            for i, step in enumerate((*chain, world)):
                out = base / f"for{world}_{name}_{i}_to{step}"
                _reshard(src, out, step)
                src = out
            pairs.append(f"{name}={src}")
        if world == 2:  # negative control: a changed expert master must fail the check
            bad = base / "negative"
            _reshard(_fx("moe_s1_bf16_w4_ep2").ckpt, bad, 2)
            plant(bad, NEGATIVE, Role.MASTER, 0, 12.5)
            pairs.append(f"moe_s1_bf16_w4_ep2={bad}")
        runs[world] = run_check_script("ds_moe_reshard_check.py", pairs, world=world, cwd=base, timeout=900)
    return runs


@pytest.mark.live
@pytest.mark.deepspeed
@pytest.mark.parametrize("world", sorted(DS_MOE_CASES), ids=lambda w: f"to{w}")
def test_deepspeed_resumes_resharded_moe_checkpoints(ds_moe_runs, world):
    """Plain ``engine.load_checkpoint()`` on ``world`` CPU ranks: every rank's masters, moments and
    16-bit weights equal the engine's truth under global expert ids, then one more step trains."""
    rc, results, log = ds_moe_runs[world]
    assert results, log
    good = [r for r in results if not r["ckpt"].endswith("negative")]
    failed = [r for r in good if not r["ok"]]
    assert not failed, "\n".join(f"{r['fixture']}: {r['problems']}" for r in failed)
    assert [r["fixture"] for r in good] == [n for n, _ in DS_MOE_CASES[world]]
    if world == 2:
        (neg,) = [r for r in results if r["ckpt"].endswith("negative")]
        # expert 3 is local expert 1 on expert-parallel rank 1 (ranks 1 of 2): the check names it globally
        assert not neg["ok"] and neg["problems"] == sorted([
            f"rank 1: param of '{EXPERT}1.weight' (global '{NEGATIVE}') differs from the source (fragment API)",
            f"rank 1: flat partition param of '{NEGATIVE}' (group 1, 1 ranks) differs from the source"]), neg
        assert rc == 1, log
    else:
        assert rc == 0, log


def test_moe_refusal_names_expert_parallel_size_in_plan():
    fx = _fx("moe_s1_bf16_w4_ep2")
    ckpt = read_checkpoint(fx.ckpt)
    with pytest.raises(UnsupportedCheckpointError, match="must divide the new world size"):
        plan_reshard(ckpt, 3)


def test_wrong_expert_rank_arithmetic_is_refused_not_exported(tmp_path):
    """The binding proof can fail: claim the other topology (data before expert parallelism, where ranks
    0,1 hold expert-parallel rank 0) on a save made with the default one (ranks 0,2): the masters would be
    bound to other experts' names, their copies disagree, nothing is read."""
    from dsckpt import parsed_tree, safe_load, safe_save

    fx = _fx("moe_s1_bf16_w4_ep2")
    ckpt = copy_fixture(fx, tmp_path)
    for f in sorted((ckpt / fx.meta["tag"]).glob("*.pt")):
        tree = parsed_tree.materialize(safe_load.load(f))
        if isinstance(tree.get("ds_config"), dict):
            tree["ds_config"]["use_data_before_expert_parallelism"] = True
            safe_save.save(tree, f)
    r = CliRunner().invoke(main, ["to-fp32", str(ckpt), str(tmp_path / "out.safetensors")])
    assert r.exit_code == 3, r.output
    err = r.stderr.strip()
    assert "\n" not in err and "use_data_before_expert_parallelism=True) does not fit" in err
    assert f"'{EXPERT}2.weight' (expert-parallel rank 1, layer_0_expert_2" in err
    assert not (tmp_path / "out.safetensors").exists()


# One launch on 4 CPU ranks: native MoE written for another ZeRO stage (target stage per pair, FIXTURE@STAGE),
# resumed by plain load_checkpoint, every rank's masters, moments and weights the truth, one more step.
# (fixture, target stage, stage on the way or None, --ep-size or None). The order matters: DeepSpeed 0.19.8 keeps
# expert groups process-wide (groups._EXPERT_PARALLEL_GROUP), and a stage-0 engine loads the expp_rank_* file of
# the largest expert-parallel size created so far in the process (engine.py _load_checkpoint:
# groups._get_max_expert_size_name()), not its own; so the stage-0 targets come first, by growing ep size.
DS_MOE_STAGE_CASES = [
    ("moe_s2_fp32_w2_ep1", 0, None, None),  # ZeRO-2 -> stage 0, one expp_rank file for 4 ranks
    ("moe_s2_bf16_w2_ep2", 0, None, 1),  # bf16 ZeRO-2 -> stage 0 at expert-parallel size 1: one expp_rank file
    ("moe_s1_bf16_w2_ep2_bf16opt", 0, None, 1),  # BF16_Optimizer -> stage 0 (FP16_UnfusedOptimizer) at ep 1
    ("moe_s0_fp32_w2_ep2", 0, 2, None),  # stage 0 -> ZeRO-2 -> stage 0: each expp_rank file serves 2 ranks
    ("moe_s2_bf16_w2_ep2", 0, None, None),  # bf16 ZeRO-2 -> stage 0: FP16_UnfusedOptimizer in the expp_rank files
    ("moe_s0_bf16_w2_ep2_fused", 0, 2, None),  # FusedAdam: stage 0 -> ZeRO-2 -> stage 0 (FP16_Optimizer's flat masters)
    ("moe_s0_fp32_w2_ep2", 2, None, None),  # stage 0 -> ZeRO-2, expert-data-parallel 1 -> 2
    ("moe_s0_bf16_w2_ep2", 2, None, None),  # bf16 stage 0 (FP16_UnfusedOptimizer) -> ZeRO-2
    ("moe_s0_bf16_w2_ep2", 1, None, None),  # bf16 stage 0 -> ZeRO-1
    ("moe_s0_bf16_w2_ep2_fused", 2, None, None),  # bf16 stage 0 with FusedAdam -> ZeRO-2
    ("moe_s2_bf16_w2_ep2", 1, None, None),  # ZeRO-2 -> ZeRO-1
    ("moe_s1_bf16_w2_ep2_bf16opt", 2, None, None),  # BF16_Optimizer -> ZeRO-2
    ("moe_s0_bf16_w2_ep2", 2, None, 4),  # bf16 stage 0 -> ZeRO-2 at expert-parallel size 4
    ("moe_s0_fp32_w2_ep2", 0, None, 4),  # stage 0 at expert-parallel size 2 -> 4: four expp_rank files
    ("moe_s1_bf16_w4_ep2", 2, None, 4),  # ZeRO-1 -> ZeRO-2 and expert-parallel size 2 -> 4 (last: see above)
]
# its exp_avg (fp32 target) or fp32 master (bf16 target) planted into the stage-0 expp_rank_1 file: the check must
# see it
STAGE_NEGATIVE = f"{EXPERT}2.weight"
NEGATIVE_STAGE0 = [("moe_s0_fp32_w2_ep2", "exp_avg"), ("moe_s2_bf16_w2_ep2", Role.MASTER),
                   ("moe_s0_bf16_w2_ep2_fused", Role.MASTER)]


@pytest.fixture(scope="module")
def ds_moe_stage_run(tmp_path_factory):
    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    base = tmp_path_factory.mktemp("ds_moe_stage")
    pairs = []
    for i, (name, stage, via, ep) in enumerate(DS_MOE_STAGE_CASES):
        src = _fx(name).ckpt
        if via is not None:
            _convert(src, base / f"{i}_via", 4, via)
            src = base / f"{i}_via"
        _convert(src, base / f"{i}_{name}", 4, stage, ep_size=ep)
        pairs.append(f"{name}@{stage}={base / f'{i}_{name}'}")
    # stage-0 targets at ep 2: right after the others (see DS_MOE_STAGE_CASES)
    for name, role in NEGATIVE_STAGE0:
        bad = base / f"negative_{name}"
        src = _fx(name).ckpt
        if _fx(name).meta["stage"] == 0:  # through ZeRO-2, so that the stage-0 writer writes it
            _convert(src, base / f"negative_{name}_via", 4, 2)
            src = base / f"negative_{name}_via"
        _convert(src, bad, 4, 0)
        assert [p.name for p in plant(bad, STAGE_NEGATIVE, role, 0, 12.5)] == ["expp_rank_1_mp_rank_00_optim_states.pt"]
        pairs.insert(6, f"{name}@0={bad}")  # after the stage-0 targets at ep 1 and 2
    return run_check_script("ds_moe_reshard_check.py", pairs, world=4, cwd=base, timeout=1500)


@pytest.mark.live
@pytest.mark.deepspeed
def test_deepspeed_resumes_moe_stage_changes(ds_moe_stage_run):
    """Native MoE at another of ZeRO-0/1/2 (and another expert-parallel size), fp32 and bf16 (stage 0 under
    FP16_UnfusedOptimizer or FP16_Optimizer): plain ``engine.load_checkpoint()`` on 4 CPU ranks at the new stage;
    every rank's masters, moments and weights equal the truth under global expert ids, and one more step trains.
    The controls with one expert moment (fp32) or fp32 master (bf16, torch Adam and FusedAdam) changed fail on
    exactly that, on the two ranks of expert-parallel rank 1."""
    rc, results, log = ds_moe_stage_run
    assert results, log
    good = [r for r in results if "negative_" not in r["ckpt"]]
    failed = [r for r in good if not r["ok"]]
    assert not failed, "\n".join(f"{r['fixture']}: {r['problems']}" for r in failed)
    assert [r["fixture"] for r in good] == [f"{n}@{s}" for n, s, _, _ in DS_MOE_STAGE_CASES]
    negs = {r["fixture"]: r for r in results if "negative_" in r["ckpt"]}
    # global expert 2 is local expert 0 of expert-parallel rank 1: ranks 1 and 3 of 4 (ep 2, default topology)
    assert sorted(negs) == sorted(f"{n}@0" for n, _ in NEGATIVE_STAGE0)
    for fixture, key in (("moe_s0_fp32_w2_ep2@0", "exp_avg"), ("moe_s2_bf16_w2_ep2@0", "param"),
                         ("moe_s0_bf16_w2_ep2_fused@0", "param")):
        assert not negs[fixture]["ok"] and negs[fixture]["problems"] == [
            f"rank {r}: {key} of '{EXPERT}0.weight' (global '{STAGE_NEGATIVE}') differs from the source (fragment API)"
            for r in (1, 3)], negs[fixture]
    assert rc == 1, log

