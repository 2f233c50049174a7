"""dsckpt reshard --dtype fp32|fp16|bf16 (issue 39 item 5): a run's precision changed, on real DeepSpeed 0.19.8
fixtures of every ZeRO layout and source precision. The output is read back with dsckpt's reader: masters and
every moment equal the source's bit for bit (and the fixture's truth), 16-bit copies equal the masters cast
(round to nearest even, as DeepSpeed's ``.to(dtype)``), frozen params their one stored copy cast, floating buffers
fp32; file names, wrapper, loss scaler and recorded config as a DeepSpeed engine of that precision keeps them
(ds_writers/precision.py cites where). Refusals by name. Live: tests/ds_reshard_check.py --dtype loads them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import FIXTURES, tree_digest

from dsckpt import safe_load
from dsckpt.assemble import read_piece
from dsckpt.cli import main
from dsckpt.ds_writers.precision import PrecisionTarget, retype_tree
from dsckpt.errors import UsageError
from dsckpt.model import Kind, Precision, Role
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.reshard import describe_plan, plan_reshard, read_source_facts, run_reshard

_FP16_SCALER = dict(safe_load.load(
    FIXTURES / "s2_fp16_w2_cpuforced" / "ckpt" / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")[
    "optimizer_state_dict"]["loss_scaler"].__dict__, cur_iter=0)
assert _FP16_SCALER["cur_scale"] == 256 and _FP16_SCALER["last_overflow_iter"] == -1  # as recorded at generation
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _reshard(fixture: str, out: Path, world: int, dtype: str | None, stage: int | None = None,
             loss_scale: float | None = None):
    cache = FileCache()
    ckpt = read_checkpoint(FIXTURES / fixture / "ckpt", cache=cache)
    plan = plan_reshard(ckpt, world, zero_stage=stage, facts=read_source_facts(ckpt, cache), dtype=dtype,
                        loss_scale=loss_scale)
    return ckpt, cache, plan, run_reshard(plan, out, cache=cache, verify="full")


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

def _assert_master_and_moments_are_truth(e, cache: FileCache, truth) -> torch.Tensor:
    """``e``'s fp32 master and both Adam moments in the written checkpoint equal the fixture's recorded truth, bit
    for bit (a precision change keeps them exactly). Returns the master."""
    master = read_piece(e.piece(Role.MASTER), e.shape, cache, name=e.name)
    assert master.dtype == torch.float32
    assert _bytes(master) == _bytes(truth[f"param/{e.name}"]), e.name
    for key in ("exp_avg", "exp_avg_sq"):
        got = read_piece(e.state_piece(key), e.shape, cache, name=e.name)
        assert _bytes(got) == _bytes(truth[f"{key}/{e.name}"]), (e.name, key)
    return master



# (fixture, world size, target ZeRO stage or None, target dtype)
CASES = [
    ("s1_fp32_w2", 2, None, "bf16"),
    ("s1_fp32_w2", 3, None, "fp16"),
    ("s2_bf16_w2_2groups", 2, None, "fp32"),
    ("s2_bf16_w2_2groups", 1, 3, "fp16"),
    ("s3_bf16_w3_subgroups", 2, None, "fp32"),
    ("s3_bf16_w3_subgroups", 2, 1, "fp16"),
    ("s2_fp16_w2_cpuforced", 2, None, "bf16"),
    ("s2_fp16_w2_cpuforced", 3, 3, "fp32"),
    ("s3_fp16_w2_cpuforced", 3, None, "bf16"),
    ("s3_fp16_w2_cpuforced", 2, 2, "fp32"),
    ("s1_bf16_w2_bf16opt", 2, None, "fp16"),
    ("s1_bf16_w2_bf16opt", 2, None, "fp32"),
    ("s0_bf16_w2", 2, 1, "fp32"),
    ("s0_fp32_w1", 2, 2, "bf16"),
    ("s0_fp32_w1", 1, 3, "fp16"),
    # DeepSpeed 0.16.9's stage-0 bf16 save (BF16_Optimizer files, its config saying stage 0) as ZeRO-1 fp32
    ("ds0169_s0_bf16_w2", 2, None, "fp32"),
    # a DeepSpeed universal folder (ds_to_universal of s2_bf16_w2_2groups) written as native fp16 files
    ("universal/s2_bf16_w2_2groups", 3, None, "fp16"),
    # native MoE: the expert files' params cast from their masters (test_moe_expert_files_recast checks each file)
    ("moe_s2_bf16_w2_ep2", 2, None, "fp32"),
    ("moe_s2_fp32_w2_ep1", 2, None, "bf16"),
    ("moe_s1_bf16_w2_ep2_bf16opt", 2, None, "fp16"),
    ("moe_s1_bf16_w4_ep2", 2, None, "fp32"),
    ("moe_s0_fp32_w2_ep2", 2, 1, "bf16"),
    # AutoEP at ZeRO-3 (no expert files; ZeRO-1/2 targets refused: their expert files hold fused slices)
    ("autoep/autoep_qwen3_z3_fp32_ep2_dp2", 4, None, "bf16"),
    ("autoep/autoep_qwen3_z3_bf16_ep2_dp1", 2, None, "fp32"),
]


@pytest.mark.parametrize("fixture,world,stage,dtype", CASES, ids=[f"{f}-n{w}-s{s}-{d}" for f, w, s, d in CASES])
def test_dtype_change_keeps_masters_and_moments_and_casts_16bit(fixture, world, stage, dtype, tmp_path):
    before = tree_digest(FIXTURES / fixture / "ckpt")
    src, src_cache, plan, result = _reshard(fixture, tmp_path / "out", world, dtype, stage)
    assert tree_digest(FIXTURES / fixture / "ckpt") == before
    assert result.verified_tensors > 0
    new_cache = FileCache()
    new = read_checkpoint(tmp_path / "out", cache=new_cache)
    want_stage = src.zero_stage if stage is None else stage
    if src.optimizer_wrapper == "BF16_Optimizer" and stage is None:
        want_stage = 1
    assert (new.precision.value, new.zero_stage, new.dp_world_size) == (dtype, want_stage, world)
    # the wrapper DeepSpeed builds for this precision by default (engine.py _do_optimizer_sanity_check)
    assert new.optimizer_wrapper == ("DeepSpeedZeroOptimizer_Stage3" if want_stage == 3 else "DeepSpeedZeroOptimizer")
    from safetensors.torch import load_file

    truth = load_file(str(FIXTURES / fixture.removeprefix("universal/") / "truth.safetensors"))
    src_by = {e.name: e for e in src.entries}
    compared = 0
    for e in new.entries:
        s = src_by[e.name]
        if e.tied_to is not None:
            continue
        if e.kind is Kind.PARAM and e.trainable:
            master = _assert_master_and_moments_are_truth(e, new_cache, truth)
            compared += 3
            if want_stage == 3:  # ZeRO-3 files keep no 16-bit copy of a trainable param (0-element placeholders)
                assert e.piece(Role.MODULE) is None
                continue
            module = read_piece(e.piece(Role.MODULE), e.shape, new_cache, name=e.name)
            # 16-bit copies: the master cast, round to nearest even (torch's .to, as DeepSpeed copies fp32 -> bit16)
            assert _bytes(module) == _bytes(master.to(TORCH[dtype])), e.name
            compared += 1
        elif e.kind is Kind.PARAM:  # frozen: its one stored copy, cast
            module = read_piece(e.piece(Role.MODULE), e.shape, new_cache, name=e.name)
            stored = read_piece(s.piece(Role.MODULE), s.shape, src_cache, name=e.name)
            assert _bytes(module) == _bytes(stored.to(TORCH[dtype])), e.name
            compared += 1
        else:  # buffers: floating ones fp32 (a 16-bit buffer widens exactly), others as stored
            buf = read_piece(e.piece(Role.MODULE), e.shape, new_cache, name=e.name)
            stored = read_piece(s.piece(Role.MODULE), s.shape, src_cache, name=e.name)
            want = stored.float() if stored.is_floating_point() else stored
            assert _bytes(buf) == _bytes(want), e.name
            compared += 1
    assert compared > 20
    # file names: bf16_ whenever bf16 is enabled (engine.py _get_zero_ckpt_name); model states never prefixed
    tag_dir = tmp_path / "out" / src.tag
    optim = sorted(p.name for p in tag_dir.glob("*optim_states.pt"))
    prefix = "bf16_" if dtype == "bf16" else ""
    assert optim == [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    assert not any(p.name.startswith("bf16_") for p in tag_dir.glob("*model_states.pt"))
    # the loss scaler as CreateLossScaler starts one; the recorded config's precision block
    for f in optim:
        tree = safe_load.load(tag_dir / f)
        osd = tree["optimizer_state_dict"]
        scaler = osd["loss_scaler"]
        if dtype == "fp16":
            assert type(scaler).__name__ == "DynamicLossScaler" and osd["dynamic_loss_scale"] is True
            # DeepSpeed's own pickled scaler (the fp16 fixture's, fields in its order), as a new one starts:
            # 2**16, no iterations, full hysteresis (the fixture ran 3 steps from 2**8)
            assert list(scaler.__dict__.items()) == list({**_FP16_SCALER, "cur_scale": 65536}.items())
        else:
            assert type(scaler).__name__ == "LossScaler" and osd["dynamic_loss_scale"] is False
            assert scaler.__dict__ == {"cur_scale": 1.0, "dynamic": False}
        cfg = tree["ds_config"]
        assert {k for k in ("bf16", "fp16") if k in cfg} == ({dtype} if dtype != "fp32" else set())
        assert "buffer_dtype" not in cfg.get("data_types", {})
    # the plan says which precision block to resume with
    lines = describe_plan(plan)
    resume = next(line for line in lines if line.startswith("resume with: "))
    block = {"bf16": '"bf16": {"enabled": true}', "fp16": '"fp16": {"enabled": true}'}.get(dtype)
    if block:
        assert block in resume
    else:
        assert '"bf16"' not in resume.split(";")[0] and '"fp16"' not in resume.split(";")[0]
        assert 'neither "bf16" nor "fp16" enabled (fp32)' in resume
    assert any(f"precision {src.precision.value} -> {dtype}" in line for line in lines)


MOE_FILE_CASES = [("moe_s2_bf16_w2_ep2", 2, None, "fp32"), ("moe_s2_fp32_w2_ep1", 2, None, "bf16"),
                  ("moe_s2_bf16_w2_ep2", 4, 4, "fp16")]  # the last: and expert-parallel size 2 -> 4


@pytest.mark.parametrize("fixture,world,ep,dtype", MOE_FILE_CASES, ids=[f"{f}-n{w}-ep{e}-{d}" for f, w, e, d in MOE_FILE_CASES])
def test_moe_expert_files_recast(fixture, world, ep, dtype, tmp_path):
    """Every layer_L_expert_E file of a native MoE --dtype output holds its experts' params as the fixture's
    recorded fp32 masters cast to the target dtype, bit for bit, and nothing else."""
    from safetensors.torch import load_file

    cache = FileCache()
    src = read_checkpoint(FIXTURES / fixture / "ckpt", cache=cache)
    plan = plan_reshard(src, world, ep_size=ep, facts=read_source_facts(src, cache), dtype=dtype)
    run_reshard(plan, tmp_path / "out", cache=cache, verify="full")
    truth = load_file(str(FIXTURES / fixture / "truth.safetensors"))
    src_files = sorted(p.name for p in (FIXTURES / fixture / "ckpt" / src.tag).glob("layer_*_expert_*"))
    files = sorted((tmp_path / "out" / src.tag).glob("layer_*_expert_*"))
    assert [p.name for p in files] == src_files and files
    n = 0
    for f in files:
        for key, value in safe_load.load(f).items():
            value = value if isinstance(value, torch.Tensor) else value.load()
            want = truth[f"param/{key}"].to(TORCH[dtype])
            assert value.dtype == want.dtype and _bytes(value) == _bytes(want), (f.name, key)
            n += 1
    assert n >= 8


PP_CASES = [("pp2_bf16", 2, [], "fp32"), ("pp2_fp32", 2, [], "bf16"), ("pp2_dp2_bf16", 2, [], "fp16"),
            ("pp2_dp2_fp32", 4, [], "bf16"), ("pp2_fp32_z0", 2, ["zero_stage=1"], "bf16"),
            ("pp2_dp2_bf16_z0", 2, [], "fp32")]  # a stage-0 BF16_Optimizer pipeline save as ZeRO-1 fp32


@pytest.mark.parametrize("fixture,world,extra,dtype", PP_CASES, ids=[f"{f}-n{w}-{d}" for f, w, _, d in PP_CASES])
def test_dtype_change_pipeline(fixture, world, extra, dtype, tmp_path):
    """A pipeline run (ZeRO-1, no TP) in another precision: masters and moments the fixture's truth, every layer
    file's params (the tied embedding's copies included) the masters cast, floating buffers fp32."""
    from safetensors.torch import load_file

    kw = dict(x.split("=") for x in extra)
    cache = FileCache()
    src = read_checkpoint(FIXTURES / fixture / "ckpt", cache=cache, tied_keys={0: "embed"} if fixture == "pp2_fp32_z0" else None)
    plan = plan_reshard(src, world, zero_stage=int(kw["zero_stage"]) if kw else None,
                        facts=read_source_facts(src, cache), dtype=dtype)
    run_reshard(plan, tmp_path / "out", cache=cache, verify="full")
    truth = load_file(str(FIXTURES / fixture / "truth.safetensors"))
    new_cache = FileCache()
    new = read_checkpoint(tmp_path / "out", cache=new_cache)
    assert (new.precision.value, new.zero_stage, new.optimizer_wrapper) == (dtype, 1, "DeepSpeedZeroOptimizer")
    n = 0
    for e in new.entries:
        if e.kind is Kind.PARAM and e.trainable and e.tied_to is None:
            _assert_master_and_moments_are_truth(e, new_cache, truth)
            n += 1
    assert n >= 5
    # every layer file, every key: a param its master cast (a tied param's every copy), a buffer as truth says, fp32
    files = sorted((tmp_path / "out" / src.tag).glob("layer_*-model_states.pt"))
    assert [f.name for f in files] == sorted(p.name for p in (FIXTURES / fixture / "ckpt" / src.tag).glob("layer_*"))
    checked = 0
    for f in files:
        layer = int(f.name[6:8])
        for key, value in safe_load.load(f).items():
            value = value if isinstance(value, torch.Tensor) else value.load()
            name = f"{layer}.{key}"
            if f"buffer/{name}" in truth:
                want = truth[f"buffer/{name}"]
                want = want.float() if want.is_floating_point() else want
            else:
                # a layer's own param, or (layer 0, the tied head) the tied embedding's copy
                want = truth[f"param/{name}" if f"param/{name}" in truth else f"param/tied_modules.embed.{key}"].to(
                    TORCH[dtype])
            assert value.dtype == want.dtype and _bytes(value) == _bytes(want), (f.name, key)
            checked += 1
    assert checked >= 8


# tensor parallelism (AutoTP and Megatron-style), ZeRO-1/2 targets: (fixture under autotp/, world, extra flags, dtype)
TP_CASES = [
    ("autotp_z1_bf16_tp2_dp1", 2, [], "fp32"),
    ("autotp_z1_bf16_tp2_dp1", 4, [], "fp16"),  # and a world-size change: DP 1 -> 2
    ("autotp_z2_fp32_tp2_dp2", 4, [], "bf16"),
    ("autotp_z1_fp16_tp2_dp1_cpuforced", 2, [], "bf16"),
    ("autotp_z1_bf16_tp2_dp1_frozen_buf", 2, [], "fp32"),  # frozen params and buffers
    ("autotp_z0_fp32_tp2_dp2", 4, ["zero_stage=1"], "bf16"),  # a stage-0 TP source, ZeRO-1 target
    ("megatron_z1_bf16_tp2_dp2_bf16opt", 4, [], "fp16"),  # BF16_Optimizer; vocabulary padding rows recast
    ("megatron_z2_fp32_tp2_dp2", 2, [], "bf16"),
    ("autotp_z1_bf16_tp4_dp1_kv6", 2, ["tp_size=2"], "fp32"),  # TP re-cut 4 -> 2 (per-file truth not compared)
    ("autotp_z3_bf16_tp2_dp1", 2, [], "fp32"),
    ("autotp_z3_fp16_tp2_dp1_cpuforced", 2, [], "bf16"),
    ("autotp_z1_bf16_tp2_dp1", 2, ["zero_stage=3"], "fp16"),
    ("autotp_z3_fp32_tp2_dp2", 4, ["zero_stage=2"], "bf16"),
]


@pytest.mark.parametrize("fixture,world,extra,dtype", TP_CASES, ids=[f"{f}-n{w}-{d}{''.join(x)}" for f, w, x, d in TP_CASES])
def test_dtype_change_tensor_parallel(fixture, world, extra, dtype, tmp_path):
    """Each TP rank's files recast from its own slices' masters: masters and moments the source's (the fixture's
    truth, read back merged), every model-states file's module params its TP rank's recorded fp32 slice cast
    (vocabulary padding rows included), frozen params their stored slice cast, floating buffers fp32."""
    from safetensors.torch import load_file

    kw = dict(x.split("=") for x in extra)
    src_dir = FIXTURES / "autotp" / fixture / "ckpt"
    before = tree_digest(src_dir)
    cache = FileCache()
    src = read_checkpoint(src_dir, cache=cache)
    plan = plan_reshard(src, world, zero_stage=int(kw.get("zero_stage", 0)) or None,
                        tp_size=int(kw["tp_size"]) if "tp_size" in kw else None,
                        facts=read_source_facts(src, cache), dtype=dtype)
    result = run_reshard(plan, tmp_path / "out", cache=cache, verify="full")
    assert tree_digest(src_dir) == before and result.verified_tensors > 0
    truth = load_file(str(FIXTURES / "autotp" / fixture / "truth.safetensors"))
    new_cache = FileCache()
    new = read_checkpoint(tmp_path / "out", cache=new_cache)
    tp = int(kw.get("tp_size", src.tp_world_size))
    assert (new.precision.value, new.tp_world_size, new.dp_world_size * tp) == (dtype, tp, world)
    stage3 = new.zero_stage == 3
    assert new.optimizer_wrapper == ("DeepSpeedZeroOptimizer_Stage3" if stage3 else "DeepSpeedZeroOptimizer")
    compared = 0
    for e in new.entries:
        if e.kind is Kind.PARAM and e.trainable and e.tied_to is None:
            master = _assert_master_and_moments_are_truth(e, new_cache, truth)
            compared += 1
            if stage3:  # ZeRO-3 files keep no 16-bit copy of a trainable param (0-element placeholders)
                assert e.piece(Role.MODULE) is None
                continue
            module = read_piece(e.piece(Role.MODULE), e.shape, new_cache, name=e.name)
            assert _bytes(module) == _bytes(master.to(TORCH[dtype])), e.name
    assert compared > 5
    tag_dir = tmp_path / "out" / src.tag
    prefix = "bf16_" if dtype == "bf16" else ""
    for t in range(tp):
        tree = safe_load.load(sorted(tag_dir.glob(f"*mp_rank_{t:02d}_model_states.pt"))[0])
        src_tree = safe_load.load(sorted((src_dir / src.tag).glob(f"*mp_rank_{t:02d}_model_states.pt"))[0])
        for name, value in tree["module"].items():
            value = value if isinstance(value, torch.Tensor) else value.load()
            if stage3 and value.numel() == 0:  # a ZeRO-3 placeholder, in the target's dtype
                assert value.dtype == TORCH[dtype], name
                continue
            src_tree["module"][name] = stored = src_tree["module"][name]
            if not isinstance(stored, torch.Tensor):
                src_tree["module"][name] = stored.load()
            if f"buffer/{name}" in truth or not src_tree["module"][name].is_floating_point() or (
                    name not in {e.name for e in src.entries if e.kind is Kind.PARAM}):  # buffers: fp32 / as stored
                stored = src_tree["module"][name]
                want = stored.float() if stored.is_floating_point() else stored
            elif tp == src.tp_world_size and f"tp{t}/param/{name}" in truth:  # TP rank t's fp32 slice, cast
                want = truth[f"tp{t}/param/{name}"].to(TORCH[dtype])
            elif tp == src.tp_world_size:  # frozen: its stored slice, cast
                want = src_tree["module"][name].to(TORCH[dtype])
            else:
                assert value.dtype in (TORCH[dtype], torch.float32), name
                continue
            assert value.dtype == want.dtype and _bytes(value) == _bytes(want), (t, name)
        optim = sorted(p.name for p in tag_dir.glob(f"*mp_rank_{t:02d}_optim_states.pt"))
        if stage3:
            assert optim == [f"{prefix}zero_pp_rank_{r}_mp_rank_{t:02d}_optim_states.pt" for r in range(world // tp)]
            continue
        assert optim == [f"{prefix}zero_pp_rank_{r}_mp_rank_{t:02d}_optim_states.pt" for r in range(world // tp)]
        for f in optim:
            osd = safe_load.load(tag_dir / f)["optimizer_state_dict"]
            assert type(osd["loss_scaler"]).__name__ == ("DynamicLossScaler" if dtype == "fp16" else "LossScaler")
            assert osd["dynamic_loss_scale"] is (dtype == "fp16")


def test_loss_scale_sets_the_new_scaler(tmp_path):
    _, _, plan, _ = _reshard("s2_bf16_w2_2groups", tmp_path / "out", 2, "fp16", loss_scale=1024.0)
    for f in sorted((tmp_path / "out" / "global_step3").glob("*optim_states.pt")):
        scaler = safe_load.load(f)["optimizer_state_dict"]["loss_scaler"]
        assert (scaler.cur_scale, scaler.cur_iter, scaler.cur_hysteresis) == (1024.0, 0, 2)


def test_same_dtype_is_a_no_op_of_the_precision(tmp_path):
    """--dtype naming the source's precision writes what a reshard without it writes, byte for byte."""
    _reshard("s2_bf16_w2_2groups", tmp_path / "a", 3, None)
    _reshard("s2_bf16_w2_2groups", tmp_path / "b", 3, "bf16")
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")


