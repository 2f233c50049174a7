"""reshard of pipeline-parallel (PipelineModule) checkpoints (issue 32): another data-parallel size with the stages
kept, another stage count with the boundaries DeepSpeed's partition method computes, checked against the recorded
truth (safe_get_full_fp32_param / safe_get_full_optimizer_state) and against DeepSpeed's own files."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import all_fixtures, ids, tree_digest
from test_reshard import _materialized, _same

from dsckpt.cli import main
from dsckpt.errors import UnsupportedCheckpointError, UsageError
from dsckpt.model import Role
from dsckpt.parallel_layout import partition_balanced, partition_uniform, stage_parts
from dsckpt.pipeline_stages import plan_stages
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.reshard import plan_reshard, read_source_facts, run_reshard

PIPELINE = [f for f in all_fixtures() if f.meta.get("pp_size", 1) > 1 and (f.ckpt / f.meta["tag"]).is_dir()]
# the fixtures' PipelineModule: 7 layers, the last a tied use with a forward_fn (no file), partition_method uniform
UNIFORM = {"partition_method": "uniform", "num_layers": 7}
LAYER_TYPES = ["Embedding[embed]", "Linear", "BatchNormPipe", "ReLU", "FrozenLinear", "Linear", "Embedding[embed]"]


def _reshard(src: Path, out: Path, world_size: int, tied_keys: dict[int, str] | None = None, **kw):
    cache = FileCache()
    ckpt = read_checkpoint(src, cache=cache, tied_keys=tied_keys)
    plan = plan_reshard(ckpt, world_size, facts=read_source_facts(ckpt, cache), **kw)
    return plan, run_reshard(plan, out, cache=cache)


def _fixture(name: str):
    # pp2_fp32_z0 leaves its tied module's key open (expect_ambiguous): the tests here give it
    fx = [f for f in all_fixtures(include_ambiguous=True) if f.name == name]
    if not fx:
        pytest.skip(f"no fixture {name}")
    return fx[0]


# ---------------------------------------------------------------------------------------------- partition arithmetic

def test_partition_arithmetic_is_deepspeeds():
    """dsckpt's pure copies of partition_uniform / partition_balanced give DeepSpeed's own boundaries (its
    functions called in-process) on 300 layer lists: ties, zero weights, fewer layers than stages, huge counts."""
    du = pytest.importorskip("deepspeed.runtime.utils")
    rng = random.Random(32)
    for _ in range(300):
        n, parts = rng.randint(0, 20), rng.randint(1, 9)
        kind = rng.choice(["small", "big", "binary", "zeros", "equal"])
        w = [{"small": lambda: rng.randint(0, 4), "big": lambda: rng.randint(0, 10**10),
              "binary": lambda: rng.randint(0, 1), "zeros": lambda: 0, "equal": lambda: 7}[kind]() for _ in range(n)]
        assert partition_balanced(w, parts) == tuple(int(x) for x in du.partition_balanced(w, parts)), (w, parts)
        assert partition_uniform(n, parts) == tuple(du.partition_uniform(n, parts)), (n, parts)


def test_stage_parts_methods():
    assert stage_parts("uniform", 2, [66, 49, 14, 0, 0, 36, 66]) == (0, 4, 7)
    assert stage_parts("parameters", 2, [66, 49, 14, 0, 0, 36, 66]) == (0, 2, 7)
    assert stage_parts("type:linear", 2, [0] * 4, ["Embedding", "Linear", "ReLU", "Linear"]) == (0, 3, 4)
    with pytest.raises(ValueError, match="matches none"):
        stage_parts("type:conv", 2, [0] * 2, ["Linear", "ReLU"])
    with pytest.raises(ValueError, match="not one of DeepSpeed's"):
        stage_parts("profile", 2, [1, 2])


# ---------------------------------------------------------------------------------------------- plans (pure)

@pytest.mark.parametrize("pp, parts, stage_params", [
    (4, (0, 2, 4, 6, 7), [["tied_modules.embed.weight", "1.weight", "1.bias"], ["2.weight", "2.bias"],
                          ["5.weight", "5.bias"], ["tied_modules.embed.weight"]]),
    (1, (0, 7), [["tied_modules.embed.weight", "1.weight", "1.bias", "2.weight", "2.bias", "5.weight", "5.bias"]]),
    (3, (0, 3, 5, 7), None),
], ids=["2to4", "2to1", "2to3"])
def test_plan_stages(pp, parts, stage_params):
    fx = _fixture("pp2_fp32")
    ckpt = read_checkpoint(fx.ckpt)
    if pp == 3:  # stage 1 would hold layers 3-4 (ReLU, frozen Linear): no trainable param, refused
        with pytest.raises(UnsupportedCheckpointError, match="stage 1 group 0 would hold no trainable params"):
            plan_stages(ckpt, pp, method="uniform", num_layers=7)
        return
    stages = plan_stages(ckpt, pp, method="uniform", num_layers=7)
    assert stages.target.parts == parts and stages.source.parts == (0, 4, 7)
    assert [list(g[0]) for g in stages.group_orders] == stage_params
    # the file-less layer 6 was read as the tied output head: the only reading that puts 'embed' on source stage 1
    assert stages.source.layers[6].tied_key == "embed" and not stages.source.layers[6].has_file


def test_plan_keeps_stages_for_a_data_parallel_change():
    fx = _fixture("pp2_fp32")
    ckpt = read_checkpoint(fx.ckpt)
    plan = plan_reshard(ckpt, 4)
    assert (plan.source_pp_size, plan.pp_size, plan.source_world_size, plan.world_size) == (2, 2, 1, 2)
    assert [p.mp_rank for p in plan.parts()] == [0, 1]
    assert [r.optim_file for r in plan.mp_ranks[1].ranks] == [
        "zero_pp_rank_0_mp_rank_01_optim_states.pt", "zero_pp_rank_1_mp_rank_01_optim_states.pt"]
    assert plan.parallel.stages.target is None and plan.has_work


def test_source_stages_must_match_the_method():
    fx = _fixture("pp2_fp32")
    ckpt = read_checkpoint(fx.ckpt)
    with pytest.raises(UnsupportedCheckpointError) as e:
        plan_reshard(ckpt, 4, pp_size=4, partition_method="parameters", num_layers=7)
    msg = str(e.value)
    assert "partition_method 'parameters' over 7 layers does not give the source's 2 stages" in msg
    assert "it computes stage 0: layers 0-0, stage 1: layers 1-6" in msg
    assert "the files show stage 0: layers [1, 2] and tied ['embed'], stage 1: layers [5] and tied ['embed']" in msg
    with pytest.raises(UnsupportedCheckpointError, match="count them with --num-layers"):
        plan_reshard(ckpt, 4, pp_size=4, partition_method="uniform")
    with pytest.raises(UsageError, match="needs.*--layer-types|no checkpoint file stores"):
        plan_reshard(ckpt, 4, pp_size=4, partition_method="type:Linear")
    with pytest.raises(UsageError, match="not a multiple of the tensor-parallel size 1 times the pipeline size 4"):
        plan_reshard(ckpt, 6, pp_size=4, **UNIFORM)


# ---------------------------------------------------------------------------------------------- outputs vs truth

def _check_truth(fx, out: Path, pp: int, dp: int):
    """Every trainable param's fp32 master (at stage 0 its fp32 module weight) and Adam moments in ``out`` (re-read by
    dsckpt) equal DeepSpeed's own full values recorded at generation (bit for bit), and the output has ``pp`` stages
    of ``dp`` ranks."""
    cache = FileCache()
    new = read_checkpoint(out, cache=cache)
    assert (new.pp_world_size, new.dp_world_size) == (pp, dp)
    assert new.optimizer_step == fx.meta["optimizer_step"][0] and new.global_steps == fx.meta["global_steps"]
    truth = fx.truth()
    from dsckpt.assemble import read_piece

    checked = 0
    for e in new.entries:
        master = e.piece(Role.MASTER) if new.zero_stage else e.piece(Role.MODULE)
        for key, piece in (("param", master), ("exp_avg", e.state_piece("exp_avg")),
                           ("exp_avg_sq", e.state_piece("exp_avg_sq"))):
            if f"{key}/{e.name}" not in truth or piece is None or not e.trainable:
                continue
            got = read_piece(piece, e.shape, cache, name=e.name)
            want = truth[f"{key}/{e.name}"]
            assert torch.equal(got, want.to(got.dtype)) and want.dtype == torch.float32, (e.name, key)
            checked += 1
    assert checked == 3 * len(fx.meta["trainable"])
    return new


CASES = [  # (fixture, --world-size, options, stages, data-parallel size)
    ("pp2_fp32", 4, {}, 2, 2),
    ("pp2_fp32", 4, {"pp_size": 4, **UNIFORM}, 4, 1),
    ("pp2_fp32", 1, {"pp_size": 1, **UNIFORM}, 1, 1),
    ("pp2_dp2_fp32", 2, {}, 2, 1),
    ("pp2_dp2_fp32", 8, {"pp_size": 4, **UNIFORM}, 4, 2),
    ("pp2_dp2_bf16", 4, {"pp_size": 4, **UNIFORM}, 4, 1),
    ("pp2_bf16", 4, {}, 2, 2),
    # stage-0 bf16 (BF16_Optimizer, param_shapes None) -> ZeRO-1 BF16_Optimizer files
    ("pp2_dp2_bf16_z0", 2, {}, 2, 1),
    ("pp2_dp2_bf16_z0", 4, {"pp_size": 4, **UNIFORM}, 4, 1),
]


@pytest.mark.parametrize("name, world, kw, pp, dp", CASES, ids=[f"{c[0]}-w{c[1]}-pp{c[3]}" for c in CASES])
def test_resharded_pipeline_matches_truth(name, world, kw, pp, dp, tmp_path):
    fx = _fixture(name)
    before = tree_digest(fx.ckpt)
    _reshard(fx.ckpt, tmp_path / "out", world, **kw)
    _check_truth(fx, tmp_path / "out", pp, dp)
    layer_files = sorted(p.name for p in (fx.ckpt / fx.meta["tag"]).glob("layer_*"))
    assert sorted(p.name for p in (tmp_path / "out" / fx.meta["tag"]).glob("layer_*")) == layer_files
    for f in layer_files:  # layer files stay per layer, unchanged
        _same(_materialized(fx.ckpt / fx.meta["tag"] / f), _materialized(tmp_path / "out" / fx.meta["tag"] / f), f)
    assert tree_digest(fx.ckpt) == before


ZERO1 = [f for f in PIPELINE if f.meta["stage"] == 1]


@pytest.mark.parametrize("fx", ZERO1, ids=ids(ZERO1))
def test_round_trips_give_deepspeeds_files_back(fx, tmp_path):
    """Same size: every file is DeepSpeed's own. Another stage count (4, then 1) and data-parallel size, then back:
    every file again DeepSpeed's own, value for value (the per-stage files are rebuilt from the other layout)."""
    tag = fx.meta["tag"]
    world, dp = fx.meta["world_size"], fx.meta["dp_world_size"]
    _reshard(fx.ckpt, tmp_path / "same", world)
    _reshard(fx.ckpt, tmp_path / "pp4", 4 * (dp + 1), pp_size=4, **UNIFORM)
    _reshard(tmp_path / "pp4", tmp_path / "pp1", 1, pp_size=1, **UNIFORM)
    with pytest.raises(UnsupportedCheckpointError, match=r"layer 6 a function: stage 0: layers 0-3, stage 1: layers "
                       r"4-6; layer 6 a use of tied 'embed': stage 0: layers 0-3, stage 1: layers 4-6\); give the layer"):
        _reshard(tmp_path / "pp1", tmp_path / "back", world, pp_size=2, **UNIFORM)  # one stage: layer 6 unknowable
    _reshard(tmp_path / "pp1", tmp_path / "back", world, pp_size=2, partition_method="uniform",
             layer_types=LAYER_TYPES)
    for out in ("same", "back"):
        written = sorted(p.name for p in (tmp_path / out / tag).glob("*.pt"))
        assert written == sorted(p.name for p in (fx.ckpt / tag).glob("*.pt"))
        for f in written:
            _same(_materialized(fx.ckpt / tag / f), _materialized(tmp_path / out / tag / f), f"{out}/{f}")


