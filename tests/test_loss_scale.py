"""``repair --loss-scale S`` and ``repair --from CKPT2`` (another DeepSpeed checkpoint of the run), issue 39 item 4.

The run is ``tests/fixtures/lossfloor/s2_fp16_w2`` (README: "The fp16 run at its loss-scale floor"): ZeRO-2 fp16 on
2 ranks whose scale fell to its floor 8; global_step3 is its last clean checkpoint, global_step5/6 sit at the floor
with inf/NaN BatchNorm running stats. Truth per tag was read from the engine when it saved."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import FIXTURES, parsed_file, tree_differences, tree_digest
from ds_launch import run_deepspeed
from safetensors.torch import load_file
from scan_helpers import plant

from dsckpt.api import to_fp32
from dsckpt.cli import main
from dsckpt.errors import RepairError, UsageError
from dsckpt.model import Role
from dsckpt.repair import Policy, prepare_repair, run_repair
from dsckpt.scan import scan

RUN = FIXTURES / "lossfloor" / "s2_fp16_w2"
CKPT = RUN / "ckpt"
TRUTH = json.loads((RUN / "truth.json").read_text())
RANK_FILES = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]
SCALER = ("optimizer_state_dict", "loss_scaler")


def _record(tag: str) -> dict:
    return next(c for c in TRUTH["checkpoints"] if c["tag"] == tag)


def _scaler(path: Path) -> dict:
    tree = parsed_file(path)
    return dict(vars(tree[SCALER[0]][SCALER[1]]))


def _without_scaler(path: Path):
    tree = parsed_file(path)
    del tree[SCALER[0]][SCALER[1]]
    return tree


def _fp32(ckpt: Path, tmp: Path, tag: str | None = None) -> dict[str, torch.Tensor]:
    out = tmp / f"fp32-{len(list(tmp.glob('fp32-*')))}.safetensors"
    to_fp32(ckpt, out, tag=tag)
    return load_file(str(out))


def _truth(tag: str) -> dict[str, torch.Tensor]:
    return load_file(str(RUN / f"truth_{tag}.safetensors"))


def test_fixture_scaler_fields_are_the_recorded_truth():
    """The files hold what the engine held when it saved (the rest of this module relies on it)."""
    for c in TRUTH["checkpoints"]:
        for f in RANK_FILES:
            got = _scaler(CKPT / c["tag"] / f)
            want = c["loss_scaler"]
            assert {k: got[k] for k in ("cur_scale", "min_scale", "cur_iter", "last_overflow_iter", "delayed_shift",
                                        "cur_hysteresis", "scale_window", "scale_factor")} == \
                {k: want[k] for k in ("cur_scale", "min_scale", "cur_iter", "last_overflow_iter", "delayed_shift",
                                      "cur_hysteresis", "scale_window", "scale_factor")}
    assert [(c["tag"], c["at_floor"]) for c in TRUTH["checkpoints"]] == [
        ("global_step1", False), ("global_step3", False), ("global_step5", True), ("global_step6", True)]


def test_loss_scale_written_in_every_rank_file_rest_unchanged(tmp_path):
    before = tree_digest(CKPT)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["repair", str(CKPT), str(out), "--tag", "global_step3", "--loss-scale", "64"])
    assert r.exit_code == 0, r.output
    assert "loss scale: 32 -> 64 (floor 8); reset cur_iter 3 -> 0, last_overflow_iter 1 -> -1, cur_hysteresis 1 -> 2" \
        in r.stdout
    assert tree_digest(CKPT) == before  # input untouched
    after = tree_digest(out)
    rewritten = {f"global_step3/{f}" for f in RANK_FILES}
    assert set(after) == set(before)
    assert {k for k in before if before[k] != after[k]} == rewritten  # every other file byte for byte
    rec = _record("global_step3")["loss_scaler"]
    for f in RANK_FILES:
        got = _scaler(out / "global_step3" / f)
        assert got == {"cur_scale": 64.0, "dynamic": True, "cur_iter": 0, "last_overflow_iter": -1,
                       "scale_factor": 2.0, "scale_window": 1000, "min_scale": rec["min_scale"],
                       "delayed_shift": 2, "cur_hysteresis": 2, "consecutive_hysteresis": False,
                       "raise_error_at_min_scale": True, "dtype": got["dtype"]}
        assert type(got["cur_scale"]) is float and repr(got["dtype"]) == "torch.float16"
        assert tree_differences(_without_scaler(CKPT / "global_step3" / f), _without_scaler(out / "global_step3" / f)) \
            == []
    fp32 = _fp32(out, tmp_path, "global_step3")
    truth = _truth("global_step3")
    assert all(torch.equal(fp32[n], truth[f"param/{n}"]) for n in TRUTH["trainable"])


def test_rescue_at_the_floor_from_the_last_clean_checkpoint(tmp_path):
    """global_step6 (scale at its floor 8, BN stats inf/NaN) repaired from global_step3 with a new scale."""
    plan, _ = prepare_repair(CKPT, CKPT / "global_step3", loss_scale=32)
    assert [p.name for p in plan.patches] == ["bn.running_mean", "bn.running_var"]
    out = tmp_path / "out"
    result = run_repair(plan, out)
    assert result.rescan.clean and scan(out, nonfinite_only=True).clean
    good, bad = _truth("global_step3"), _truth("global_step6")
    got = _fp32(out, tmp_path)
    for n in ("bn.running_mean", "bn.running_var"):
        broken = ~torch.isfinite(bad[f"buffer/{n}"])
        assert int(broken.sum()) == 5
        assert torch.equal(got[n][broken], good[f"buffer/{n}"][broken])
        assert torch.equal(got[n][~broken], bad[f"buffer/{n}"][~broken])
    # masters (and so the fp16 copies) are global_step6's: nothing of them was non-finite
    assert all(torch.equal(got[n], bad[f"param/{n}"]) for n in TRUTH["trainable"])
    for f in RANK_FILES:
        s = _scaler(out / "global_step6" / f)
        assert (s["cur_scale"], s["cur_iter"], s["last_overflow_iter"], s["cur_hysteresis"], s["min_scale"]) == \
            (32.0, 0, -1, 2, 8)
        assert tree_differences(_without_scaler(CKPT / "global_step6" / f), _without_scaler(out / "global_step6" / f)) \
            == []
    # the model-states file differs from the input only in the two patched buffers
    a, b = parsed_file(CKPT / "global_step6/mp_rank_00_model_states.pt"), parsed_file(out / "global_step6/mp_rank_00_model_states.pt")
    assert sorted(tree_differences(a, b)) == ["['module']['bn.running_mean']: values differ",
                                              "['module']['bn.running_var']: values differ"]


def test_from_checkpoint_patches_master_fp16_copy_and_moments(tmp_path):
    """Planted inf/NaN in global_step6's fp32 master, fp16 copy and exp_avg_sq of fc1.weight (a copy of the run):
    each stored copy gets global_step3's value at those elements (the fp16 copy: the master cast to fp16)."""
    run = tmp_path / "run"
    shutil.copytree(CKPT, run)
    plant(run, "fc1.weight", Role.MASTER, 5, math.nan)
    plant(run, "fc1.weight", Role.MODULE, 5, math.inf)
    plant(run, "fc1.weight", "exp_avg_sq", 5, math.nan)
    plant(run, "fc1.weight", "exp_avg", 9, -math.inf)
    plan, _ = prepare_repair(run, run / "global_step3", policy=Policy.REFUSE)
    assert [(p.name, p.state_key, p.indices.tolist()) for p in plan.patches] == [
        ("bn.running_mean", None, [0, 1, 2, 3, 6]), ("bn.running_var", None, [0, 1, 2, 3, 6]),
        ("fc1.weight", None, [5]), ("fc1.weight", "exp_avg", [9]), ("fc1.weight", "exp_avg_sq", [5])]
    out = tmp_path / "out"
    run_repair(plan, out)
    from scan_helpers import read_copy

    from dsckpt.checkpoint import open_checkpoint

    c = open_checkpoint(out)
    e = c.logical.entry("fc1.weight")
    good, bad = _truth("global_step3"), _truth("global_step6")
    master = read_copy(e, c.cache, Role.MASTER).reshape(-1)
    module = read_copy(e, c.cache, Role.MODULE).reshape(-1)
    exp_avg = read_copy(e, c.cache, "exp_avg").reshape(-1)
    exp_avg_sq = read_copy(e, c.cache, "exp_avg_sq").reshape(-1)
    g = {k: good[f"{k}/fc1.weight"].reshape(-1) for k in ("param", "exp_avg", "exp_avg_sq")}
    b = {k: bad[f"{k}/fc1.weight"].reshape(-1) for k in ("param", "exp_avg", "exp_avg_sq", "lowp")}
    assert master[5] == g["param"][5] and module[5] == g["param"][5].half()
    assert exp_avg_sq[5] == g["exp_avg_sq"][5] and exp_avg[9] == g["exp_avg"][9]
    keep = torch.ones(master.numel(), dtype=torch.bool)
    keep[5] = False
    assert torch.equal(master[keep], b["param"][keep]) and torch.equal(module[keep], b["lowp"][keep])
    assert torch.equal(exp_avg_sq[keep], b["exp_avg_sq"][keep])
    keep9 = torch.ones(master.numel(), dtype=torch.bool)
    keep9[9] = False
    assert torch.equal(exp_avg[keep9], b["exp_avg"][keep9])