def test_bf16_optimizer_source_kept_under_bf16_unless_the_precision_changes():
    cache = FileCache()
    ckpt = read_checkpoint(FIXTURES / "s1_bf16_w2_bf16opt" / "ckpt", cache=cache)
    kept = plan_reshard(ckpt, 2, facts=read_source_facts(ckpt, cache), dtype="bf16")
    assert kept.optimizer_wrapper == "BF16_Optimizer" and kept.precision_change is None
    changed = plan_reshard(ckpt, 2, facts=read_source_facts(ckpt, cache), dtype="fp32")
    assert changed.optimizer_wrapper == "DeepSpeedZeroOptimizer" and changed.written_precision is Precision.FP32
    assert not changed.bf16_prefixed_optim


REFUSED = [
    ("s0_bf16_w2", ["-n", "2", "--dtype", "fp32"], 3, "without ZeRO: a stage-0 save keeps its precision wrapper"),
    ("s1_fp32_w2", ["-n", "2", "--dtype", "bf16", "--zero-stage", "0"], 3, "without ZeRO"),
    ("tp_pipeline/megatron_pp2_tp2_z1_fp32", ["-n", "4", "--dtype", "bf16"], 3,
     "a tensor-parallel pipeline run's layer files (layer_XX-model_YY-...) hold each TP rank's 16-bit slices"),
    ("autoep/autoep_mixtral_z2_bf16_ep2_dp1", ["-n", "2", "--dtype", "fp32"], 3,
     "AutoEP's expert files (layer_L_expert_X_...) hold each expert-parallel rank's slice"),
    ("s2_bf16_w2_2groups", ["-n", "2", "--dtype", "fp32", "--loss-scale", "128"], 2,
     "--loss-scale starts the dynamic loss scaler of an fp16 target"),
    ("s2_fp16_w2_cpuforced", ["-n", "2", "--dtype", "fp16", "--loss-scale", "128"], 2,
     "dsckpt repair CKPT OUT --loss-scale S"),
    ("s2_bf16_w2_2groups", ["-n", "2", "--dtype", "fp16", "--loss-scale", "0"], 2, "positive finite loss scale"),
    ("s2_bf16_w2_2groups", ["--universal", "--dtype", "fp16"], 2, "--universal writes fp32 values only"),
]


