"""``to-dcp`` of Trainer ``checkpoint-N/`` and Accelerate ``save_state`` folders (issue 33 item 2): OUT is the folder
the same client resumes from under FSDP2 (``pytorch_model_fsdp_0/`` = ``{"model": M}``, ``optimizer_0/`` =
``{"optimizer": O}``, the scheduler, RNG and trainer-state files, the model-side files).

Default tier: the folder layout, the carried files byte for byte, ``scheduler.pt`` against the LR-scheduler state
DeepSpeed saved, and the DCP contents against the fixtures' recorded truth through a plain ``dcp.load``; the pure
regrouping. Live tier: the real Trainer (transformers 5.23) and ``accelerator.load_state`` (accelerate 1.15) resume
OUT under FSDP2 on 2 CPU ranks (tests/fsdp_cpu.py says what that takes), with a tampered control.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import FIXTURES
from ds_launch import DEEPSPEED, REPO, free_port, run_deepspeed, run_in_session

from dsckpt.checkpoint import open_checkpoint
from dsckpt.cli import main
from dsckpt.dcp_writer import DcpGroup
from dsckpt.errors import UnsupportedCheckpointError
from dsckpt.run_folder_dcp import (
    RunFolderClient,
    plan_run_folder_dcp,
    regroup,
    regroup_scheduler_state,
    run_folder_client,
    run_run_folder_dcp,
)

LLAMA = FIXTURES / "hf_llama_z2_bf16_w2"
GPT2 = FIXTURES / "hf_gpt2_z3_bf16_w2"
ACC = FIXTURES / "accelerate_s2_bf16_w2"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _cli(*argv: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(argv))
    return r.exit_code, r.stdout, r.stderr


def _llama_trainer_groups() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The groups transformers 5.23's ``Trainer.create_optimizer`` builds for the Llama fixture under FSDP2 (seen in
    a real FSDP2 save): the norm weights (``get_decay_parameter_names`` leaves out ``*layernorm*`` / ``norm``) in
    the second; the frozen tied embeddings in neither. Written out here so that the default tier needs no
    transformers import (``trainer_param_groups`` is run by the CLI in the live tier)."""
    trained = json.loads((LLAMA / "truth.json").read_text())["trainable"]
    trained = [n for n in trained if n != "lm_head.weight"]
    no_decay = tuple(n for n in trained if "norm" in n)
    return tuple(n for n in trained if n not in no_decay), no_decay