def test_loss_scale_alone_refuses_a_checkpoint_with_nonfinite_values(tmp_path):
    with pytest.raises(RepairError, match=r"bn.running_mean \(buffer, 5 non-finite\): no value"):
        prepare_repair(CKPT, None, loss_scale=32)


FP16_LAYOUTS = ["s0_fp16_w1_bnoverflow", "s0_fp16_w1_fused", "s0_fp16_w1_adapter_fused_cpuforced",
                "s1_fp16_w3_cpuforced", "s2_fp16_w2_cpuforced", "s3_fp16_w2_cpuforced", "ds0145_s0_fp16_w1"]


@pytest.mark.parametrize("name", FP16_LAYOUTS)
def test_loss_scale_on_every_fp16_layout(tmp_path, name):
    """Stage 0 (FP16_UnfusedOptimizer, FP16_Optimizer: the fields in mp_rank_00's ``optimizer``), ZeRO-1/2/3 on
    several ranks (the pickled DynamicLossScaler in every optimizer file), DeepSpeed 0.14.5's stage 0."""
    ckpt = FIXTURES / name / "ckpt"
    meta = json.loads((FIXTURES / name / "truth.json").read_text())
    plan, _ = prepare_repair(ckpt, None, policy=Policy.RESET_BN_STATS, loss_scale=4096)
    out = tmp_path / "out"
    run_repair(plan, out)
    tag = meta["tag"]
    if meta["stage"] == 0:
        files = ["mp_rank_00_model_states.pt"]
    else:
        files = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(meta["dp_world_size"])]
    assert sorted(e.site.file.name for e in plan.loss_scale.edits) == sorted(files)
    for f in files:
        old, new = parsed_file(ckpt / tag / f), parsed_file(out / tag / f)
        if meta["stage"] == 0:
            o, n = old["optimizer"], new["optimizer"]
            assert old["optimizer"]["cur_scale"] == meta["loss_scale"] == 256
            assert {k: n[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter")} == \
                {"cur_scale": 4096.0, "cur_iter": 0, "last_overflow_iter": -1}
            assert {k: v for k, v in n.items() if k not in ("cur_scale", "cur_iter", "last_overflow_iter")}.keys() == \
                {k for k in o if k not in ("cur_scale", "cur_iter", "last_overflow_iter")}
            for k in ("cur_scale", "cur_iter", "last_overflow_iter"):
                o[k] = n[k]
        else:
            o, n = vars(old[SCALER[0]][SCALER[1]]), vars(new[SCALER[0]][SCALER[1]])
            assert o["cur_scale"] == meta["loss_scale"] == 256
            assert {k: n[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")} == \
                {"cur_scale": 4096.0, "cur_iter": 0, "last_overflow_iter": -1, "cur_hysteresis": o["delayed_shift"]}
            for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"):
                o[k] = n[k]
        # everything but the scaler and the reset BN stats is as it was
        diffs = [d for d in tree_differences(old, new) if "running_" not in d]
        assert diffs == [], diffs


@pytest.mark.parametrize("args, message", [
    (["--loss-scale", "0"], "positive finite"), (["--loss-scale", "-2"], "positive finite"),
    (["--loss-scale", "nan"], "positive finite"), (["--loss-scale", "inf"], "positive finite"),
    (["--loss-scale", "4"], "below the floor this checkpoint's scaler keeps (min_scale 8"),
])
def test_bad_loss_scale_is_a_usage_error(tmp_path, args, message):
    r = CliRunner().invoke(main, ["repair", str(CKPT), str(tmp_path / "out"), "--tag", "global_step3", *args])
    assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.output, r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name, precision", [("s2_bf16_w2_2groups", "a bf16"), ("s3_fp32_w2", "an fp32"),
                                             ("s1_bf16_w2_bf16opt", "a bf16")])
def test_loss_scale_on_a_run_without_dynamic_scaler_is_a_usage_error(tmp_path, name, precision):
    r = CliRunner().invoke(main, ["repair", str(FIXTURES / name / "ckpt"), str(tmp_path / "out"), "--loss-scale", "8"])
    assert r.exit_code == 2, r.output
    assert f"is {precision} run, which has no dynamic loss scaler" in r.stderr
    assert not (tmp_path / "out").exists()


def test_loss_scale_on_a_safetensors_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="has no loss scaler"):
        prepare_repair(FIXTURES / "s2_fp16_w2_cpuforced" / "source_fp32.safetensors", None, loss_scale=8)


def test_from_a_checkpoint_of_another_model_is_refused(tmp_path):
    other = FIXTURES / "s0_fp16_w1_adapter_cpuforced" / "ckpt"
    r = CliRunner().invoke(main, ["repair", str(CKPT), str(tmp_path / "out"), "--from", str(other)])
    assert r.exit_code == 2, r.output
    assert "(tag global_step3) is not a checkpoint of the same model: 9 tensor(s) it lacks (bn.bias, " \
        "bn.num_batches_tracked, bn.running_mean, ...); 5 it has that " in r.stderr
    assert "embed.weight is [11, 8] there, [11, 6] here" in r.stderr
    assert not (tmp_path / "out").exists()


def test_from_the_checkpoint_itself_is_refused(tmp_path):
    r = CliRunner().invoke(main, ["repair", str(CKPT), str(tmp_path / "out"), "--from", str(CKPT / "global_step6")])
    assert r.exit_code == 2 and "is the checkpoint being repaired" in r.stderr, r.output


def test_dry_run_and_json_show_the_scaler_edit(tmp_path):
    r = CliRunner().invoke(main, ["repair", str(CKPT), str(tmp_path / "out"), "--tag", "global_step3",
                                  "--loss-scale", "64", "--dry-run", "--json"])
    assert r.exit_code == 1, r.output
    plan = json.loads(r.stdout)["plan"]
    sites = plan["loss_scale"]["sites"]
    assert [Path(s["file"]).name for s in sites] == RANK_FILES
    assert all(s["before"]["cur_scale"] == 32 and s["after"] == {"cur_scale": 64.0, "cur_iter": 0,
                                                                  "last_overflow_iter": -1, "cur_hysteresis": 2}
               for s in sites)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ DeepSpeed resumes the rescued run


@pytest.mark.live
@pytest.mark.deepspeed
def test_deepspeed_survives_an_overflow_after_loss_scale_reset(tmp_path):
    """One launch, 2 ranks, the run's own config: the source (global_step6, at its floor) raises DeepSpeed's
    "Exiting run." on an overflowing batch; the repaired copy (from global_step3, --loss-scale 32) loads with
    cur_scale 32, takes two overflowing batches (hysteresis 2 -> 1, then 32 -> 16) and a clean step."""
    out = tmp_path / "rescued"
    r = CliRunner().invoke(main, ["repair", str(CKPT), str(out), "--from", str(CKPT / "global_step3"),
                                  "--loss-scale", "32"])
    assert r.exit_code == 0, r.output
    result = tmp_path / "result.json"
    proc = run_deepspeed("loss_scale_check.py", ["--source", str(CKPT), "--rescued", str(out),
                                                 "--result", str(result)],
                         world=2, cwd=tmp_path, timeout=300)
    assert result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(result.read_text())
    assert got["source"]["loaded_scale"] == 8.0
    assert "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run." in \
        got["source"]["error"]
    assert got["rescued"]["loaded_scale"] == 32.0 and got["rescued"]["error"] is None
    assert got["rescued"]["scales"] == [32.0, 16.0, 16.0]
    assert got["rescued"]["hysteresis"] == [1, 1, 1]
    assert got["rescued"]["skipped_steps"] == 3 + 2
    assert got["rescued"]["bn_finite"] is True


# ------------------------------------------------------------------ --from another checkpoint: every stored copy


@pytest.mark.parametrize("name", ["s3_fp32_w2", "s1_bf16_w3", "s2_bf16_w2_2groups", "s0_bf16_w2"])
def test_from_checkpoint_restores_every_stored_copy_exactly(tmp_path, name):
    """A copy of a clean fixture with inf/NaN planted in the BN buffer (every replica: ZeRO-3 keeps one per rank),
    a param's fp32 master and 16-bit module copy, and its exp_avg_sq, repaired ``--from`` the fixture itself: every
    file of the output parses to the very tree of the fixture's (all values restored bit for bit; the 16-bit copy is
    the master rounded, as DeepSpeed made it)."""
    src = FIXTURES / name / "ckpt"
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    plant(ckpt, "bn.running_var", Role.MODULE, 2, math.inf, replica=None)
    plant(ckpt, "fc2.weight", Role.MASTER, 7, math.nan)
    if name != "s3_fp32_w2":  # fp32 ZeRO-3 stores no module copy of a trained param
        plant(ckpt, "fc2.weight", Role.MODULE, 7, -math.inf)
    plant(ckpt, "fc2.weight", "exp_avg_sq", 11, math.nan)
    assert not scan(ckpt, nonfinite_only=True).clean
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["repair", str(ckpt), str(out), "--from", str(src)])
    assert r.exit_code == 0, r.output
    assert "fc2.weight (param, exp_avg_sq): 1 of 30 values at [11]; before: non-finite" in r.stdout
    files = sorted(p.relative_to(src) for p in src.rglob("*.pt"))
    assert files
    for rel in files:
        assert tree_differences(parsed_file(src / rel), parsed_file(out / rel)) == [], rel


def test_static_scaler_is_refused_by_name():
    """fp16 with a static ``fp16.loss_scale`` (no fixture has one): ZeRO pickles a ``LossScaler``, stage 0 writes
    ``dynamic_loss_scale: False``; neither is a dynamic scaler to reset (plan_loss_scale is pure)."""
    from dsckpt.loss_scale import FIELDS, OBJECT, ScalerSite, plan_loss_scale

    zero = ScalerSite(Path("zero_pp_rank_0_mp_rank_00_optim_states.pt"), SCALER, OBJECT, "LossScaler",
                      {"cur_scale": 128, "dynamic": False})
    stage0 = ScalerSite(Path("mp_rank_00_model_states.pt"), ("optimizer",), FIELDS, "fields",
                        {"dynamic_loss_scale": False, "cur_scale": 128.0, "cur_iter": 3})
    for site in (zero, stage0):
        with pytest.raises(UsageError, match=r"uses a static loss scale \(.*cur_scale 128\), not a dynamic scaler"):
            plan_loss_scale([site], 64.0, precision="fp16", source="ckpt")
    with pytest.raises(UsageError, match="keeps no loss scaler in any file"):
        plan_loss_scale([], 64.0, precision="fp16", source="ckpt")