@pytest.mark.parametrize("fixture,args,code,message", REFUSED, ids=[f"{r[0]}-{'_'.join(r[1][2:])}" for r in REFUSED])
def test_refused_by_name(fixture, args, code, message, tmp_path):
    ckpt = FIXTURES / fixture / "ckpt"
    if not ckpt.is_dir():
        pytest.skip(f"{fixture} is not a fixture here")
    before = tree_digest(ckpt)
    r = CliRunner().invoke(main, ["reshard", str(ckpt), str(tmp_path / "out"), *args])
    assert r.exit_code == code, r.output
    assert message in r.output
    assert "Traceback" not in r.output and not (tmp_path / "out").exists() and tree_digest(ckpt) == before


def test_loss_scale_usage_error_in_the_api():
    ckpt = read_checkpoint(FIXTURES / "s1_fp32_w2" / "ckpt")
    with pytest.raises(UsageError, match="a bf16 or fp32 target has none"):
        plan_reshard(ckpt, 2, dtype="bf16", loss_scale=8.0)


def test_retype_tree_leaves_a_kept_precision_alone():
    tree = {"module": {"w": object()}, "ds_config": {"bf16": {"enabled": True}}}
    ckpt = read_checkpoint(FIXTURES / "s1_fp32_w2" / "ckpt")
    assert retype_tree(tree, None, ckpt, None) is tree
    kept = PrecisionTarget(Precision.BF16, Precision.BF16)
    assert retype_tree(tree, kept, ckpt, None) is tree