def test_stage0_bf16_pipeline_is_read_by_its_slice_mappings_and_written_as_zero1(tmp_path):
    """A bf16 pipeline run without ZeRO (BF16_Optimizer) saves param_shapes None: its optimizer files' per-rank
    param_slice_mappings name the flat order (tied module included), the layer files give the shapes; every stored
    copy equals DeepSpeed's own values. reshard writes the same optimizer as ZeRO-1 BF16_Optimizer files (DeepSpeed
    0.19.8 cannot resume the stage-0 form): no optimizer state left in the model states, ds_config stage 1, and a
    second reshard at the same sizes gives those files back unchanged."""
    from dsckpt.assemble import read_piece
    from dsckpt.model import Kind

    fx = _fixture("pp2_dp2_bf16_z0")
    cache = FileCache()
    ckpt = read_checkpoint(fx.ckpt, cache=cache)
    assert (ckpt.zero_stage, ckpt.optimizer_wrapper, ckpt.optimizer_step) == (0, "BF16_Optimizer", 3)
    assert ckpt.pipeline.stage_group_orders == ((("tied_modules.embed.weight", "1.weight", "1.bias", "2.weight",
                                                  "2.bias"),), (("tied_modules.embed.weight", "5.weight", "5.bias"),))
    truth = fx.truth()
    checked = 0
    for e in ckpt.entries:
        low = "buffer" if e.kind is Kind.BUFFER else "lowp"
        for key, piece in (("param", e.piece(Role.MASTER)), ("exp_avg", e.state_piece("exp_avg")),
                           ("exp_avg_sq", e.state_piece("exp_avg_sq")), (low, e.piece(Role.MODULE))):
            if piece is not None:
                got = read_piece(piece, e.shape, cache, name=e.name)
                assert torch.equal(got, truth[f"{key}/{e.name}"].to(got.dtype)), (key, e.name)
                checked += 1
    assert checked == 4 * len(fx.meta["trainable"]) + 2 + 3  # frozen 4.weight/4.bias, 3 buffers
    r = CliRunner().invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "a"), "-n", "2"])
    assert r.exit_code == 0, r.output
    assert '"zero_optimization": {"stage": 1} and "data_types": {"grad_accum_dtype": "fp32"}' in r.stdout
    ms = _materialized(tmp_path / "a" / "global_step3" / "mp_rank_01_model_states.pt")
    assert ms["optimizer"] is None and ms["ds_config"]["zero_optimization"]["stage"] == 1
    assert list(ms["param_shapes"][0]) == ["tied_modules.embed.weight", "5.weight", "5.bias"]
    back = read_checkpoint(tmp_path / "a")
    assert (back.zero_stage, back.optimizer_wrapper, back.dp_world_size) == (1, "BF16_Optimizer", 1)
    _reshard(tmp_path / "a", tmp_path / "b", 2)
    for f in sorted(p.name for p in (tmp_path / "a" / "global_step3").glob("*.pt")):
        _same(_materialized(tmp_path / "a" / "global_step3" / f), _materialized(tmp_path / "b" / "global_step3" / f), f)
    with pytest.raises(UnsupportedCheckpointError, match="refuses ZeRO-2 and ZeRO-3"):
        plan_reshard(ckpt, 2, zero_stage=2)
    with pytest.raises(UnsupportedCheckpointError, match="to ZeRO stage 0: a bf16 pipeline without ZeRO trains under "
                       "BF16_Optimizer, whose stage-0 save DeepSpeed 0.19.8 cannot resume even unchanged"):
        plan_reshard(ckpt, 2, zero_stage=0)


