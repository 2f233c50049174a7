"""``dsckpt to-dcp``: a DeepSpeed checkpoint as a PyTorch distributed checkpoint (issue 33).

Default tier: for each fixture family, to-dcp, then one plain process loads OUT as a resuming job does
(``dcp.load`` + ``set_state_dict`` into a freshly built model and optimizer, tests/dcp_check.py) and every param,
buffer, moment, step and group hyper-parameter is compared with the fixture's recorded truth, exactly.
Live tier: FSDP2 (``fully_shard``) on 2 CPU ranks loads OUT of several fixtures and trains one more step
(tests/dcp_fsdp_check.py, one torchrun launch).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import dcp_check
import pytest
from click.testing import CliRunner
from conftest import FIXTURES, tree_digest
from ds_launch import free_port

from dsckpt.checkpoint import open_checkpoint
from dsckpt.cli import main
from dsckpt.dcp_writer import plan_to_dcp, run_to_dcp

#: One fixture per family: every ZeRO stage, fp32 / bf16 / fp16, BF16_Optimizer, stage-0 wrappers, two param
#: groups, round-robin, sub-groups, odd DP sizes; the tied embed/head and frozen Linear are in every one.
FAMILIES = [
    "s0_fp32_w1",  # stage 0, plain torch AdamW
    "s0_bf16_w2",  # stage 0, FP16_UnfusedOptimizer (bf16)
    "s0_fp16_w1_bnoverflow",  # stage 0 fp16 (GPU-written), BN running_var inf
    "s1_fp32_w2",
    "s1_bf16_w3",
    "s1_bf16_w2_bf16opt",  # BF16_Optimizer
    "s1_fp16_w3_cpuforced",
    "s2_fp32_w4",
    "s2_bf16_w2_2groups",  # two HF-style groups (weight decay 0.01 / 0.0)
    "s2_bf16_w2_roundrobin",
    "s2_fp16_w2_cpuforced",
    "s3_fp32_w2",
    "s3_bf16_w3_subgroups",
    "s3_fp16_w2_cpuforced",
]


def _to_dcp(name: str, out: Path) -> None:
    c = open_checkpoint(FIXTURES / name / "ckpt", check_master_copies=True)
    run_to_dcp(plan_to_dcp(c.logical, out), c.cache)


@pytest.mark.parametrize("name", FAMILIES, ids=FAMILIES)
def test_plain_process_resumes_with_the_recorded_truth(name: str, tmp_path: Path) -> None:
    before = tree_digest(FIXTURES / name / "ckpt")
    out = tmp_path / "dcp"
    _to_dcp(name, out)
    assert (out / ".metadata").is_file()
    model, opt = dcp_check.build(name)
    groups = dcp_check.group_truth(opt)
    dcp_check.load(model, opt, out)
    assert dcp_check.compare(name, model, opt, groups) == []
    dcp_check.one_more_step(name, model, opt)  # the loaded state trains
    assert tree_digest(FIXTURES / name / "ckpt") == before


#: Families whose module is not built in one plain process (a PipelineModule, DeepSpeed's MoE layer, AutoEP's
#: engine, a Megatron-style TP x pipeline net): OUT is loaded with dcp.load + set_state_dict into a module of the
#: recorded names and shapes (tests/dcp_check.py ``build_from_truth``) and compared with the recorded truth.
RECORDED = [
    "pp2_fp32",  # pipeline, 2 stages: one optimizer per stage, group 0 of both merged
    "pp2_bf16",
    "pp2_dp2_fp32",
    "moe_s2_bf16_w2_ep2",  # native MoE: dense group + expert group under global expert names
    "moe_s1_bf16_w4_ep2",
    "moe_s0_fp32_w2_ep2",  # native MoE without ZeRO: every EP rank's torch optimizer, one group set
    "moe_s0_bf16_w2_ep2",  # the same in bf16: FP16_UnfusedOptimizer's fp32 masters (fp32_groups) per EP rank
    "moe_s0_bf16_w2_ep2_fused",  # and with FusedAdam: FP16_Optimizer's flat fp32 master per group
    "autoep/autoep_mixtral_z2_fp32_ep2_dp2",  # AutoEP: the HF model's names (gate_up_proj fused, gate)
    "autoep/autoep_qwen3_z3_fp32_ep2_dp2",
    "tp_pipeline/megatron_pp2_tp2_z1_fp32",  # TP 2 x pipeline 2, DeepSpeed's merge as truth
    "tp_pipeline/megatron_pp2_tp2_z1_bf16_bf16opt",  # the same with BF16_Optimizer (padded flat groups)
]


@pytest.mark.parametrize("name", RECORDED, ids=[n.rsplit("/", 1)[-1] for n in RECORDED])
def test_other_layouts_resume_with_the_recorded_truth(name: str, tmp_path: Path) -> None:
    """Pipeline, native-MoE, AutoEP and TP x pipeline runs: to-dcp, one plain process loads OUT (dcp.load +
    set_state_dict), every value, moment, step and group equals the recorded truth exactly, and ``dsckpt diff CKPT
    OUT`` reports equal."""
    out = tmp_path / "dcp"
    _to_dcp(name, out)
    truth = dcp_check.recorded_truth(name)
    model, opt = dcp_check.build_from_truth(truth)
    groups = dcp_check.group_truth(opt)
    dcp_check.load(model, opt, out)
    assert dcp_check.compare_with_truth(truth, model, opt, groups) == []
    r = CliRunner().invoke(main, ["diff", str(FIXTURES / name / "ckpt"), str(out)])
    assert r.exit_code == 0 and "equal:" in r.stdout, r.output


def test_recorded_truth_comparison_is_not_blind(tmp_path: Path) -> None:
    """An AutoEP output whose fused gate_up_proj exp_avg is its exp_avg_sq, and a pipeline output with the wrong step,
    each fail the comparison with the recorded truth."""
    for name, key, want in (("autoep/autoep_mixtral_z2_fp32_ep2_dp2", "model.layers.1.mlp.experts.gate_up_proj",
                             "optim: model.layers.1.mlp.experts.gate_up_proj.exp_avg differs"),
                            ("pp2_fp32", None, "optim: 1.weight.step is tensor(2.), truth 3.0")):
        c = open_checkpoint(FIXTURES / name / "ckpt", check_master_copies=True)
        plan = plan_to_dcp(c.logical, tmp_path / "x")
        by_fqn = {t.fqn: t for t in plan.tensors}
        if key is not None:
            ea, eas = by_fqn[f"optim.state.{key}.exp_avg"], by_fqn[f"optim.state.{key}.exp_avg_sq"]
            tensors = tuple(dataclasses.replace(t, piece=eas.piece) if t is ea else t for t in plan.tensors)
        else:
            tensors = tuple(dataclasses.replace(t, value=2.0) if t.value is not None else t for t in plan.tensors)
        out = tmp_path / name.replace("/", "_")
        run_to_dcp(dataclasses.replace(plan, tensors=tensors, output=out), c.cache)
        truth = dcp_check.recorded_truth(name)
        model, opt = dcp_check.build_from_truth(truth)
        groups = dcp_check.group_truth(opt)
        dcp_check.load(model, opt, out)
        assert want in dcp_check.compare_with_truth(truth, model, opt, groups)


def test_pipeline_stages_with_different_groups_are_refused_by_name(tmp_path: Path) -> None:
    """DeepSpeed keeps one optimizer per pipeline stage; to-dcp merges group g of every stage into DCP group g only
    where the stages agree on the group's hyper-parameters and step, and names the first disagreement otherwise."""
    from dsckpt.errors import UnsupportedCheckpointError
    from dsckpt.readers.common import merge_stage_groups

    ckpt = open_checkpoint(FIXTURES / "pp2_fp32" / "ckpt").logical
    assert ckpt.pipeline is not None
    s0, s1 = ckpt.pipeline.stage_optimizer_groups
    assert [g.param_names for g in ckpt.optimizer_groups] == [s0[0].param_names + tuple(
        n for n in s1[0].param_names if n not in s0[0].param_names)]
    lr = tuple((k, 0.5 if k == "lr" else v) for k, v in s1[0].hyperparams)
    bad = (s0, (dataclasses.replace(s1[0], hyperparams=lr),))
    assert merge_stage_groups(bad)[1] == "param group 0 has lr=0.5 on stage 1 but 0.01 on stage 0"
    tampered = dataclasses.replace(ckpt, optimizer_groups=(),
                                   pipeline=dataclasses.replace(ckpt.pipeline, stage_optimizer_groups=bad))
    with pytest.raises(UnsupportedCheckpointError, match="lr=0.5 on stage 1 but 0.01 on stage 0"):
        plan_to_dcp(tampered, tmp_path / "x")