def test_tampered_output_fails_verification(tmp_path, monkeypatch):
    """A control: a 16-bit copy that is not its master cast (here: truncated instead of rounded) is caught by
    --verify's recast check."""
    import dsckpt.ds_writers.precision as precision

    real = precision._cast

    def truncating(t, dtype):
        out = real(t, dtype)
        if dtype == "bfloat16" and t.dtype == torch.float32 and t.numel() > 1:
            bits = t.contiguous().view(torch.int32) & ~0xFFFF
            out = bits.view(torch.float32).to(torch.bfloat16)
        return out

    src, cache, plan, _ = _reshard("s1_fp32_w2", tmp_path / "good", 2, "bf16")  # the same plan passes
    monkeypatch.setattr(precision, "_cast", truncating)  # the files are written truncated ...
    from dsckpt.errors import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError, match="is not its master cast"):
        _verify_with_real_cast(plan, cache, tmp_path / "bad", real, monkeypatch)  # ... and checked rounded
    assert not (tmp_path / "bad").exists()


def _verify_with_real_cast(plan, cache, out, real, monkeypatch):
    import dsckpt.ds_writers.precision as precision

    original = precision.module_copy_problem

    def check(*a, **kw):
        monkeypatch.setattr(precision, "_cast", real)
        return original(*a, **kw)

    monkeypatch.setattr(precision, "module_copy_problem", check)
    run_reshard(plan, out, cache=cache, verify="full")