def test_stage0_bf16_slice_mappings_that_do_not_tile_are_refused(tmp_path):
    """The flat order of a stage-0 bf16 pipeline is taken from param_slice_mappings only where they tile each flat
    group from element 0; a gap (here: rank 1's first fragment moved by one element) is refused, naming the param."""
    import shutil

    src = _fixture("pp2_dp2_bf16_z0").ckpt
    shutil.copytree(src, tmp_path / "c")
    f = tmp_path / "c" / "global_step3" / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"
    sd = torch.load(f, weights_only=False)
    first = next(iter(sd["optimizer_state_dict"]["param_slice_mappings"][0].values()))
    first.start += 1
    torch.save(sd, f)
    r = CliRunner().invoke(main, ["info", str(tmp_path / "c")])
    assert r.exit_code == 3, r.output
    assert "param_slice_mappings of group 0 put 'tied_modules.embed.weight' at flat element 53" in r.stderr


def test_pipeline_record_tp_rank_is_pure_file_arithmetic():
    """PipelineRecord.tp_rank(t): stage s's model states are model-parallel rank s * tp + t, the layer files those
    of TP rank t; a record without TP is its own TP rank 0."""
    from dsckpt.parallel_layout import PipelineRecord

    tag = Path("/x/global_step1")
    mp = tuple(tag / f"mp_rank_{m:02d}_model_states.pt" for m in range(6))
    layers = tuple(tag / f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(3) for t in range(3))
    rec = PipelineRecord((), ((("a",),), (("b",),)), mp[0::3], layers, tp_size=3, mp_model_files=mp)
    one = rec.tp_rank(2)
    assert [p.name for p in one.stage_model_files] == ["mp_rank_02_model_states.pt", "mp_rank_05_model_states.pt"]
    assert [p.name for p in one.layer_files] == [f"layer_{i:02d}-model_02-model_states.pt" for i in range(3)]
    assert one.tp_size == 1 and one.stage_group_orders == rec.stage_group_orders
    plain = PipelineRecord((), ((("a",),),), mp[:1], layers[:1])
    assert plain.tp_rank(0) is plain


Z0 = Path(__file__).parent / "fixtures" / "pp2_fp32_z0"
EMBED = {0: "embed"}  # the fixture's TiedLayerSpec key, which no file of DeepSpeed's own stage-0 save states


