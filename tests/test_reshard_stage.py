"""dsckpt reshard --zero-stage: ZeRO-1/2 <-> ZeRO-3 (and BF16_Optimizer sources), planned without files,
written and read back on every fixture, and resumed by real DeepSpeed on CPU ranks."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import all_fixtures, ids, tree_differences, tree_digest
from ds_launch import DEEPSPEED, REPO, jit_op_built, passed_except_controls, run_check_script

from dsckpt import parsed_tree, safe_load
from dsckpt.assemble import iter_tensors
from dsckpt.cli import main
from dsckpt.errors import UnsupportedCheckpointError, UsageError
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.reshard import plan_reshard, read_source_facts, run_reshard

ZERO = [f for f in all_fixtures() if f.meta.get("pp_size", 1) == 1 and f.meta["stage"] in (1, 2, 3)
        and (f.ckpt / f.meta["tag"]).is_dir() and not f.name.startswith(("moe", "hf_"))]


def convert(src: Path, out: Path, world_size: int, stage: int, sub_group_size: int | None = None):
    cache = FileCache()
    ckpt = read_checkpoint(src, cache=cache)
    plan = plan_reshard(ckpt, world_size, zero_stage=stage, sub_group_size=sub_group_size,
                        facts=read_source_facts(ckpt, cache))
    return plan, run_reshard(plan, out, cache=cache, verify="full")


@pytest.mark.parametrize("fx", ZERO, ids=ids(ZERO))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_conversion_round_trip(fx, stage, tmp_path):
    """Every fixture written for every stage (at another world size), then read back: the same
    tensors, bit for bit, the layout the target stage has, and the input untouched."""
    before = tree_digest(fx.ckpt)
    world = fx.meta["dp_world_size"] % 4 + 1
    if fx.elastic and stage == 3:  # test_elastic_refusals
        with pytest.raises(UnsupportedCheckpointError, match="to ZeRO stage 3: its optimizer files keep"):
            convert(fx.ckpt, tmp_path / "out", world, stage)
        assert not (tmp_path / "out").exists() and tree_digest(fx.ckpt) == before
        return
    plan, result = convert(fx.ckpt, tmp_path / "out", world, stage)
    assert tree_digest(fx.ckpt) == before
    assert result.verified_tensors > 0
    back = read_checkpoint(tmp_path / "out")
    assert (back.zero_stage, back.dp_world_size, back.precision) == (stage, world, plan.precision)
    expected = fx.expected_fp32()
    for name, t in iter_tensors(back):
        assert torch.equal(t, expected[name]), name
    tag_dir = tmp_path / "out" / fx.meta["tag"]
    assert len(list(tag_dir.glob("*optim_states.pt"))) == world
    models = sorted(p.name for p in tag_dir.glob("*model_states.pt"))
    if stage == 3:
        assert models == [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    else:
        assert models == ["mp_rank_00_model_states.pt"]
    # Back to the source layout and size: the same tensors again.
    convert(tmp_path / "out", tmp_path / "back", fx.meta["dp_world_size"], fx.meta["stage"])
    for name, t in iter_tensors(read_checkpoint(tmp_path / "back")):
        assert torch.equal(t, expected[name]), name


def _tree(path: Path):
    return parsed_tree.materialize(safe_load.load(path))


def test_zero2_to_zero3_files_hold_what_deepspeed_writes(tmp_path):
    fx = next(f for f in ZERO if f.name == "s2_bf16_w2_2groups")
    plan, _ = convert(fx.ckpt, tmp_path / "out", 3, 3)
    tag_dir = tmp_path / "out" / fx.meta["tag"]
    ms = [_tree(tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(3)]
    osd = _tree(tag_dir / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert int(osd["zero_stage"]) == 3 and osd["partition_count"] == 3
    assert "clip_grad" not in osd and type(osd["loss_scaler"]).__name__ == "LossScaler"
    assert [g["params"] for g in osd["optimizer_state_dict"]["param_groups"]] == [[0], [1]]
    assert [g["weight_decay"] for g in osd["optimizer_state_dict"]["param_groups"]] == [0.01, 0.0]
    # embed 66 + fc1.weight 42 + fc2.weight 30 -> 22 + 14 + 10 per rank; biases/norms 7, 7, 7, 6 -> 3, 3, 3, 2
    assert [t.numel() for t in osd["fp32_flat_groups"]] == [46, 11]
    assert [t.ds_id for t in osd["fp32_flat_groups"]] == ["0_7", "2_8"]
    assert ms[0]["module"]["embed.weight"].shape == (0,) and ms[0]["module"]["embed.weight"].dtype == torch.bfloat16
    assert ms[0]["module"]["bn.running_mean"].shape == (7,)
    assert ms[0]["shared_params"] == {"head.weight": "embed.weight"} and ms[1]["shared_params"] == {}
    assert {k: v.numel() for k, v in ms[2]["frozen_param_fragments"].items()} == {"frozen.weight": 12,
                                                                                  "frozen.bias": 2}
    assert ms[0]["ds_config"]["zero_optimization"]["stage"] == 3
    assert [list(g) for g in ms[0]["param_shapes"]] == [["embed.weight", "fc1.weight", "fc2.weight"],
                                                        ["fc1.bias", "bn.weight", "bn.bias", "fc2.bias"]]
    assert plan.sub_group_size == 1_000_000_000


def test_zero3_to_zero1_module_is_rebuilt_from_the_master(tmp_path):
    fx = next(f for f in ZERO if f.name == "s3_bf16_w3_subgroups")
    convert(fx.ckpt, tmp_path / "out", 2, 1)
    tag_dir = tmp_path / "out" / fx.meta["tag"]
    ms = _tree(tag_dir / "mp_rank_00_model_states.pt")
    truth = fx.truth()
    assert list(ms["module"]) == list(_tree(fx.ckpt / fx.meta["tag"] / "zero_pp_rank_0_mp_rank_00_model_states.pt")
                                      ["module"])
    for name, t in ms["module"].items():
        want = truth[f"buffer/{name}"] if f"buffer/{name}" in truth else truth[f"lowp/{name}"]
        assert t.dtype == want.dtype and torch.equal(t, want), name  # DeepSpeed's 16-bit copy, bit for bit
    assert ms["frozen_param_fragments"] is None and ms["frozen_param_shapes"] is None  # stage 1 saves none
    osd = _tree(tag_dir / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    assert int(osd["zero_stage"]) == 1 and osd["partition_count"] == [2, 2] and "clip_grad" not in osd


def test_cli_reshard_zero_stage_says_what_the_config_needs(tmp_path):
    fx = next(f for f in ZERO if f.name == "s2_fp32_w4")
    runner = CliRunner()
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "o"), "-n", "2", "--zero-stage", "3",
                             "--sub-group-size", "40", "--dry-run"])
    assert r.exit_code == 1, r.output
    assert "to ZeRO stage 3 (DeepSpeedZeroOptimizer_Stage3)" in r.stdout
    assert 'resume with: "zero_optimization": {"stage": 3, "sub_group_size": 40}' in r.stdout
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "o"), "-n", "2", "--zero-stage", "3",
                             "--sub-group-size", "40", "-q"])
    assert r.exit_code == 0, r.output
    assert "from 4 to 2 ranks, ZeRO stage 2 -> 3: wrote 4 files" in r.stdout
    assert 'resume with: "zero_optimization": {"stage": 3, "sub_group_size": 40}' in r.stdout
    assert r.stderr == ""
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "p"), "-n", "2", "--zero-stage", "1",
                             "--sub-group-size", "40"])
    assert r.exit_code == 2 and "applies to a ZeRO-3 target only" in r.stderr
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "p"), "-n", "2", "--zero-stage", "0", "-q"])
    assert r.exit_code == 0 and "ZeRO stage 2 -> 0: wrote 1 files" in r.stdout, r.output
    assert 'resume with: "zero_optimization": {"stage": 0}' in r.stdout
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "q"), "-n", "2", "--zero-stage", "4"])
    assert r.exit_code == 2


def test_stage_and_universal_conversions_do_not_import_torch(tmp_path):
    """Stage changes and --universal (of a stage-0 save too) stream byte ranges like plain reshard (README); only a
    16-bit ZeRO-3 source written as ZeRO-1/2 casts its masters with torch."""
    fx = {f.name: f.ckpt for f in ZERO}
    s0 = Path(__file__).parent / "fixtures" / "s0_bf16_w2" / "ckpt"
    code = (
        "import sys\nfrom dsckpt.cli import main\n"
        "def run(*a):\n    try:\n        main(list(a))\n    except SystemExit as e:\n        assert e.code in (0, None), e.code\n"
        f"run('reshard', {str(fx['s2_bf16_w2_2groups'])!r}, {str(tmp_path / 'z3')!r}, '-n', '3', '--zero-stage', '3', '-q')\n"
        f"run('reshard', {str(fx['s3_bf16_w3_subgroups'])!r}, {str(tmp_path / 'z2')!r}, '-n', '2', '--zero-stage', '3', '-q')\n"
        f"run('reshard', {str(fx['s2_bf16_w2_2groups'])!r}, {str(tmp_path / 'u')!r}, '--universal', '-q')\n"
        f"run('reshard', {str(s0)!r}, {str(tmp_path / 'u0')!r}, '--universal', '-q')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        f"run('reshard', {str(fx['s3_bf16_w3_subgroups'])!r}, {str(tmp_path / 'z1')!r}, '-n', '2', '--zero-stage', '1', '-q')\n"
        "assert 'torch' in sys.modules\nprint('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("OK")


ZERO_TO_0 = [f for f in ZERO if not f.name.startswith(("ds0", "moe")) and not f.elastic  # test_elastic_refusals
             and not (f.meta["dtype"] == "fp32" and len(f.meta["param_groups"]) > 1)]


def _scaler_fields(tree) -> dict:
    """The loss scale a ZeRO optimizer file holds (its pickled LossScaler / DynamicLossScaler's fields)."""
    return dict(vars(tree["optimizer_state_dict"]["loss_scaler"]))


@pytest.mark.parametrize("fx", ZERO_TO_0, ids=ids(ZERO_TO_0))
def test_zero_to_stage0(fx, tmp_path):
    """ZeRO-1/2/3 -> stage 0: one model-states file with the full module and the stage-0 optimizer (fp32: a torch
    state dict over model.parameters(); bf16/fp16 with torch_adam: FP16_UnfusedOptimizer's fp32_groups), read back as
    the truth; an fp16 source's dynamic loss scale in the wrapper's fields."""
    _, result = convert(fx.ckpt, tmp_path / "out", 2, 0)
    assert result.verified_tensors > 0
    back = read_checkpoint(tmp_path / "out")
    assert (back.zero_stage, back.dp_world_size) == (0, 2)
    assert back.optimizer_wrapper == ("torch optimizer" if fx.meta["dtype"] == "fp32" else "FP16_UnfusedOptimizer")
    assert back.optimizer_step == int(fx.meta["optimizer_step"][0])
    assert sorted(p.name for p in (tmp_path / "out" / fx.meta["tag"]).iterdir()) == ["mp_rank_00_model_states.pt"]
    expected = fx.expected_fp32()
    got = dict(iter_tensors(back))
    assert sorted(got) == sorted(expected)
    for n, t in got.items():
        assert torch.equal(t, expected[n]), n
    if fx.meta["dtype"] == "fp16":
        opt = _tree(tmp_path / "out" / fx.meta["tag"] / "mp_rank_00_model_states.pt")["optimizer"]
        src = _scaler_fields(_tree(next((fx.ckpt / fx.meta["tag"]).glob("zero_pp_rank_0_*optim_states.pt"))))
        assert src["cur_scale"] == fx.meta["loss_scale"] == 256
        assert {k: opt[k] for k in ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter",
                                    "scale_factor", "scale_window")} == {
            "dynamic_loss_scale": True, **{k: src[k] for k in ("cur_scale", "cur_iter", "last_overflow_iter",
                                                               "scale_factor", "scale_window")}}