# --- live: real DeepSpeed 0.19.8 resumes --dtype outputs (one launch on 2 CPU ranks, fp16 forced as the
# *_cpuforced fixtures were made). Each pair FIXTURE:DTYPE is built with the precision block the plan names.
LIVE_CASES = [  # (fixture, target dtype); every output written for 2 ranks
    ("s2_bf16_w2_2groups", "fp32"),  # bf16 -> fp32
    ("s1_fp32_w2", "bf16"),  # fp32 -> bf16 (bf16_ files)
    # bf16 -> fp16: a new DynamicLossScaler, here at --loss-scale 256 (the fixtures' fp16 runs' 2**8): at DeepSpeed's
    # default 2**16 this model's first fp16 step overflows and is skipped, as a fresh fp16 run's first steps are
    ("s2_bf16_w2_2groups", "fp16"),
    ("s3_bf16_w3_subgroups", "fp32"),  # and a world-size change: 3 -> 2 ranks, ZeRO-3 sub-groups
    ("s2_fp16_w2_cpuforced", "bf16"),  # fp16 -> bf16: the scaler dropped, fp16 buffers widened
    ("s3_fp16_w2_cpuforced", "fp32"),  # fp16 ZeRO-3 -> fp32
    ("s1_bf16_w2_bf16opt", "fp16"),  # BF16_Optimizer -> DeepSpeedZeroOptimizer at fp16
]
LIVE_SCALE = 256.0
LIVE_CONTROL = "s1_fp32_w2"  # -> fp16 with --loss-scale 1024: the check expects 256 and must see the scale