def test_tampered_output_is_caught(tmp_path: Path) -> None:
    """The comparison is not blind: an output with fc1.weight's exp_avg_sq written as its exp_avg, and one with a
    wrong step and learning rate, each fail it."""
    name = "s2_bf16_w2_2groups"
    c = open_checkpoint(FIXTURES / name / "ckpt", check_master_copies=True)
    plan = plan_to_dcp(c.logical, tmp_path / "x")
    by_fqn = {t.fqn: t for t in plan.tensors}
    ea, eas = by_fqn["optim.state.fc1.weight.exp_avg"], by_fqn["optim.state.fc1.weight.exp_avg_sq"]
    swapped = tuple(dataclasses.replace(t, piece=eas.piece) if t is ea else t for t in plan.tensors)
    run_to_dcp(dataclasses.replace(plan, tensors=swapped, output=tmp_path / "swapped"), c.cache)
    stepped = tuple(dataclasses.replace(t, value=2.0) if t.value is not None else t for t in plan.tensors)
    groups = (dataclasses.replace(plan.groups[0], hyperparams=tuple(
        (k, 0.5 if k == "lr" else v) for k, v in plan.groups[0].hyperparams)), *plan.groups[1:])
    run_to_dcp(dataclasses.replace(plan, tensors=stepped, groups=groups, output=tmp_path / "stepped"), c.cache)
    model, opt = dcp_check.build(name)
    truth_groups = dcp_check.group_truth(opt)
    dcp_check.load(model, opt, tmp_path / "swapped")
    assert dcp_check.compare(name, model, opt, truth_groups) == ["optim: fc1.weight.exp_avg differs"]
    model, opt = dcp_check.build(name)
    dcp_check.load(model, opt, tmp_path / "stepped")
    bad = dcp_check.compare(name, model, opt, truth_groups)
    assert any("step is tensor(2.)" in b for b in bad) and any("group 0 hyper-parameters differ" in b for b in bad)