def test_ds_stage0_pipeline_is_bound_by_shape_and_order():
    """DeepSpeed's own fp32 pipeline save without ZeRO names no param of its stages' torch optimizers: each stage's
    states are bound to the layer files' params by shape and module order (the tied module first on both stages, the
    frozen Linear absent), proven (no other cut of the layers fits), and every moment, module weight and step equals
    the recorded truth. The tied module's key is in no file: read with the key it is named by it, else by a stand-in
    key, noted, and reshard refuses to write that name, asking for --tied-key."""
    from dsckpt.assemble import read_piece
    from dsckpt.model import Kind
    from dsckpt.readers.pipeline import BOUND_NOTE, unkeyed_note

    fx = _fixture("pp2_fp32_z0")
    cache = FileCache()
    ckpt = read_checkpoint(fx.ckpt, cache=cache, tied_keys=EMBED)
    assert (ckpt.zero_stage, ckpt.optimizer_wrapper, ckpt.optimizer_step) == (0, "torch optimizer", 3)
    assert ckpt.pipeline.stage_group_orders == ((("tied_modules.embed.weight", "1.weight", "1.bias", "2.weight",
                                                  "2.bias"),), (("tied_modules.embed.weight", "5.weight", "5.bias"),))
    assert ckpt.notes == (BOUND_NOTE,) and ckpt.pipeline.unkeyed_tied == ()
    assert sorted(e.name for e in ckpt.params if not e.trainable) == sorted(fx.meta["frozen"])
    truth = fx.truth()
    checked = 0
    for e in ckpt.entries:
        for key, piece in (("param" if e.kind is Kind.PARAM else "buffer", e.piece(Role.MODULE)),
                           ("exp_avg", e.state_piece("exp_avg")), ("exp_avg_sq", e.state_piece("exp_avg_sq"))):
            if piece is not None:
                got = read_piece(piece, e.shape, cache, name=e.name)
                assert torch.equal(got, truth[f"{key}/{e.name}"].to(got.dtype)), (key, e.name)
                checked += 1
    assert checked == 3 * len(fx.meta["trainable"]) + 2 + 3  # frozen 4.weight/4.bias, 3 buffers
    # the tied module's copies on stage 1 are replicas of stage 0's, which must equal them
    assert len({p.replica for p in ckpt.entry("tied_modules.embed.weight").pieces}) == 2
    unkeyed = read_checkpoint(fx.ckpt)
    assert unkeyed.pipeline.stage_group_orders[1][0][0] == "tied_modules.layer_00.weight"
    assert unkeyed.pipeline.unkeyed_tied == (0,) and unkeyed_note(0) in unkeyed.notes
    r = CliRunner().invoke(main, ["reshard", str(fx.ckpt), "/nonexistent/out", "-n", "2"])
    assert r.exit_code == 3, r.output
    assert "tied module(s) in layer_00-model_states.pt whose TiedLayerSpec key no file states" in r.stderr
    assert "give it with --tied-key 0=KEY" in r.stderr
    r = CliRunner().invoke(main, ["reshard", str(fx.ckpt), "/nonexistent/out", "-n", "2", "--tied-key", "5=embed"])
    assert r.exit_code == 2 and "--tied-key names layer(s) [5]" in r.stderr and "(its tied modules: layer 0)" in r.stderr


Z0_SOURCE = [  # DeepSpeed's own stage-0 save -> (--world-size, options, stages, data-parallel size, ZeRO stage)
    (4, {"pp_size": 4, **UNIFORM}, 4, 1, 0),
    (2, {"pp_size": 1, **UNIFORM}, 1, 2, 0),
    (2, {}, 2, 1, 0),
    (4, {"zero_stage": 1}, 2, 2, 1),
    (4, {"zero_stage": 1, "pp_size": 4, **UNIFORM}, 4, 1, 1),
]


@pytest.mark.parametrize("world, kw, pp, dp, stage", Z0_SOURCE, ids=[f"pp{c[2]}xdp{c[3]}-z{c[4]}" for c in Z0_SOURCE])
def test_ds_stage0_pipeline_resharded_matches_truth(world, kw, pp, dp, stage, tmp_path):
    """DeepSpeed's own fp32 stage-0 pipeline save resharded (--tied-key 0=embed) to 4 x 1 and 1 x 2 stages x ranks at
    stage 0, and to ZeRO-1: every fp32 master (at stage 0 the module weight) and Adam moment equals the recorded truth
    bit for bit, every optimizer state's step is the saved one, the frozen params stay frozen, the layer files are
    unchanged and the input too."""
    fx = _fixture("pp2_fp32_z0")
    before = tree_digest(fx.ckpt)
    out = tmp_path / "out"
    _reshard(fx.ckpt, out, world, tied_keys=EMBED, **kw)
    new = _check_truth(fx, out, pp, dp)
    assert new.zero_stage == stage
    assert sorted(e.name for e in new.params if not e.trainable) == sorted(fx.meta["frozen"])
    tag = fx.meta["tag"]
    steps = []
    for f in sorted((out / tag).glob("*.pt")):
        if f.name.startswith("mp_rank_") and stage == 0:
            steps += [st["step"] for st in _materialized(f)["optimizer"]["state"].values()]
        elif "optim_states" in f.name:
            steps += [st["step"] for st in _materialized(f)["optimizer_state_dict"]["base_optimizer_state"][
                "state"].values()]
    assert len(steps) >= pp and {float(x) for x in steps} == {float(fx.meta["optimizer_step"][0])}
    for f in sorted(p.name for p in (fx.ckpt / tag).glob("layer_*")):
        _same(_materialized(fx.ckpt / tag / f), _materialized(out / tag / f), f)
    assert tree_digest(fx.ckpt) == before


def test_ds_stage0_pipeline_ambiguous_or_unfit_binding_is_refused(tmp_path):
    """Hand-edited copies (malformed inputs): stage 0's optimizer without its last state leaves three [7] params
    (1.bias, 2.weight, 2.bias) for two states in module order, so which one is frozen is open -- refused as
    ambiguous, naming each state's candidates, as the dense stage-0 reader refuses it --; a state whose shape no param of its stage has fits no cut
    of the layers at all."""
    import shutil

    from dsckpt.binding import AmbiguousBindingError

    fx = _fixture("pp2_fp32_z0")
    for case in ("ambiguous", "unfit"):
        shutil.copytree(fx.ckpt, tmp_path / case)
    f = tmp_path / "ambiguous" / "global_step3" / "mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=False)
    del sd["optimizer"]["state"][4]
    sd["optimizer"]["param_groups"][0]["params"].remove(4)
    torch.save(sd, f)
    with pytest.raises(AmbiguousBindingError) as e:
        read_checkpoint(tmp_path / "ambiguous", tied_keys=EMBED)
    msg = str(e.value)
    assert "more than one binding fits: cannot tell which params own 2 stored optimizer state tensor(s)" in msg
    assert ("stage 0 optimizer.state[2] fits 1.bias or 2.weight; stage 0 optimizer.state[3] fits 2.bias or 2.weight"
            in msg and "dsckpt does not guess" in msg)
    r = CliRunner().invoke(main, ["info", str(tmp_path / "ambiguous")])
    assert r.exit_code == 3 and "more than one binding fits" in r.stderr
    f = tmp_path / "unfit" / "global_step3" / "mp_rank_01_model_states.pt"
    sd = torch.load(f, weights_only=False)
    sd["optimizer"]["state"][1]["exp_avg"] = sd["optimizer"]["state"][1]["exp_avg_sq"] = torch.zeros(3, 10)
    torch.save(sd, f)
    with pytest.raises(UnsupportedCheckpointError, match="fit no cut of its layer files into the stages"):
        read_checkpoint(tmp_path / "unfit")