@pytest.fixture(scope="module")
def ds_dtype_run(tmp_path_factory):
    from ds_launch import DEEPSPEED, run_check_script

    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    base = tmp_path_factory.mktemp("ds_dtype")
    pairs = []
    for name, dtype in LIVE_CASES:
        _reshard(name, base / f"{name}_{dtype}", 2, dtype, loss_scale=LIVE_SCALE if dtype == "fp16" else None)
        pairs.append(f"{name}:{dtype}={base / f'{name}_{dtype}'}")
    _reshard(LIVE_CONTROL, base / "tampered", 2, "fp16", loss_scale=1024.0)
    pairs.append(f"{LIVE_CONTROL}:fp16={base / 'tampered'}")
    return run_check_script("ds_reshard_check.py", pairs, args=["--force-cpu-fp16", "--expect-scale", str(LIVE_SCALE)], world=2, cwd=base, timeout=1500)


@pytest.mark.live
@pytest.mark.deepspeed
def test_deepspeed_resumes_dtype_changes(ds_dtype_run):
    """Plain engine.load_checkpoint() of each --dtype output, the engine built with the target's precision:
    fp32 masters and Adam moments exact (fragment API and flat partitions), module weights the masters cast,
    buffers, counters, the loss scaler DeepSpeed starts for the target; then one more step. The control (a scaler
    at 1024 where a new one starts at 2**16) fails on exactly that."""
    from ds_launch import passed_except_controls

    rc, results, log = ds_dtype_run
    results, control = passed_except_controls(results, log)
    assert [r["fixture"] for r in results] == [f"{n}:{d}" for n, d in LIVE_CASES]
    assert len(control) == 1 and not control[0]["ok"], log
    assert {p.split(": ", 1)[1] for p in control[0]["problems"]} == {
        "loss scaler DynamicLossScaler {'cur_scale': 1024.0, 'cur_iter': 0, 'last_overflow_iter': -1, "
        "'cur_hysteresis': 2} != a new DynamicLossScaler {'cur_scale': 256.0, 'cur_iter': 0, "
        "'last_overflow_iter': -1, 'cur_hysteresis': 2}"}, control[0]["problems"]
    assert rc == 1, log
    assert "DTYPE-EVIDENCE s2_bf16_w2_2groups:fp16: DeepSpeedZeroOptimizer, loss scaler DynamicLossScaler" in log


