"""DCP folders (and single state-dict files) as input (issue 33 item 4): ``info``, ``scan``, ``verify``, ``diff`` and
``to-fp32`` read a PyTorch distributed checkpoint through the same safe paths as everything else; ``info`` and
``verify`` take a torch file or a safetensors file/folder as ``scan`` and ``diff`` do. The hostile DCP cases are in
tests/hostile.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import FIXTURES, tree_digest
from safetensors.numpy import load_file

from dsckpt.checkpoint import open_checkpoint
from dsckpt.cli import main
from dsckpt.dcp_writer import plan_to_dcp, run_to_dcp

NAMES = ["s2_bf16_w2_2groups", "s3_fp32_w2", "s0_bf16_w2"]


def _cli(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args))
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture(scope="module")
def dcp_outs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dcp")
    out = {}
    for name in NAMES:
        c = open_checkpoint(FIXTURES / name / "ckpt", check_master_copies=True)
        out[name] = run_to_dcp(plan_to_dcp(c.logical, root / name), c.cache).plan.output
    return out


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_diff_proves_the_export(name: str, dcp_outs: dict[str, Path]) -> None:
    """diff CKPT OUT: every tensor equal bitwise, the masters and both moments too (8: the tied head.weight is
    proven an alias of embed.weight on both sides, so its master and moments are embed.weight's)."""
    ckpt, out = str(FIXTURES / name / "ckpt"), str(dcp_outs[name])
    code, stdout, _ = _cli("diff", ckpt, out)
    assert code == 0 and "13 tensors compared, 13 equal bitwise" in stdout, stdout
    for role in ("master", "exp_avg", "exp_avg_sq"):
        code, stdout, _ = _cli("diff", ckpt, out, "--role", role)
        assert code == 0 and "8 tensors compared, 8 equal bitwise" in stdout, (role, stdout)


def test_diff_sees_a_different_checkpoint(dcp_outs: dict[str, Path]) -> None:
    code, stdout, _ = _cli("diff", str(FIXTURES / "s3_fp32_w2" / "ckpt"), str(dcp_outs["s2_bf16_w2_2groups"]))
    assert code == 1 and "different" in stdout


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_to_fp32_of_the_dcp_folder_equals_to_fp32_of_the_checkpoint(name: str, dcp_outs: dict[str, Path],
                                                                     tmp_path: Path) -> None:
    before = tree_digest(dcp_outs[name])
    a, b = tmp_path / "from_dcp.safetensors", tmp_path / "from_ds.safetensors"
    assert _cli("to-fp32", "-q", str(dcp_outs[name]), str(a))[0] == 0
    assert _cli("to-fp32", "-q", str(FIXTURES / name / "ckpt"), str(b))[0] == 0
    x, y = load_file(str(a)), load_file(str(b))
    assert list(x) == list(y)
    assert all(x[k].dtype == y[k].dtype and x[k].shape == y[k].shape and x[k].tobytes() == y[k].tobytes() for k in x)
    assert tree_digest(dcp_outs[name]) == before


def test_info_scan_verify_read_a_dcp_folder(dcp_outs: dict[str, Path]) -> None:
    out = str(dcp_outs["s2_bf16_w2_2groups"])
    code, stdout, _ = _cli("info", out)
    assert code == 0 and "health       ok" in stdout and "__0_0.distcp" in stdout and ".metadata" in stdout, stdout
    # every file of the folder is listed (the param groups' bytes items have files of their own); no ZeRO stage,
    # tag or world sizes are made up for a DCP folder, and what it does not record is "unknown"
    assert f"files        {len(list(Path(out).iterdir()))} files," in stdout, stdout
    assert "layout       PyTorch distributed checkpoint (dcp)" in stdout and "ZeRO stage" not in stdout, stdout
    assert "\ntag " not in stdout and "parallelism" not in stdout, stdout
    # each param's optimizer state holds its step (3, a float32 tensor): shown; DeepSpeed's global step is not there
    assert "progress     global step unknown, samples unknown, optimizer step 3" in stdout, stdout
    assert "optimizer    AdamW, 2 param groups\n  group 0    3 params; weight_decay 0.01, lr 0.01," in stdout, stdout
    code, stdout, _ = _cli("scan", out)
    assert code == 0 and "(dcp)" in stdout and "clean: nothing found" in stdout, stdout
    code, stdout, _ = _cli("verify", out)
    assert code == 0 and "records CRC-checked" in stdout and stdout.rstrip().endswith("all values finite"), stdout
    code, _, stderr = _cli("info", out, "--tag", "x")
    assert code == 2 and "--tag is for DeepSpeed checkpoints" in stderr


def test_info_and_verify_take_single_files(tmp_path: Path) -> None:
    """A torch file and a safetensors file, as scan and diff already took (click used to say "Directory
    'model.pt' is a file")."""
    ckpt = str(FIXTURES / "s3_fp32_w2" / "ckpt")
    for name in ("model.pt", "model.safetensors"):
        f = tmp_path / name
        assert _cli("to-fp32", "-q", ckpt, str(f))[0] == 0
        code, stdout, stderr = _cli("info", str(f))
        assert code == 0 and "health       ok" in stdout, stdout + stderr
        kind = "safetensors file" if name.endswith(".safetensors") else "torch file"
        assert stdout.startswith(f"checkpoint   {f}\nlayout       {kind}, fp32,"), stdout
        code, stdout, stderr = _cli("verify", str(f))
        assert code == 0 and "all values finite" in stdout, stdout + stderr


def test_verify_finds_damage_in_a_dcp_item(dcp_outs: dict[str, Path], tmp_path: Path) -> None:
    """A flipped byte inside a tensor's data: the item's zip record CRC-32 catches it (verify and to-fp32 exit 3,
    nothing written)."""
    import shutil

    folder = tmp_path / "dcp"
    shutil.copytree(dcp_outs["s3_fp32_w2"], folder)
    from dsckpt.dcp_reader import read_dcp

    logical, cache = read_dcp(folder)
    frag = logical.entry("fc2.weight").pieces[0].fragments[0]
    at = cache.tensor(frag.file, frag.key).storage.file_offset + 5  # inside fc2.weight's stored bytes
    data = bytearray(frag.file.read_bytes())
    data[at] ^= 0x40
    frag.file.write_bytes(bytes(data))
    code, _, stderr = _cli("verify", str(folder))
    assert code == 3 and "CRC" in stderr and frag.file.name in stderr, stderr
    code, _, stderr = _cli("to-fp32", "-q", str(folder), str(tmp_path / "x.safetensors"))
    assert code == 3 and "CRC" in stderr and not (tmp_path / "x.safetensors").exists()


LAYOUTS = ["autotp/autotp_z2_fp32_tp2_dp2/ckpt", "autotp/autotp_z1_bf16_tp2_dp1/ckpt",
           "peft/peft_gpt2_lora_z2_bf16_w2/ckpt", "hf_llama_z2_bf16_w2/ckpt", "accelerate_s2_bf16_w2/state",
           # pipeline, native MoE and AutoEP (HF names: gate_up_proj's moments are w1's and w3's joined)
           "pp2_fp32/ckpt", "moe_s2_fp32_w2_ep1/ckpt", "autoep/autoep_qwen3_z2_fp32_ep2_dp1/ckpt"]


@pytest.mark.parametrize("rel", LAYOUTS, ids=[r.split("/")[-2] if r.endswith("ckpt") else r.split("/")[-1]
                                              for r in LAYOUTS])
def test_to_dcp_of_more_layouts_equals_the_checkpoint(rel: str, tmp_path: Path) -> None:
    """Tensor parallel (AutoTP, the TP cuts joined), a PEFT run (its trained adapter params under the PeftModel's
    names, the frozen base as saved), a Trainer and an Accelerate save, a pipeline, a native-MoE and an AutoEP run
    (under the HF model's names): diff proves the masters and every moment."""
    ckpt, out = str(FIXTURES / rel), str(tmp_path / "dcp")
    assert _cli("to-dcp", "-q", "--plain", ckpt, out)[0] == 0  # --plain: one DCP folder for the Trainer's too
    for role in ("value", "exp_avg", "exp_avg_sq"):
        code, stdout, _ = _cli("diff", ckpt, out, "--role", role)
        assert code == 0 and stdout.rstrip().splitlines()[-1].startswith("equal:"), (role, stdout)


def test_diff_pairs_an_autoep_save_with_the_hf_names(tmp_path: Path) -> None:
    """``to-fp32 OUT/`` of an AutoEP save writes the HF model's names; diff pairs the save with them (and says which
    differ: a tampered gate_up_proj is caught)."""
    import torch
    from safetensors.torch import load_file, save_file

    ckpt, out = str(FIXTURES / "autoep/autoep_mixtral_z2_fp32_ep2_dp2/ckpt"), tmp_path / "hf"
    assert _cli("to-fp32", "-q", ckpt, str(out) + "/")[0] == 0
    code, stdout, _ = _cli("diff", ckpt, str(out))
    assert code == 0 and "only in A: 0, only in B: 0" in stdout, stdout
    sd = load_file(str(out / "model.safetensors"))
    sd["model.layers.1.mlp.experts.gate_up_proj"][0, -1, 0] += torch.tensor(1.0)
    save_file(sd, str(out / "model.safetensors"))
    code, stdout, _ = _cli("diff", ckpt, str(out))
    assert code == 1 and "model.layers.1.mlp.experts.gate_up_proj" in stdout, stdout