# ---------------------------------------------------------------------------------------------- fp32 targets at stage 0

DS_Z0 = Path(__file__).parent / "fixtures" / "pp2_fp32_z0" / "ckpt" / "global_step3"  # DeepSpeed's own stage-0 save
Z0_CASES = [  # (fixture, --world-size, options, stages, data-parallel size, the stage boundaries, written out)
    ("pp2_dp2_fp32", 4, {}, 2, 2, (0, 4, 7)),
    ("pp2_fp32", 2, {}, 2, 1, (0, 4, 7)),
    ("pp2_dp2_fp32", 4, {"pp_size": 4, **UNIFORM}, 4, 1, (0, 2, 4, 6, 7)),
    ("pp2_fp32", 3, {"pp_size": 1, **UNIFORM}, 1, 3, (0, 7)),
]


def _stage_params(meta: dict, parts: tuple[int, ...], s: int) -> list[str]:
    """The params stage ``s``'s optimizer holds in a run that passes ``[p for p in model.parameters() if
    p.requires_grad]`` (as DeepSpeed's own stage-0 save pp2_fp32_z0 and the live check do): the stage's params that
    require grad in ``PipelineModule.parameters()`` order, the tied module first on every stage with a use of it
    (layers 0 and 6), then its layers' own."""
    lo, hi = parts[s], parts[s + 1]
    tied = [n for n in meta["trainable"] if n.startswith("tied_modules.")] if lo == 0 or lo <= 6 < hi else []
    return tied + [n for n in meta["trainable"] if n.split(".")[0].isdigit() and lo <= int(n.split(".")[0]) < hi]


@pytest.mark.parametrize("name, world, kw, pp, dp, parts", Z0_CASES, ids=[f"{c[0]}-w{c[1]}-pp{c[3]}" for c in Z0_CASES])
def test_fp32_pipeline_written_without_zero(name, world, kw, pp, dp, parts, tmp_path):
    """An fp32 ZeRO-1 pipeline run written at stage 0 (stages kept or changed): per stage DeepSpeed's own
    mp_rank_XX_model_states.pt (pp2_fp32_z0's keys in its order, module None, ds_config stage 0) holding the stage's
    torch optimizer state dict -- the same group hyper-parameters, params numbered over the stage's trainable params
    in module order, each state's moments and step the recorded truth of the param at that index --, plus
    param_shapes naming them; the layer files unchanged; and dsckpt reads it back equal to the truth."""
    from dsckpt.ds_writers.stage0 import PIPELINE_NOTE

    fx = _fixture(name)
    before = tree_digest(fx.ckpt)
    out = tmp_path / "out"
    plan, _ = _reshard(fx.ckpt, out, world, zero_stage=0, **kw)
    assert PIPELINE_NOTE in plan.notes
    new = _check_truth(fx, out, pp, dp)
    assert (new.zero_stage, new.optimizer_wrapper) == (0, "torch optimizer")
    frozen = sorted(e.name for e in new.entries if e.kind.value == "param" and not e.trainable)
    assert frozen == sorted(fx.meta["frozen"])
    tag, truth = fx.meta["tag"], fx.truth()
    ds = [_materialized(DS_Z0 / f"mp_rank_{s:02d}_model_states.pt") for s in (0, 1)]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in ds[0]["optimizer"]["param_groups"]]
    for s in range(pp):
        ms = _materialized(out / tag / f"mp_rank_{s:02d}_model_states.pt")
        assert list(ms) == list(ds[0]) and ms["module"] is None and ms["param_shapes"] is not None
        assert (ms["dp_world_size"], ms["mp_world_size"], ms["ds_config"]["zero_optimization"]) == (dp, pp,
                                                                                                    {"stage": 0})
        order = _stage_params(fx.meta, parts, s)
        assert [list(g) for g in ms["param_shapes"]] == [order]
        opt = ms["optimizer"]
        assert [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]] == hyper
        assert opt["param_groups"][0]["params"] == list(range(len(order))) and sorted(opt["state"]) == opt[
            "param_groups"][0]["params"]
        for k, n in enumerate(order):
            st, like = opt["state"][k], ds[0]["optimizer"]["state"][0]
            assert list(st) == list(like) and st["step"].dtype == like["step"].dtype, (s, k)
            assert float(st["step"]) == fx.meta["optimizer_step"][0]
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[key], truth[f"{key}/{n}"]), (s, k, n, key)
    layer_files = sorted(p.name for p in (fx.ckpt / tag).glob("layer_*"))
    assert sorted(p.name for p in (out / tag).glob("layer_*")) == layer_files
    for f in layer_files:
        _same(_materialized(fx.ckpt / tag / f), _materialized(out / tag / f), f)
    assert tree_digest(fx.ckpt) == before