# live, tensor parallelism: tests/ds_tp_reshard_check.py builds each NAME:DTYPE pair's engine at TP 2 with the target's
# precision (one launch, 2 ranks: TP 2 x DP 1); the control is an fp16 output whose scaler starts at 1024
TP_LIVE_CASES = [  # (fixture under autotp/, target dtype)
    ("autotp_z1_bf16_tp2_dp1", "fp32"),
    ("autotp_z2_fp32_tp2_dp2", "bf16"),  # and DP 2 -> 1
    ("autotp_z1_bf16_tp2_dp1", "fp16"),  # a new DynamicLossScaler at 2**16 (CPU fp16 forced)
    ("megatron_z1_bf16_tp2_dp1", "fp32"),  # an mpu, vocabulary padding rows
    ("autotp_z3_bf16_tp2_dp1", "fp32"),  # ZeRO-3 with AutoTP
]


@pytest.fixture(scope="module")
def ds_tp_dtype_run(tmp_path_factory):
    from ds_launch import DEEPSPEED, run_check_script

    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    base = tmp_path_factory.mktemp("ds_tp_dtype")
    pairs = []
    for name, dtype in TP_LIVE_CASES:
        _reshard(f"autotp/{name}", base / f"{name}_{dtype}", 2, dtype)
        pairs.append(f"{name}:{dtype}={base / f'{name}_{dtype}'}")
    _reshard("autotp/autotp_z1_bf16_tp2_dp1", base / "tampered", 2, "fp16", loss_scale=1024.0)
    pairs.append(f"autotp_z1_bf16_tp2_dp1:fp16={base / 'tampered'}")
    return run_check_script("ds_tp_reshard_check.py", pairs, args=["--tp-size", "2"], world=2, cwd=base, timeout=900)


@pytest.mark.live
@pytest.mark.deepspeed
def test_deepspeed_resumes_tp_dtype_changes(ds_tp_dtype_run):
    """Each TP rank's engine, built with the target's precision, loads its --dtype output: fp32 masters and Adam
    moments its recorded TP slice exactly, module weights that slice cast (bit for bit), buffers, counters, the
    loss scaler DeepSpeed starts for the target; one more step. The control (a scaler at 1024) fails on that."""
    from ds_launch import passed_except_controls

    rc, results, log = ds_tp_dtype_run
    results, control = passed_except_controls(results, log)
    assert [r["fixture"] for r in results] == [f"{n}:{d}" for n, d in TP_LIVE_CASES]
    assert len(control) == 1 and not control[0]["ok"], log
    assert {p.split(": ", 1)[1] for p in control[0]["problems"]} == {
        "loss scaler ('DynamicLossScaler', 1024.0, 0) != ('DynamicLossScaler', 65536.0, 0)"}, control[0]["problems"]
    assert rc == 1, log
    assert "DTYPE-EVIDENCE autotp_z1_bf16_tp2_dp1:fp16: DeepSpeedZeroOptimizer, module torch.float16" in log