def test_output_layout_and_groups(tmp_path: Path) -> None:
    """O as get_optimizer_state_dict() lists it: the tied head.weight in M but not in O, step a 0-dim float32,
    one group per DeepSpeed group, AdamW (decoupled_weight_decay True) with DeepSpeed's weight decays."""
    import torch
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "dcp"
    _to_dcp("s2_bf16_w2_2groups", out)
    md = dcp.FileSystemReader(str(out)).read_metadata()
    keys = set(md.state_dict_metadata)
    assert {"model.head.weight", "model.embed.weight", "model.bn.num_batches_tracked"} <= keys
    assert "optim.state.head.weight.exp_avg" not in keys and "optim.state.embed.weight.exp_avg" in keys
    assert md.state_dict_metadata["optim.state.fc1.weight.step"].size == torch.Size([])
    assert md.state_dict_metadata["model.frozen.weight"].properties.dtype == torch.bfloat16  # as saved
    assert md.state_dict_metadata["model.fc1.weight"].properties.dtype == torch.float32  # the master
    sd = {"optim": {"param_groups": [{"params": None, "decoupled_weight_decay": None, "weight_decay": None}
                                     for _ in range(2)]}}
    dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    groups = sd["optim"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    assert [g["decoupled_weight_decay"] for g in groups] == [True, True]
    assert groups[0]["params"] == ["embed.weight", "fc1.weight", "fc2.weight"]


def test_cli(tmp_path: Path) -> None:
    ckpt = str(FIXTURES / "s3_fp32_w2" / "ckpt")
    out = tmp_path / "dcp"
    r = CliRunner().invoke(main, ["to-dcp", ckpt, str(out), "--dry-run"])
    assert r.exit_code == 1, r.output
    assert "would write 13 model tensors, 21 optimizer state tensors (AdamW, 1 param group)" in r.stdout
    r = CliRunner().invoke(main, ["to-dcp", ckpt, str(out)])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("wrote 13 model tensors, 21 optimizer state tensors (AdamW, 1 param group)")
    r = CliRunner().invoke(main, ["to-dcp", ckpt, str(out)])
    assert r.exit_code == 2 and "exists" in r.stderr


# --------------------------------------------------------------------------------------------
# live: FSDP2 on 2 CPU ranks

LIVE = ["s1_bf16_w3", "s2_bf16_w2_2groups", "s3_fp32_w2", "s0_bf16_w2"]


@pytest.mark.live
def test_fsdp2_resumes_on_two_cpu_ranks(tmp_path: Path) -> None:
    """One torchrun launch, 2 gloo ranks: for each fixture, FSDP2 ``fully_shard`` loads OUT through
    dcp.load + set_state_dict, every gathered value equals the recorded truth exactly, and one more step runs
    and gives the same loss on both ranks as the plain process (tolerance: 1e-6 relative, reduction order)."""
    for name in LIVE:
        _to_dcp(name, tmp_path / name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent),
                                                        os.environ.get("PYTHONPATH", "")]))
    torchrun = Path(sys.executable).with_name("torchrun")
    r = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()),
                        str(Path(__file__).parent / "dcp_fsdp_check.py"), str(tmp_path), *LIVE],
                       env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    for name in LIVE:
        assert f"{name}: ok" in r.stdout, r.stdout


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD", "Adagrad", "RMSprop"])
def test_group_defaults_read_from_signatures_are_the_optimizers_own(name: str) -> None:
    """to-dcp fills a key the save lacks with torch's default, read from the class's signature (building an
    optimizer imports torch._dynamo); the result is exactly the group a built one holds."""
    import torch

    from dsckpt.dcp_writer import _class_defaults

    built = getattr(torch.optim, name)([torch.nn.Parameter(torch.zeros(1))]).param_groups[0]
    assert _class_defaults(name) == {k: v for k, v in built.items() if k != "params"}