def _dcp_load(folder: Path) -> dict:
    """Every item of a DCP folder, as a plain nested dict (one process)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = folder.parent / f"{folder.name}.pt"
    dcp_to_torch_save(folder, target)
    return torch.load(target, weights_only=False)


def _truth(fixture: Path) -> dict:
    from safetensors.torch import load_file

    name = "truth.safetensors" if (fixture / "truth.safetensors").exists() else "truth_fp32.safetensors"
    return load_file(fixture / name)


@pytest.fixture(scope="module")
def llama_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("llama") / "checkpoint-3-fsdp"
    c = open_checkpoint(LLAMA / "ckpt", check_master_copies=True)
    plan = plan_run_folder_dcp(c.logical, c.cache, out, client=RunFolderClient.TRAINER,
                               target_groups=_llama_trainer_groups())
    run_run_folder_dcp(plan, c.cache)
    return out


def test_clients_are_told_apart():
    assert run_folder_client(LLAMA / "ckpt") is RunFolderClient.TRAINER
    assert run_folder_client(ACC / "state") is RunFolderClient.ACCELERATE
    assert run_folder_client(FIXTURES / "s1_fp32_w2" / "ckpt") is None


def test_trainer_folder_layout_and_carried_files(llama_out: Path):
    src = LLAMA / "ckpt"
    carried = ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "rng_state_0.pth",
               "rng_state_1.pth", "tokenizer.json", "tokenizer_config.json", "trainer_state.json", "training_args.bin"]
    assert sorted(p.name for p in llama_out.iterdir()) == sorted(
        [*carried, "optimizer_0", "pytorch_model_fsdp_0", "scheduler.pt"])
    for name in carried:
        assert (llama_out / name).read_bytes() == (src / name).read_bytes(), name
    assert (llama_out / "pytorch_model_fsdp_0" / ".metadata").is_file()
    assert (llama_out / "optimizer_0" / ".metadata").is_file()


def test_trainer_scheduler_is_deepspeeds_regrouped_and_loads_weights_only(llama_out: Path):
    import torch

    c = open_checkpoint(LLAMA / "ckpt")
    saved = c.cache.tree(LLAMA / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt")["lr_scheduler"]
    got = torch.load(llama_out / "scheduler.pt", weights_only=True)  # as the Trainer loads it
    assert saved["base_lrs"] == [0.01] and saved["_last_lr"] == [0.005]  # DeepSpeed's one group
    assert got == {**saved, "base_lrs": [0.01, 0.01], "_last_lr": [0.005, 0.005], "lr_lambdas": [{}, {}]}


def test_trainer_dcp_folders_hold_the_truth(llama_out: Path):
    import torch

    truth, meta = _truth(LLAMA), json.loads((LLAMA / "truth.json").read_text())
    model = _dcp_load(llama_out / "pytorch_model_fsdp_0")
    assert list(model) == ["model"]  # save_fsdp_model's {"model": sd}
    assert list(model["model"]) == meta["state_dict_names"]  # lm_head.weight (tied) included, as FSDP2 saves it
    for n, t in model["model"].items():  # trained params: DeepSpeed's fp32 masters; frozen ones as saved (bf16)
        assert t.dtype == (torch.float32 if n in meta["trainable"] else torch.bfloat16), n
        assert torch.equal(t.float(), truth[f"param/{n}"]), n
    optim = _dcp_load(llama_out / "optimizer_0")["optimizer"]  # save_fsdp_optimizer's {"optimizer": osd}
    trained = [n for n in meta["trainable"] if n not in meta["tied"]]
    assert sorted(optim["state"]) == sorted(trained)
    for n in trained:
        st = optim["state"][n]
        assert float(st["step"]) == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key], truth[f"{key}/{n}"]), (key, n)
    decay, no_decay = _llama_trainer_groups()
    assert [g["params"] for g in optim["param_groups"]] == [list(decay), list(no_decay)]
    # both with DeepSpeed's hyper-parameters: the norms keep the weight decay they were trained with
    assert [(g["weight_decay"], g["lr"], g["initial_lr"]) for g in optim["param_groups"]] == [(0.01, 0.005, 0.01)] * 2
    # a control: one moment shifted is told apart by the same comparison
    shifted = optim["state"][no_decay[0]]["exp_avg"].clone()
    shifted[0] += 1e-3
    assert not torch.equal(shifted, truth[f"exp_avg/{no_decay[0]}"])


def test_accelerate_folder_keeps_deepspeeds_groups_and_carries_its_files(tmp_path: Path):
    import torch

    src, out = ACC / "state", tmp_path / "state-fsdp"
    code, stdout, _ = _cli("to-dcp", "-q", str(src), str(out))
    assert code == 0, stdout
    assert stdout.startswith(f"wrote 13 model tensors, 21 optimizer state tensors (AdamW, 1 param group), 2.4 KB, to "
                             f"{out} (Accelerate FSDP2 folder:")
    carried = ["custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*carried, "optimizer_0", "pytorch_model_fsdp_0"])
    for name in carried:
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    truth = _truth(ACC)
    record = json.loads((ACC / "record.json").read_text())
    model = _dcp_load(out / "pytorch_model_fsdp_0")["model"]
    optim = _dcp_load(out / "optimizer_0")["optimizer"]
    for n in record["trainable"]:
        assert torch.equal(model[n], truth[f"param/{n}"]), n
        assert float(optim["state"][n]["step"]) == record["global_steps"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optim["state"][n][key], truth[f"{key}/{n}"]), (key, n)
    assert [g["params"] for g in optim["param_groups"]] == [record["trainable"]]


def test_plain_and_dry_run(tmp_path: Path):
    src = str(ACC / "state")
    code, stdout, _ = _cli("to-dcp", "--dry-run", src, str(tmp_path / "o"))
    assert code == 1 and not (tmp_path / "o").exists()
    assert "as an Accelerate FSDP2 folder" in stdout and "  pytorch_model_fsdp_0/: 13 tensors" in stdout
    assert "  copy scheduler.bin" in stdout
    code, _, _ = _cli("to-dcp", "-q", "--plain", src, str(tmp_path / "plain"))
    assert code == 0 and (tmp_path / "plain" / ".metadata").is_file()  # one {"model", "optim"} folder


def _groups(*params: tuple[str, ...], wd: tuple[float, ...] = ()) -> tuple[DcpGroup, ...]:
    return tuple(DcpGroup(i, p, (("lr", 0.1), ("weight_decay", wd[i] if wd else 0.01))) for i, p in enumerate(params))


def test_regroup_maps_each_new_group_to_its_source():
    groups, sources = regroup(_groups(("a", "b", "c")), (("a", "c"), ("b",), ()), "ckpt")
    assert [(g.index, g.params) for g in groups] == [(0, ("a", "c")), (1, ("b",)), (2, ())]
    assert all(g.hyperparams == (("lr", 0.1), ("weight_decay", 0.01)) for g in groups) and sources == (0, 0, 0)
    groups, sources = regroup(_groups(("a",), ("b",), wd=(0.01, 0.0)), (("b",), ("a",)), "ckpt")
    assert sources == (1, 0) and dict(groups[0].hyperparams)["weight_decay"] == 0.0
    state = {"base_lrs": [1.0, 2.0], "_last_lr": [0.5, 1.5], "last_epoch": 3, "lr_lambdas": [None, None]}
    assert regroup_scheduler_state(state, 2, sources) == {
        "base_lrs": [2.0, 1.0], "_last_lr": [1.5, 0.5], "last_epoch": 3, "lr_lambdas": [None, None]}


@pytest.mark.parametrize("target,match", [
    ((("a",),), r"trained in the checkpoint but in no group of the resuming optimizer: b"),
    ((("a", "b", "x"),), r"in the resuming optimizer but not trained in the checkpoint: x"),
    ((("a", "b"), ("b",)), r"in two groups of the resuming optimizer: b"),
], ids=["missing", "extra", "doubled"])
def test_regroup_refuses_another_set_of_params(target, match):
    with pytest.raises(UnsupportedCheckpointError, match=match):
        regroup(_groups(("a", "b")), target, "ckpt")


def test_regroup_refuses_to_merge_groups_that_differ():
    with pytest.raises(UnsupportedCheckpointError, match=r"param group 0 holds params of DeepSpeed's groups 0 and 1, "
                                                         r"which differ in weight_decay"):
        regroup(_groups(("a",), ("b",), wd=(0.01, 0.0)), (("a", "b"),), "ckpt")


def test_an_accelerate_folder_of_several_models_is_refused(tmp_path: Path):
    """save_state of two prepared models writes the tags pytorch_model and pytorch_model_1 (hand-built here by
    copying the tag): one FSDP2 folder cannot hold both, so it is refused, naming --plain."""
    src = tmp_path / "state"
    shutil.copytree(ACC / "state", src)
    shutil.copytree(src / "pytorch_model", src / "pytorch_model_1")
    code, _, stderr = _cli("to-dcp", "-q", str(src), str(tmp_path / "o"))
    assert code == 3 and "holds 2 DeepSpeed tags (pytorch_model, pytorch_model_1): several prepared models" in stderr
    assert "--plain --tag TAG" in stderr and not (tmp_path / "o").exists()


def test_a_deepspeed_config_scheduler_is_refused(tmp_path: Path):
    """A Trainer folder whose scheduler state is not a torch LR scheduler's (hand-built: a DeepSpeed WarmupLR state
    as scheduler.pt) is refused before anything is written."""
    import torch

    src = tmp_path / "checkpoint-3"
    shutil.copytree(LLAMA / "ckpt", src)
    torch.save({"last_batch_iteration": 3}, src / "scheduler.pt")
    c = open_checkpoint(src)
    with pytest.raises(UnsupportedCheckpointError, match=r"scheduler.pt': the LR-scheduler state \(last_batch_"
                                                         r"iteration\) is not a torch.optim.lr_scheduler one"):
        plan_run_folder_dcp(c.logical, c.cache, tmp_path / "o", client=RunFolderClient.TRAINER,
                            target_groups=_llama_trainer_groups())
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------
# live: the real clients resume OUT under FSDP2 on 2 CPU ranks


def _bf16_spacing(x: float) -> float:
    """The distance between neighbouring bf16 values around ``x`` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