# live, native MoE: tests/ds_moe_reshard_check.py builds each NAME:DTYPE pair's engine with the target's precision
MOE_LIVE_CASES = [("moe_s2_bf16_w2_ep2", "fp32"), ("moe_s2_fp32_w2_ep1", "bf16"),
                  ("moe_s1_bf16_w2_ep2_bf16opt", "fp32")]  # (fixture, target dtype); 2 ranks each


@pytest.mark.live
@pytest.mark.deepspeed
def test_deepspeed_resumes_moe_dtype_changes(tmp_path):
    """engine.load_checkpoint() of each native MoE --dtype output, the engine at the target's precision: fp32
    masters and Adam moments exact (fragment API and the flat partitions), every param's module copy (experts
    included) its master cast, counters; then one more step."""
    from ds_launch import DEEPSPEED, run_check_script

    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    pairs = []
    for name, dtype in MOE_LIVE_CASES:
        _reshard(name, tmp_path / f"{name}_{dtype}", 2, dtype)
        pairs.append(f"{name}:{dtype}={tmp_path / f'{name}_{dtype}'}")
    rc, results, log = run_check_script("ds_moe_reshard_check.py", pairs, world=2, cwd=tmp_path, timeout=900)
    assert rc == 0 and [r["fixture"] for r in results] == [f"{n}:{d}" for n, d in MOE_LIVE_CASES], log
    assert all(r["ok"] for r in results), log


# live, pipeline: tests/ds_pipeline_reshard_check.py builds each NAME@pp2@dtDTYPE pair's PipelineModule engine with
# the target's precision (2 ranks: PP 2 x DP 1)
PP_LIVE_CASES = [("pp2_bf16", "fp32"), ("pp2_fp32", "bf16"), ("pp2_dp2_bf16", "fp32")]  # the last: DP 2 -> 1


@pytest.mark.live
@pytest.mark.deepspeed
def test_deepspeed_resumes_pipeline_dtype_changes(tmp_path):
    """engine.load_checkpoint() of each pipeline --dtype output, a PipelineEngine at the target's precision: fp32
    masters and Adam moments exact, every module weight its master cast (bit for bit), floating buffers fp32,
    counters; then one more train_batch."""
    from ds_launch import DEEPSPEED, run_check_script

    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    pairs = []
    for name, dtype in PP_LIVE_CASES:
        _reshard(name, tmp_path / f"{name}_{dtype}", 2, dtype)
        pairs.append(f"{name}@pp2@dt{dtype}={tmp_path / f'{name}_{dtype}'}")
    rc, results, log = run_check_script("ds_pipeline_reshard_check.py", pairs, world=2, cwd=tmp_path, timeout=900)
    assert rc == 0 and [r["fixture"] for r in results] == [f"{n}@pp2@dt{d}" for n, d in PP_LIVE_CASES], log
    assert all(r["ok"] for r in results), log


def test_cli_says_what_changed_and_what_to_resume_with(tmp_path):
    src = FIXTURES / "s1_bf16_w2_bf16opt" / "ckpt"
    r = CliRunner().invoke(main, ["reshard", str(src), str(tmp_path / "dry"), "-n", "2", "--dtype", "fp16",
                                  "--dry-run"])
    assert r.exit_code == 1, r.output  # there is work
    assert "to ZeRO stage 1 (DeepSpeedZeroOptimizer), to fp16, tag 'global_step3'" in r.output
    assert "note: precision bf16 -> fp16: fp32 masters and optimizer state kept exactly" in r.output
    assert ('resume with: "zero_optimization": {"stage": 1}, "fp16": {"enabled": true}; no '
            '"data_types.grad_accum_dtype": "fp32" (that selects BF16_Optimizer)') in r.output
    assert not (tmp_path / "dry").exists()
    r = CliRunner().invoke(main, ["reshard", str(src), str(tmp_path / "out"), "-n", "2", "--dtype", "fp32", "-q"])
    assert r.exit_code == 0, r.output
    assert (f"from 2 to 2 ranks, BF16_Optimizer -> DeepSpeedZeroOptimizer, bf16 -> fp32: wrote 3 files to "
            f"{tmp_path / 'out'}/global_step3") in r.output
    assert 'resume with: "zero_optimization": {"stage": 1}; neither "bf16" nor "fp16" enabled (fp32)' in r.output