def test_stage0_pipeline_files_round_trip(tmp_path):
    """dsckpt's stage-0 pipeline files are read back through their param_shapes and resharded: written again at
    ZeRO-1 and the same sizes they give DeepSpeed's own files back, value for value (no clip_grad, which no stage-0
    file stores); at stage 0, 4 stages -> 2 gives
    what 2 stages at stage 0 written directly are; another data-parallel size keeps them, dp_world_size aside."""
    fx = _fixture("pp2_dp2_fp32")
    tag = fx.meta["tag"]
    _reshard(fx.ckpt, tmp_path / "z0", 4, zero_stage=0)
    _reshard(tmp_path / "z0", tmp_path / "z1", 4, zero_stage=1)
    _reshard(fx.ckpt, tmp_path / "z0pp4", 4, zero_stage=0, pp_size=4, **UNIFORM)
    _reshard(tmp_path / "z0pp4", tmp_path / "z0pp2", 4, pp_size=2, **UNIFORM)
    _reshard(tmp_path / "z0", tmp_path / "z0dp1", 2)
    for a, b in (("", "z1"), ("z0", "z0pp2"), ("z0", "z0dp1")):
        left = fx.ckpt / tag if not a else tmp_path / a / tag
        written = sorted(p.name for p in (tmp_path / b / tag).glob("*.pt"))
        assert written == sorted(p.name for p in left.glob("*.pt")), (a, b)
        for f in written:
            want, got = _materialized(left / f), _materialized(tmp_path / b / tag / f)
            if b == "z0dp1" and f.startswith("mp_rank_"):
                assert (want["dp_world_size"], got["dp_world_size"]) == (2, 1)
                want["dp_world_size"] = got["dp_world_size"] = None
                want["ds_config"] = got["ds_config"] = None  # train_batch_size recorded as saved
            if b == "z1" and "optim_states" in f:  # a stage-0 save stores no clip_grad: the engine keeps its own
                assert "clip_grad" not in got["optimizer_state_dict"]
                del want["optimizer_state_dict"]["clip_grad"]
            _same(want, got, f"{b}/{f}")


def test_stage0_pipeline_files_must_name_their_params(tmp_path):
    """param_shapes on some stages only is refused (DeepSpeed's own stage-0 save names none); param_shapes that do not
    fit the layer files or the optimizer's groups are refused as damaged (hand-edited copies: malformed inputs)."""
    import shutil

    from dsckpt.errors import CorruptCheckpointError

    fx = _fixture("pp2_dp2_fp32")
    _reshard(fx.ckpt, tmp_path / "z0", 4, zero_stage=0)
    f = tmp_path / "z0" / "global_step3" / "mp_rank_01_model_states.pt"
    ms = torch.load(f, weights_only=False)
    for case, shapes, match in (
            ("unnamed", None, r"stages disagree: stage\(s\) \[0, 1\] of \[0, 1\] hold a torch optimizer state in "
                              r"mp_rank_XX_model_states.pt, stage\(s\) \[0\] name its params"),
            ("swapped", [dict(reversed(list(ms["param_shapes"][0].items())))],
             r"param_shapes\[0\] names '5.bias' \[6\] \(optimizer.state\[0\] \[11, 6\]\)"),
            ("short", [dict(list(ms["param_shapes"][0].items())[:2])], "group 0 holds 3 params and param_shapes")):
        shutil.copytree(tmp_path / "z0", tmp_path / case)
        torch.save({**ms, "param_shapes": shapes}, tmp_path / case / "global_step3" / f.name)
        with pytest.raises(CorruptCheckpointError, match=match):
            read_checkpoint(tmp_path / case)


def test_stage0_pipeline_files_without_names_bind_to_the_same_names(tmp_path):
    """dsckpt's stage-0 pipeline files at 4 stages x 2 ranks (tied module on stages 0 and 3, a ReLU and a frozen Linear
    between cuts) with param_shapes removed from every stage -- DeepSpeed's own layout -- bind to exactly what their
    param_shapes named: the same stage orders, frozen params and stored pieces."""
    import shutil

    fx = _fixture("pp2_dp2_fp32")
    _reshard(fx.ckpt, tmp_path / "z0", 8, zero_stage=0, pp_size=4, **UNIFORM)
    shutil.copytree(tmp_path / "z0", tmp_path / "bare")
    for f in (tmp_path / "bare" / "global_step3").glob("mp_rank_*"):
        torch.save({**torch.load(f, weights_only=False), "param_shapes": None}, f)
    named, bound = read_checkpoint(tmp_path / "z0"), read_checkpoint(tmp_path / "bare", tied_keys=EMBED)
    assert bound.pipeline.stage_group_orders == named.pipeline.stage_group_orders
    assert named.pipeline.stage_group_orders[3] == (("tied_modules.embed.weight",),)

    def pieces(ckpt):
        return {e.name: (e.trainable, [(p.role, p.state_key, p.replica, [(f.file.name, f.key) for f in p.fragments])
                                       for p in e.pieces]) for e in ckpt.entries}

    assert pieces(bound) == pieces(named)


def _adam(*shapes):
    """A torch Adam state_dict whose states have ``shapes`` (params 0..n-1, one group); tensors as unread refs."""
    import math

    from dsckpt.tensor_ref import StorageRef, TensorRef

    def ref(k, shape):
        return TensorRef(StorageRef(Path("f.pt"), str(k), "float32", math.prod(shape), 0, "cpu"), 0, shape,
                         tuple(math.prod(shape[i + 1:]) for i in range(len(shape))))

    return {"param_groups": [{"params": list(range(len(shapes)))}],
            "state": {k: {"step": 3, "exp_avg": ref(k, sh), "exp_avg_sq": ref(k, sh)} for k, sh in enumerate(shapes)}}


def test_binding_puts_a_tied_module_first_and_keeps_its_frozen_params_frozen_everywhere():
    """Pure: a tied module in layer 1 (its bias frozen) is first in stage 0's optimizer, before layer 0's params, and
    first again on stage 1 beside layer 2: the one reading that fits; its bias frozen on both stages (a reading with
    it trainable on stage 1 only is no reading). Without the first stage's states in that order nothing fits."""
    from dsckpt.readers.pipeline_binding import LayerParams, bind_stage_optimizers

    layers = [LayerParams(0, (("weight", (4, 3)), ("bias", (4,)))), LayerParams(1, (("weight", (5, 4)), ("bias", (5,)))),
              LayerParams(2, (("weight", (3, 5)), ("bias", (3,))))]
    files = [Path("mp_rank_00_model_states.pt"), Path("mp_rank_01_model_states.pt")]
    got = bind_stage_optimizers([_adam((5, 4), (4, 3), (4,)), _adam((5, 4), (3, 5), (3,))], layers,
                                model_files=files, tag_dir=Path("t"), tied_keys={1: "head"})
    assert [[list(g) for g in st] for st in got.param_shapes] == [
        [["tied_modules.head.weight", "0.weight", "0.bias"]], [["tied_modules.head.weight", "2.weight", "2.bias"]]]
    assert got.renames == {"1.weight": "tied_modules.head.weight", "1.bias": "tied_modules.head.bias"}
    assert got.unkeyed == ()
    with pytest.raises(UnsupportedCheckpointError, match="fit no cut of its layer files into the stages"):
        bind_stage_optimizers([_adam((4, 3), (5, 4), (4,)), _adam((5, 4), (3, 5), (3,))], layers, model_files=files,
                              tag_dir=Path("t"))