def test_zero_to_stage0_refusals(tmp_path):
    fx = next(f for f in all_fixtures() if f.name == "s2_fp32_w2_legacy")
    cache = FileCache()
    ckpt = read_checkpoint(fx.ckpt, cache=cache)
    # fp32 with two param groups: which group a frozen param was given to is not recorded
    from dsckpt.ds_writers.stage0 import plan_stage0_from_zero, stage0_refusal, stage0_wrapper

    two = [*fx.meta["trainable"][:2]], [*fx.meta["trainable"][2:]]
    assert "2 param groups and frozen params" in stage0_refusal(ckpt, [list(two[0]), list(two[1])], 2)
    with pytest.raises(UnsupportedCheckpointError, match="2 param groups"):
        plan_stage0_from_zero(ckpt, [list(two[0]), list(two[1])], {"world_size": 2})
    with pytest.raises(UsageError, match="--zero-stage must be 0, 1, 2 or 3"):
        plan_reshard(ckpt, 2, zero_stage=4)
    # 16-bit: FusedAdam (FP16_Optimizer) or not, from the ds_config, else from the param groups' keys
    fp16 = read_checkpoint(next(f for f in all_fixtures() if f.name == "s2_fp16_w2_cpuforced").ckpt)
    assert stage0_wrapper(fp16) == "FP16_UnfusedOptimizer"
    cfg = {**fp16.ds_config, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    assert stage0_wrapper(dataclasses.replace(fp16, ds_config=cfg)) == "FP16_Optimizer"
    no_opt = dataclasses.replace(fp16, ds_config={k: v for k, v in fp16.ds_config.items() if k != "optimizer"})
    assert stage0_wrapper(no_opt) == "FP16_UnfusedOptimizer"  # torch's AdamW groups hold 'foreach'
    bare = dataclasses.replace(no_opt, optimizer_groups=tuple(
        dataclasses.replace(g, hyperparams=tuple((k, v) for k, v in g.hyperparams if k != "foreach"))
        for g in fp16.optimizer_groups))
    with pytest.raises(UnsupportedCheckpointError, match="names no optimizer"):
        stage0_wrapper(bare)


STAGE0 = [f for f in all_fixtures() if f.meta["stage"] == 0 and not f.name.startswith(("moe", "ds0"))
          and f.meta.get("pp_size", 1) == 1]  # pipelines: ZeRO-1 only


@pytest.mark.parametrize("fx", STAGE0, ids=ids(STAGE0))
@pytest.mark.parametrize("world,stage", [(2, 1), (3, 2), (3, 3)])
def test_stage0_to_zero(fx, world, stage, tmp_path):
    """Stage 0 -> ZeRO-1/2/3 (fp32: the module is the master; bf16/fp16: FP16_UnfusedOptimizer's fp32_groups or
    FP16_Optimizer's fp32_groups_flat): the output holds the recorded masters, moments, module weights and
    buffers; its step and hyperparameters are the source's; fp16: the dynamic loss scale becomes ZeRO's
    DynamicLossScaler, with what the stage-0 wrapper saved and the rest from the fp16 config (DeepSpeed's defaults
    here), as DeepSpeed's own fp16 ZeRO files hold it (s2_fp16_w2_cpuforced)."""
    _, result = convert(fx.ckpt, tmp_path / "out", world, stage)
    assert result.verified_tensors > 0
    back = read_checkpoint(tmp_path / "out")
    assert (back.zero_stage, back.dp_world_size) == (stage, world)
    assert back.optimizer_step == int(fx.meta["optimizer_step"][0])
    expected = fx.expected_fp32()
    names = [n for n, t in iter_tensors(back) if torch.equal(t, expected[n])]
    assert sorted(names) == sorted(expected)
    optim = _tree(next((tmp_path / "out" / fx.meta["tag"]).glob("*zero_pp_rank_1_*optim_states.pt")))
    scaler = _scaler_fields(optim)
    if fx.meta["dtype"] == "fp16":
        zero_fp16 = next(f for f in ZERO if f.name == "s2_fp16_w2_cpuforced")
        want = _scaler_fields(_tree(zero_fp16.ckpt / zero_fp16.meta["tag"] / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
        assert scaler == want  # both runs: 3 steps from 2**8 without overflow
        assert type(optim["optimizer_state_dict"]["loss_scaler"]).__name__ == "DynamicLossScaler"
    else:
        assert scaler == {"cur_scale": 1.0, "dynamic": False}


STAGE0_16BIT = [f for f in STAGE0 if f.meta["dtype"] != "fp32"]


@pytest.mark.parametrize("fx", STAGE0_16BIT, ids=ids(STAGE0_16BIT))
@pytest.mark.parametrize("via", [2, 3])
def test_stage0_through_zero_and_back_is_the_same_file(fx, via, tmp_path):
    """Stage 0 (FP16_Optimizer or FP16_UnfusedOptimizer, fp16 or bf16) -> ZeRO-``via`` on 3 ranks -> stage 0 on the
    source's rank count gives back the model-states tree DeepSpeed wrote: every key in its order, every scalar (the
    loss scale, FusedAdam's int step), every tensor bit for bit, and the fused module's params as views into one
    flat 16-bit buffer per group at the recorded offsets."""
    convert(fx.ckpt, tmp_path / "zero", 3, via)
    convert(tmp_path / "zero", tmp_path / "back", fx.meta["dp_world_size"], 0)
    name = "mp_rank_00_model_states.pt"
    want, got = _tree(fx.ckpt / fx.meta["tag"] / name), _tree(tmp_path / "back" / fx.meta["tag"] / name)
    assert tree_differences(want, got) == []


# --- real DeepSpeed --------------------------------------------------------------------------------

# One launch per (target world size, target stage, sub_group_size): source fixture names. Together
# they cover every source -> target stage pair in fp32 and bf16 (and fp16 through the CPU-forced
# fixtures), BF16_Optimizer sources, two param groups, frozen and tied params, BatchNorm buffers,
# round robin and parameter alignment sources, ZeRO-3 sub-groups, and growing and shrinking.
DS_STAGE_CASES: dict[tuple[int, int, int | None], list[str]] = {
    (3, 3, None): ["s1_fp32_w2", "s2_bf16_w2_2groups", "s1_bf16_w2_bf16opt", "s2_bf16_w2_roundrobin",
                   "s2_fp16_w2_cpuforced"],
    (2, 3, 20): ["s2_fp32_w4", "s1_bf16_w3", "s2_fp32_w3_align", "s1_fp16_w3_cpuforced"],
    (3, 2, None): ["s3_bf16_w3_subgroups", "s1_fp32_w2", "s1_bf16_w2_bf16opt", "s3_fp32_w2", "s1_bf16_w3",
                   "s3_fp16_w2_cpuforced"],
    (4, 1, None): ["s3_fp32_w2", "s2_bf16_w2_2groups", "s3_bf16_w3_subgroups", "s2_fp32_w4",
                   "s2_fp16_w2_cpuforced"],
}
# Stage-0 sources (fp32: the module is the master; bf16 FP16_UnfusedOptimizer) and DeepSpeed universal folders
# (tests/fixtures/universal) as sources, loaded in the same launches (no fixture here needs a JIT-built op).
DS_STAGE_CASES[(3, 2, None)] += ["s0_fp32_w1", "s0_bf16_w2", "universal/s3_bf16_w3_subgroups"]
DS_STAGE_CASES[(3, 3, None)] += ["s0_fp32_w1_adapter_all", "universal/s1_bf16_w2_bf16opt"]
DS_STAGE_CASES[(4, 1, None)] += ["s0_bf16_w1_adapter", "universal/s2_bf16_w2_2groups"]
# ZeRO-1/2/3 -> stage 0 (fp32 one group: torch optimizer; bf16: FP16_UnfusedOptimizer)
DS_STAGE_CASES[(2, 0, None)] = ["s2_bf16_w2_2groups", "s1_fp32_w2", "s3_bf16_w3_subgroups"]


TAMPERED_CASE = (3, 3, None)  # its launch also loads a control whose exp_avg and exp_avg_sq were swapped on rank 0


def _write_tampered(out: Path) -> None:
    """s2_bf16_w2_2groups as ZeRO-3 on 3 ranks with rank 0's first sub-group exp_avg and exp_avg_sq
    swapped: the check script must report exactly that, or it could not see a wrong conversion."""
    cache = FileCache()
    ckpt = read_checkpoint(REPO / "tests" / "fixtures" / "s2_bf16_w2_2groups" / "ckpt", cache=cache)
    plan = plan_reshard(ckpt, 3, zero_stage=3, facts=read_source_facts(ckpt, cache))
    r0 = plan.ranks[0]
    specs = r0.groups[0].state_specs
    g0 = dataclasses.replace(r0.groups[0], states=(("exp_avg", specs["exp_avg_sq"]), ("exp_avg_sq", specs["exp_avg"])))
    r0 = dataclasses.replace(r0, groups=(g0, *r0.groups[1:]))
    run_reshard(dataclasses.replace(plan, ranks=(r0, *plan.ranks[1:])), out, cache=cache, verify="none")


@pytest.fixture(scope="module")
def ds_stage_runs(tmp_path_factory):
    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    base = tmp_path_factory.mktemp("ds_stage")
    known = {f.name for f in all_fixtures()}
    runs = {}
    for (world, stage, sub), names in DS_STAGE_CASES.items():
        pairs = []
        for source in names:
            name = source.removeprefix("universal/")
            if name not in known:
                continue
            out = base / f"{source.replace('/', '_')}_to{world}_s{stage}"
            convert(REPO / "tests" / "fixtures" / source / "ckpt", out, world, stage, sub)
            pairs.append(f"{name}={out}")
        if (world, stage, sub) == TAMPERED_CASE and "s2_bf16_w2_2groups" in known:
            _write_tampered(base / "tampered")
            pairs.append(f"s2_bf16_w2_2groups={base / 'tampered'}")
        args = ["--zero-stage", str(stage), *(("--sub-group-size", str(sub)) if sub else ()),
                *(["--force-cpu-fp16"] if any("fp16" in p for p in pairs) else [])]
        cwd = base / f"to{world}_s{stage}_sub{sub}"
        cwd.mkdir()
        runs[(world, stage, sub)] = run_check_script("ds_reshard_check.py", pairs, args=args, world=world, cwd=cwd,
                                                     timeout=900)
    return runs


@pytest.mark.live
@pytest.mark.deepspeed
@pytest.mark.parametrize("case", sorted(DS_STAGE_CASES, key=str),
                         ids=lambda c: f"to{c[0]}ranks_stage{c[1]}" + (f"_sub{c[2]}" if c[2] else ""))
def test_deepspeed_resumes_stage_converted_checkpoints(ds_stage_runs, case):
    rc, results, log = ds_stage_runs[case]
    results, control = passed_except_controls(results, log)
    if case == TAMPERED_CASE:
        assert len(control) == 1 and not control[0]["ok"], log
        assert {p.split(": ", 1)[1] for p in control[0]["problems"]} == {
            f"{k} of '{n}' differs from the source (fragment API)"
            for k in ("exp_avg", "exp_avg_sq") for n in ("embed.weight", "fc1.weight", "fc2.weight")}
        assert rc == 1, log
    else:
        assert rc == 0, log
    assert {r["fixture"] for r in results} == ({n.removeprefix("universal/") for n in DS_STAGE_CASES[case]}
                                               & {f.name for f in all_fixtures()})
    assert all(r["world_size"] == case[0] for r in results)


# --- fp16 stage 0 <-> ZeRO (and the fused FP16_Optimizer target), real DeepSpeed: one launch on 2 ranks ----------
# (fixture, target stage, stage passed through on the way or None). The check script runs each pair at its own
# target stage (FIXTURE@STAGE=DIR), fp16 forced on the CPU ranks as the *_cpuforced fixtures were made, and compares
# the loss scaler's whole state (--scale-state) besides masters, moments, module, buffers and counters.
FP16_STAGE_CASES = [
    ("s0_fp16_w1_adapter_cpuforced", 2, None),  # FP16_UnfusedOptimizer -> ZeRO-2
    ("s0_fp16_w1_bnoverflow", 3, None),  # FP16_UnfusedOptimizer (made on a GPU, BN inf) -> ZeRO-3
    ("s1_fp16_w3_cpuforced", 0, None),  # ZeRO-1 -> FP16_UnfusedOptimizer
    ("s3_fp16_w2_cpuforced", 0, None),  # ZeRO-3 -> FP16_UnfusedOptimizer
]
# FusedAdam: the stage-0 FP16_Optimizer, and FusedAdam inside ZeRO. DeepSpeed JIT-builds its CPU fused_adam op on
# first use (minutes on a 2-core machine), so these run where the op is built, or with DSCKPT_JIT_LIVE=1.
FP16_FUSED_CASES = [
    ("s0_fp16_w1_adapter_fused_cpuforced", 1, None),  # FP16_Optimizer -> ZeRO-1
    ("s0_fp16_w1_fused", 0, 3),  # FP16_Optimizer (made on a GPU) -> ZeRO-3 -> FP16_Optimizer
    ("s0_bf16_w1_adapter_fused", 0, 2),  # bf16 FP16_Optimizer -> ZeRO-2 -> FP16_Optimizer
]
FP16_TAMPERED = "s2_fp16_w2_cpuforced"  # -> stage 0 with cur_scale 128 and cur_iter 2: the check must see both


def _write_fp16_scale_tampered(out: Path) -> None:
    convert(REPO / "tests" / "fixtures" / FP16_TAMPERED / "ckpt", out, 2, 0)
    path = next(out.glob("*/mp_rank_00_model_states.pt"))
    tree = torch.load(path, weights_only=False)  # a control written by this test: trusted
    tree["optimizer"].update(cur_scale=128, cur_iter=2)
    torch.save(tree, path)


@pytest.fixture(scope="module")
def ds_fp16_stage_run(tmp_path_factory):
    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    base = tmp_path_factory.mktemp("ds_fp16_stage")
    cases = FP16_STAGE_CASES + (FP16_FUSED_CASES if jit_op_built("fused_adam") else [])
    pairs = []
    for name, stage, via in cases:
        src = REPO / "tests" / "fixtures" / name / "ckpt"
        if via is not None:
            convert(src, base / f"{name}_via{via}", 3, via)
            src = base / f"{name}_via{via}"
        convert(src, base / f"{name}_s{stage}", 2, stage)
        pairs.append(f"{name}@{stage}={base / f'{name}_s{stage}'}")
    _write_fp16_scale_tampered(base / "tampered")
    pairs.append(f"{FP16_TAMPERED}@0={base / 'tampered'}")
    return cases, run_check_script("ds_reshard_check.py", pairs, args=["--force-cpu-fp16", "--scale-state"], world=2,
                                   cwd=base, timeout=1500)


@pytest.mark.live
@pytest.mark.deepspeed
def test_deepspeed_resumes_fp16_stage_changes(ds_fp16_stage_run):
    """fp16 stage 0 <-> ZeRO: DeepSpeed's plain load_checkpoint at the new stage restores the fp32 masters, Adam
    moments and step, module weights, buffers, counters and the whole loss-scaler state exactly, and one more step
    runs; the control with a tampered loss scale fails on exactly that."""
    cases, (rc, results, log) = ds_fp16_stage_run
    results, control = passed_except_controls(results, log)
    assert len(control) == 1 and not control[0]["ok"], log
    assert sorted({p.split(": ", 1)[1] for p in control[0]["problems"]}) == [
        "loss scale 128.0 != 256.0",
        "loss scaler state {'cur_iter': 2, 'last_overflow_iter': -1, 'scale_window': 1000, 'scale_factor': 2.0, "
        "'dynamic': True} != {'cur_iter': 3, 'last_overflow_iter': -1, 'scale_window': 1000, 'scale_factor': 2.0, "
        "'dynamic': True}"], control[0]["problems"]
    assert rc == 1, log
    assert [r["fixture"] for r in results] == [f"{n}@{s}" for n, s, _ in cases]
    if not any(n == FP16_FUSED_CASES[0][0] for n, _, _ in cases):
        pytest.skip("the FusedAdam cases need DeepSpeed's CPU fused_adam op built (DSCKPT_JIT_LIVE=1 builds it); "
                    "the others passed")