def _tamper_moment(src: Path, dst: Path, fqn: str) -> None:
    """``dst``: a copy of the run folder ``src`` whose ``optimizer_0`` has ``exp_avg[0]`` of ``fqn`` shifted."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    shutil.copytree(src, dst)
    pt = dst.parent / f"{dst.name}-optim.pt"
    dcp_to_torch_save(dst / "optimizer_0", pt)
    sd = torch.load(pt, weights_only=False)
    sd["optimizer"]["state"][fqn]["exp_avg"][0] += 1e-3
    torch.save(sd, pt)
    shutil.rmtree(dst / "optimizer_0")
    torch_save_to_dcp(pt, dst / "optimizer_0")


def _torchrun(script: str, args: list[str], *, cwd: Path, timeout: float):
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(REPO / "tests" / script), *args]
    return run_in_session(cmd, cwd=cwd, timeout=timeout, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.live
def test_trainer_resumes_the_converted_folders_under_fsdp2(tmp_path: Path):
    """One torchrun launch resumes three folders with ``Trainer.train(resume_from_checkpoint=OUT)`` under FSDP2 for
    one step: Llama (ZeRO-2) and GPT-2 (ZeRO-3, ``nn.LayerNorm`` params grouped by class), converted by the CLI (so
    the Trainer's groups come from transformers itself), and a tampered copy of the Llama one.

    Exact: every param (trained ones = DeepSpeed's fp32 masters), ``exp_avg``, ``exp_avg_sq``, ``step`` and the global
    step. The resumed step's logged loss equals the one DeepSpeed logged at that step in the uninterrupted run
    within one bf16 spacing at that loss: both forwards run in bf16 from the same bf16-rounded weights, but FSDP2's
    reported loss is the mean of the ranks' bf16 losses (4.171875 = (4.15625 + 4.1875) / 2) where DeepSpeed's is
    fp32."""
    outs = {}
    for name, fx in (("hf_llama_z2_bf16_w2", LLAMA), ("hf_gpt2_z3_bf16_w2", GPT2)):
        outs[name] = tmp_path / name
        code, stdout, stderr = _cli("to-dcp", "-q", str(fx / "ckpt"), str(outs[name]))
        assert code == 0, stdout + stderr
        assert "2 param groups, the Trainer's, from DeepSpeed's 1" in stdout
    tampered = tmp_path / "hf_llama_z2_bf16_w2-tampered"
    _tamper_moment(outs["hf_llama_z2_bf16_w2"], tampered, "model.norm.weight")
    report = tmp_path / "report.json"
    proc = _torchrun("trainer_fsdp_check.py", ["--report", str(report), *(f"{n}={o}" for n, o in outs.items()),
                                               f"hf_llama_z2_bf16_w2={tampered}"], cwd=tmp_path, timeout=900)
    assert report.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    llama, gpt2, bad = json.loads(report.read_text())
    for run, fx, sizes in ((llama, LLAMA, [14, 5]), (gpt2, GPT2, [9, 18])):
        meta = json.loads((fx / "truth.json").read_text())
        for r in run["ranks"]:
            assert r["is_fsdp2"] and r["fsdp"][2] == "DTensor", r["fsdp"]
            assert r["mismatch"] == [] and r["checked"] > 0, (run["fixture"], r["mismatch"])
            assert r["steps"] == [3.0] and r["global_step_at_resume"] == 3
            assert [g["n_params"] for g in r["groups"]] == sizes
            assert {g["weight_decay"] for g in r["groups"]} == {0.01}  # DeepSpeed's, for the norms too
            assert r["scheduler"]["_last_lr"] == [0.005, 0.005] and r["scheduler"]["last_epoch"] == 3
        assert run["final_global_step"] == 4
        fsdp_loss = run["log"][-1]["loss"]
        ds_loss = meta["trainer"]["losses"]["4"]
        assert abs(fsdp_loss - ds_loss) <= _bf16_spacing(ds_loss), (run["fixture"], fsdp_loss, ds_loss)
    for r in bad["ranks"]:  # the control: one moment shifted in optimizer_0 is seen after the Trainer loaded it
        assert r["mismatch"] == ["exp_avg/model.norm.weight"], r["mismatch"]


@pytest.mark.live
@pytest.mark.deepspeed
def test_accelerate_load_state_resumes_the_converted_folder_under_fsdp2(tmp_path: Path):
    """``accelerator.load_state(OUT)`` under FSDP2 (2 CPU ranks, torchrun): fp32 masters, Adam moments, each param's
    step, the scheduler, the custom object and every rank's RNG as saved (checked in generate_accelerate.py), and
    the next step's loss on each rank equals the one DeepSpeed computes resuming the original folder (a DeepSpeed
    launch of the same script) within one bf16 spacing: DeepSpeed's forward runs on the bf16 weights, this FSDP2
    one in fp32 (bf16 mixed precision stops in the fixture's BatchNorm: FSDP2 leaves its params DTensors there).
    A tampered copy (one moment shifted) must be reported."""
    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    out, tampered = tmp_path / "state-fsdp", tmp_path / "state-fsdp-tampered"
    code, stdout, stderr = _cli("to-dcp", "-q", str(ACC / "state"), str(out))
    assert code == 0, stdout + stderr
    _tamper_moment(out, tampered, "fc1.weight")
    results = {}
    for label, folder in (("fsdp", out), ("tampered", tampered)):
        res = tmp_path / f"{label}.json"
        proc = _torchrun("fixtures/generate_accelerate.py", ["--resume", str(folder), "--fsdp", "--result", str(res)],
                         cwd=tmp_path, timeout=600)
        assert res.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
        results[label] = json.loads(res.read_text())
    ds_res = tmp_path / "ds.json"
    proc = run_deepspeed("fixtures/generate_accelerate.py", ["--resume", str(ACC / "state"), "--result", str(ds_res)],
                         world=2, cwd=tmp_path, timeout=600)
    assert ds_res.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    ds = json.loads(ds_res.read_text())
    for r, d in zip(results["fsdp"], ds, strict=True):
        assert r["problems"] == [] and r["rng"] == "restored" and d["problems"] == [], (r, d)
        assert abs(r["losses"][0] - d["losses"][0]) <= _bf16_spacing(d["losses"][0]), (r["losses"], d["losses"])
    for r in results["tampered"]:
        assert r["problems"] == ["exp_avg/fc1.weight differs from the saved truth"], r["problems"]