def test_pipeline_targets_at_zero2_refused_naming_why():
    with pytest.raises(UnsupportedCheckpointError, match="to ZeRO stage 2: DeepSpeed's PipelineEngine refuses ZeRO-2"):
        plan_reshard(read_checkpoint(_fixture("pp2_fp32").ckpt), 2, zero_stage=2)


def test_cli_pipeline_reshard(tmp_path):
    fx = _fixture("pp2_fp32")
    runner = CliRunner()
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "o"), "-n", "4", "--pp-size", "4",
                             "--partition-method", "uniform", "--num-layers", "7", "--dry-run"])
    assert r.exit_code == 1, r.output
    assert "pipeline stages 2 -> 4 (partition_method 'uniform', 7 layers): stage 0: layers 0-1" in r.stdout
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "o"), "-n", "4", "--pp-size", "4",
                             "--partition-method", "parameters", "--num-layers", "7"])
    assert r.exit_code == 3 and "does not give the source's 2 stages" in r.stderr
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "o"), "-n", "4"])
    assert r.exit_code == 0, r.output
    assert "from 2 to 4 ranks (PP 2 x DP 1 -> PP 2 x DP 2)" in r.stdout


UNIVERSAL = [f for f in PIPELINE if (f.dir / "universal.json").exists()]


@pytest.mark.parametrize("fx", UNIVERSAL, ids=ids(UNIVERSAL))
def test_universal_matches_recorded_ds_to_universal(fx, tmp_path):
    """``reshard --universal`` of a pipeline run writes what DeepSpeed's ``ds_to_universal --inject_missing_state``
    wrote for it (recorded by tests/fixtures/record_pipeline_universal.py): the same files, and in every
    ``zero/<param>/<state>.pt`` the same keys and the same values bit for bit."""
    import json

    from safetensors.torch import load_file

    from dsckpt.cli import main as cli

    rec = json.loads((fx.dir / "universal.json").read_text())
    assert rec["rc"] == 0, rec
    r = CliRunner().invoke(cli, ["reshard", str(fx.ckpt), str(tmp_path / "u"), "--universal", "-q"])
    assert r.exit_code == 0, r.output
    folder = tmp_path / "u" / f"{fx.meta['tag']}_universal"
    written = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert written == rec["files"]
    want = load_file(str(fx.dir / "universal_truth.safetensors"))
    for key, t in want.items():
        state, param = key.split("/", 1)
        got = torch.load(folder / "zero" / param / f"{state}.pt", weights_only=False)
        assert {k: repr(v) for k, v in got.items() if k != "param"} == rec["extra_keys"][key], key
        assert got["param"].dtype == t.dtype and torch.equal(got["param"], t), key
    for param, step in rec["step"].items():
        assert float(torch.load(folder / "zero" / param / "step.pt", weights_only=False)) == step


# ---------------------------------------------------------------------------------------------- live: real loads

def _tamper(out: Path, name: str = "zero_pp_rank_0_mp_rank_01_optim_states.pt") -> str:
    """One fp32 master element of file ``name`` (stage 1's first rank; a TP run's model-parallel rank 1) changed;
    returns the param it belongs to (the first of the flat group that rank's partition starts in)."""
    (f,) = (out / "global_step3").glob(name)
    sd = torch.load(f, weights_only=False)
    sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][0] += 1.0
    torch.save(sd, f)
    mappings = sd["optimizer_state_dict"]["param_slice_mappings"][0]
    return next(n for n, a in mappings.items() if a.start == 0)


def _tamper_stage0(out: Path) -> str:
    """One Adam first-moment element of stage 1's first param changed in a stage-0 output; returns that param."""
    f = out / "global_step3" / "mp_rank_01_model_states.pt"
    sd = torch.load(f, weights_only=False)
    sd["optimizer"]["state"][0]["exp_avg"].view(-1)[0] += 1.0
    torch.save(sd, f)
    return next(iter(sd["param_shapes"][0]))