@pytest.mark.live
def test_distributed_writes_what_one_process_writes(tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 dsckpt to-dcp ... --distributed``: DCP's planner spreads the tensors over both
    ranks (each writes its own files), rank 0 writes .metadata; the folder holds the same keys, shapes and values as
    the one-process output."""
    import torch.distributed.checkpoint as dcp

    name = "s2_bf16_w2_2groups"
    one, two = tmp_path / "one", tmp_path / "two"
    _to_dcp(name, one)
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent.parent),
                                                        os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), "--no-python",
                        str(Path(sys.executable).with_name("dsckpt")), "to-dcp", "-q",
                        str(FIXTURES / name / "ckpt"), str(two), "--distributed"],
                       env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert {p.name.split("_")[2] for p in two.glob("__*.distcp")} == {"0", "1"}  # __{rank}_{n}.distcp: both wrote
    md1 = dcp.FileSystemReader(str(one)).read_metadata().state_dict_metadata
    md2 = dcp.FileSystemReader(str(two)).read_metadata().state_dict_metadata
    assert md1.keys() == md2.keys()
    model, opt = dcp_check.build(name)
    groups = dcp_check.group_truth(opt)
    dcp_check.load(model, opt, two)
    assert dcp_check.compare(name, model, opt, groups) == []