@pytest.mark.live
@pytest.mark.deepspeed
def test_deepspeed_pipeline_engine_loads_resharded_outputs(tmp_path):
    """One 4-rank launch: DeepSpeed's PipelineEngine loads with plain load_checkpoint() what reshard wrote for
    2 stages x 2 DP -> 4 stages, -> 1 stage x 4 DP, 2 stages x 1 DP -> 2 x 2 (fp32, bf16 ZeRO-1, bf16
    BF16_Optimizer), a stage-0 bf16 run (BF16_Optimizer) written as ZeRO-1 BF16_Optimizer files at 2 x 2 and 1 x 4,
    DeepSpeed's own fp32 stage-0 pipeline save at DP 1 -> 2 unchanged (no rewrite needed) and resharded (its states
    bound by shape and order) to 4 x 1 at stage 0 and to ZeRO-1 at 2 x 2,
    an fp32 ZeRO-1 run written without ZeRO (2 x 2 -> 2 x 2, 4 x 1, 1 x 4, loaded at stage 0), and the Megatron-style
    tensor x pipeline fixtures (with frozen params too) at PP 2 x TP 2 x DP 1 -> PP 1 x TP 2 x DP 2 (the fp32 one also
    written without ZeRO, and so at PP 2 x TP 2 x DP 1; their TP-local slices): masters, moments, steps, global steps
    bit for bit, and one more train_batch runs. Three tampered controls fail. DeepSpeed's own route (ds_to_universal +
    load_universal at 4 stages) is loaded beside them, and so are reshard --universal folders of runs without ZeRO
    (which ds_to_universal does not read): the stage-0 bf16 run (BF16_Optimizer, loaded at ZeRO-1 with fp32 gradient
    accumulation at 1 stage x 4 DP: a BF16_Optimizer engine of 4 stages x 1 DP hung in DeepSpeed 0.19.8 loading any
    universal folder here, one from the ZeRO-1 pp2_dp2_bf16 too) and the fp32 run written without ZeRO (at 4
    stages)."""
    import subprocess
    import sys

    from ds_launch import DEEPSPEED, passed_except_controls, run_check_script

    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    cases = [("pp2_dp2_fp32", 4, {"pp_size": 4, **UNIFORM}), ("pp2_dp2_fp32", 1, {"pp_size": 1, **UNIFORM}),
             ("pp2_fp32", 2, {}), ("pp2_dp2_bf16", 4, {"pp_size": 4, **UNIFORM})]
    known = {f.name for f in PIPELINE}
    pairs = []
    for name, pp, kw in cases:
        if name in known:
            out = tmp_path / f"{name}_pp{pp}"
            _reshard(_fixture(name).ckpt, out, 4, **kw)
            pairs.append(f"{name}@pp{pp}={out}")
    for pp, kw in ((2, {}), (1, {"pp_size": 1, **UNIFORM})):
        if "pp2_dp2_bf16_z0" in known:  # loaded at ZeRO-1 with fp32 gradient accumulation (@z1)
            out = tmp_path / f"bf16_z0_pp{pp}"
            _reshard(_fixture("pp2_dp2_bf16_z0").ckpt, out, 4, **kw)
            pairs.append(f"pp2_dp2_bf16_z0@pp{pp}@z1={out}")
    # DeepSpeed's own fp32 stage-0 pipeline save loads unchanged at DP 1 -> 2; resharded (its states bound by shape
    # and order, the tied key given) to 4 stages at stage 0 and to ZeRO-1 at 2 x 2
    pairs.append(f"pp2_fp32_z0@pp2={Z0 / 'ckpt'}")
    for pp, kw in ((4, {"pp_size": 4, **UNIFORM}), (2, {"zero_stage": 1})):
        out = tmp_path / f"ds_z0_pp{pp}"
        _reshard(Z0 / "ckpt", out, 4, tied_keys=EMBED, **kw)
        pairs.append(f"pp2_fp32_z0@pp{pp}@{'z1' if kw.get('zero_stage') else 'z0'}={out}")
    for pp, kw in ((2, {}), (4, {"pp_size": 4, **UNIFORM}), (1, {"pp_size": 1, **UNIFORM})):
        out = tmp_path / f"fp32_z0_pp{pp}"  # an fp32 ZeRO-1 run written without ZeRO, loaded at stage 0 (@z0)
        _reshard(_fixture("pp2_dp2_fp32").ckpt, out, 4, zero_stage=0, **kw)
        pairs.append(f"pp2_dp2_fp32@pp{pp}@z0={out}")
    megatron = Path(__file__).parent / "fixtures" / "tp_pipeline"
    typed = {"pp_size": 1, "partition_method": "type:BlockPipe",
             "layer_types": ["EmbeddingPipe[embed]", "BlockPipe", "BlockPipe", "FinalLayerNorm", "EmbeddingPipe[embed]"]}
    for name in ("megatron_pp2_tp2_z1_fp32", "megatron_pp2_tp2_z1_bf16_bf16opt", "megatron_pp2_tp2_z1_bf16_bf16opt_frozen"):
        out = tmp_path / f"{name}_pp1"
        _reshard(megatron / name / "ckpt", out, 4, **typed)
        pairs.append(f"tp_pipeline/{name}@pp1={out}")
    for pp, kw in ((2, {}), (1, typed)):  # fp32 tensor x pipeline written without ZeRO, loaded at stage 0
        out = tmp_path / f"megatron_z0_pp{pp}"
        _reshard(megatron / "megatron_pp2_tp2_z1_fp32" / "ckpt", out, 4, zero_stage=0, **kw)
        pairs.append(f"tp_pipeline/megatron_pp2_tp2_z1_fp32@pp{pp}@z0={out}")
    _reshard(_fixture("pp2_dp2_fp32").ckpt, tmp_path / "tampered", 4, pp_size=4, **UNIFORM)
    tampered = _tamper(tmp_path / "tampered")
    pairs.append(f"pp2_dp2_fp32@pp4={tmp_path / 'tampered'}")
    _reshard(megatron / "megatron_pp2_tp2_z1_fp32" / "ckpt", tmp_path / "tp_tampered", 4, **typed)
    tp_tampered = _tamper(tmp_path / "tp_tampered", "zero_pp_rank_1_mp_rank_01_optim_states.pt")
    pairs.append(f"tp_pipeline/megatron_pp2_tp2_z1_fp32@pp1={tmp_path / 'tp_tampered'}")
    _reshard(_fixture("pp2_dp2_fp32").ckpt, tmp_path / "z0_tampered", 4, zero_stage=0, pp_size=4, **UNIFORM)
    z0_tampered = _tamper_stage0(tmp_path / "z0_tampered")
    pairs.append(f"pp2_dp2_fp32@pp4@z0={tmp_path / 'z0_tampered'}")
    src = _fixture("pp2_dp2_fp32").ckpt
    r = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                        str(src / "global_step3"), "--output_folder", str(tmp_path / "ds_univ" / "global_step3"),
                        "--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state"],
                       capture_output=True, text=True,
                       env={**__import__("os").environ, "DS_ACCELERATOR": "cpu"}, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    (tmp_path / "ds_univ" / "latest_universal").write_text("global_step3")
    pairs.append(f"pp2_dp2_fp32@pp4@universal={tmp_path / 'ds_univ'}")
    for label, z0 in (("pp2_dp2_bf16_z0@pp1@z1@universal", _fixture("pp2_dp2_bf16_z0").ckpt),
                      ("pp2_dp2_fp32@pp4@universal", tmp_path / "fp32_z0_pp2")):  # no ZeRO: --universal of it
        out = tmp_path / f"{z0.parent.name if z0.name == 'ckpt' else z0.name}_universal"
        r = CliRunner().invoke(main, ["reshard", str(z0), str(out), "--universal", "-q"])
        assert r.exit_code == 0, r.output
        pairs.append(f"{label}={out}")
    rc, results, log = run_check_script("ds_pipeline_reshard_check.py", pairs, world=4, cwd=tmp_path, timeout=1200)
    results, controls = passed_except_controls(results, log)
    assert len(results) == len(pairs) - 3 and rc == 1, log
    assert len(controls) == 3 and f"param of {tampered} differs" in str(controls[0]["problems"]), controls
    assert f"TP rank 1: param of {tp_tampered} differs" in str(controls[1]["problems"]), controls
    assert controls[2]["problems"] == [f"rank 1: stage 1: exp_avg of {z0_tampered} differs from the truth"], controls
