"""dsckpt repair: patched copies scan clean, to-fp32 equals the source where patched and the original
elsewhere (bit for bit), the input is byte-identical afterwards, DeepSpeed loads the result.

Tests named ``planted`` work on COPIES of real CPU fixtures into which inf/NaN were written; the
``real_fp16`` tests use the GPU-made fp16 fixtures whose BatchNorm running_var overflowed in training."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import all_fixtures, ids, tree_digest
from ds_launch import run_deepspeed
from safetensors.torch import load_file, save_file
from scan_helpers import copy_fixture, plant

from dsckpt.api import to_fp32
from dsckpt.cli import main
from dsckpt.errors import RepairError
from dsckpt.model import Role
from dsckpt.repair import Policy, prepare_repair, run_repair
from dsckpt.scan import scan

FIXTURES = all_fixtures()
CPU_BN = [f for f in FIXTURES if f.meta.get("dtype") != "fp16" and "bn.running_var" in f.meta.get("buffers", [])]
REAL_FP16_BN = [f for f in FIXTURES if f.meta.get("dtype") == "fp16" and (f.dir / "source_fp32.safetensors").exists()
                and ("bnoverflow" in f.name or "cpuforced" in f.name)]
BAD = [1, 4]


def _fx(name):
    fx = next((f for f in FIXTURES if f.name == name), None)
    if fx is None:
        pytest.skip(f"fixture {name} not generated yet")
    return fx


def _fp32(ckpt: Path, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / f"fp32-{len(list(tmp.glob('fp32-*')))}.safetensors"
    to_fp32(ckpt, out)
    return load_file(str(out))


def _source(fx, tmp: Path, **changes: torch.Tensor) -> Path:
    sd = {k: v.contiguous() for k, v in fx.expected_fp32().items()}
    sd.update(changes)
    path = tmp / "source.safetensors"
    save_file(sd, str(path))
    return path


@pytest.mark.parametrize("fx", CPU_BN, ids=ids(CPU_BN))
def test_planted_buffer_repaired_everywhere_from_fp32_source(tmp_path, fx):
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, "bn.running_var", Role.MODULE, BAD[0], math.inf, replica=None)
    plant(ckpt, "bn.running_var", Role.MODULE, BAD[1], math.nan, replica=None)
    before = tree_digest(ckpt)
    original = fx.expected_fp32()
    src_rv = original["bn.running_var"] + 0.25  # distinguishable from the stored values
    source = _source(fx, tmp_path, **{"bn.running_var": src_rv})

    plan, _ = prepare_repair(ckpt, source)
    (patch,) = plan.patches
    assert (patch.name, patch.indices.tolist(), patch.promote_to) == ("bn.running_var", BAD, None)
    n_copies = fx.meta["dp_world_size"] if fx.meta["stage"] == 3 else 1
    assert len(patch.targets) == n_copies and (patch.posinf, patch.nan) == (n_copies, n_copies)
    out = tmp_path / "fixed"
    result = run_repair(plan, out)

    assert result.rescan.clean and scan(out).clean
    assert tree_digest(ckpt) == before
    got = _fp32(out, tmp_path)
    want_rv = original["bn.running_var"].clone()
    # DeepSpeed <= 0.18 stores BN buffers in the module's 16-bit dtype: the repaired value is rounded to it.
    stored = fx.truth()["buffer/bn.running_var"].dtype
    want_rv[BAD] = src_rv[BAD].to(stored).float()
    assert torch.equal(got.pop("bn.running_var"), want_rv)
    for name, t in got.items():
        assert torch.equal(t, original[name]), name
    after = tree_digest(out)
    rewritten = {str(p.relative_to(out)) for p in result.rewritten}
    assert rewritten and all(after[k] == v for k, v in before.items() if k not in rewritten)
    assert set(after) == set(before)
    for rel in rewritten:  # legacy (non-zip) files stay legacy
        assert ((out / rel).read_bytes()[:2] == b"PK") == ((ckpt / rel).read_bytes()[:2] == b"PK")


def test_planted_bf16_module_param_repaired_from_master(tmp_path):
    fx = _fx("s2_bf16_w2_2groups")
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, "fc1.weight", Role.MODULE, 3, -math.inf)
    plan, cache = prepare_repair(ckpt, "master")
    (patch,) = plan.patches
    assert [t.role for t in patch.targets] == [Role.MODULE] and patch.indices.tolist() == [3]
    out = tmp_path / "fixed"
    run_repair(plan, out)
    assert scan(out).clean  # also: module copy == master rounded to bf16 again (no mismatch)
    from dsckpt.checkpoint import open_checkpoint

    lowp = open_checkpoint(out).tensor("fc1.weight", role=Role.MODULE)
    assert torch.equal(lowp, fx.truth()["lowp/fc1.weight"])
    assert all(torch.equal(t, fx.expected_fp32()[n]) for n, t in _fp32(out, tmp_path).items())


def test_planted_master_and_module_both_patched_from_source(tmp_path):
    fx = _fx("s1_bf16_w3")
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, "fc2.weight", Role.MASTER, 9, math.nan)
    src = fx.expected_fp32()["fc2.weight"] + 1.0
    plan, _ = prepare_repair(ckpt, _source(fx, tmp_path, **{"fc2.weight": src}))
    (patch,) = plan.patches
    assert sorted(t.role.value for t in patch.targets) == ["master", "module"]
    out = tmp_path / "fixed"
    run_repair(plan, out)
    assert scan(out).clean
    got = _fp32(out, tmp_path)["fc2.weight"].reshape(-1)
    want = fx.expected_fp32()["fc2.weight"].reshape(-1).clone()
    want[9] = src.reshape(-1)[9]
    assert torch.equal(got, want)


def test_whole_tensor_replaces_every_value(tmp_path):
    fx = _fx("s3_fp32_w2")
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, "bn.running_var", Role.MODULE, 0, math.inf, replica=None)
    src = torch.arange(7, dtype=torch.float32) + 3
    plan, _ = prepare_repair(ckpt, _source(fx, tmp_path, **{"bn.running_var": src}), whole_tensor=True)
    assert plan.patches[0].whole
    run_repair(plan, tmp_path / "fixed")
    assert torch.equal(_fp32(tmp_path / "fixed", tmp_path)["bn.running_var"], src)


def test_no_source_value_refuses_listing_all_and_writes_nothing(tmp_path):
    fx = _fx("s2_fp32_w4")
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, "bn.running_var", Role.MODULE, 2, math.inf)
    plant(ckpt, "fc1.bias", "exp_avg", 0, math.nan)
    sd = {k: v.contiguous() for k, v in fx.expected_fp32().items() if k != "bn.running_var"}
    save_file(sd, str(tmp_path / "partial.safetensors"))
    with pytest.raises(RepairError, match=r"cannot repair 2 tensor\(s\).*fc1.bias: non-finite values in its exp_avg; "
                                          r"only another DeepSpeed checkpoint of the run given with --from holds "
                                          r"optimizer moments; bn.running_var \(buffer, 1 non-finite\): "
                                          r"no value in fp32 source"):
        prepare_repair(ckpt, tmp_path / "partial.safetensors")
    with pytest.raises(RepairError, match="bn.running_var \\(buffer\\): has no fp32 master"):
        prepare_repair(ckpt, "master")
    r = CliRunner().invoke(main, ["repair", str(ckpt), str(tmp_path / "out"), "--from", "master"])
    assert r.exit_code == 3 and r.stdout == "" and "nothing was written" in r.stderr
    assert not (tmp_path / "out").exists()


def test_reset_bn_stats_policy(tmp_path):
    fx = _fx("s1_fp32_w2")
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, "bn.running_var", Role.MODULE, 5, math.inf)
    plan, _ = prepare_repair(ckpt, None, policy=Policy.RESET_BN_STATS)
    assert [(p.name, p.indices.tolist(), p.values.tolist()) for p in plan.patches] == [
        ("bn.running_mean", [5], [0.0]), ("bn.running_var", [5], [1.0])]
    assert "reset-bn-stats" in plan.patches[1].describe()
    run_repair(plan, tmp_path / "fixed")
    got = _fp32(tmp_path / "fixed", tmp_path)
    want = fx.expected_fp32()
    assert got["bn.running_var"][5] == 1.0 and got["bn.running_mean"][5] == 0.0
    assert torch.equal(got["bn.running_var"][:5], want["bn.running_var"][:5])


def test_safetensors_file_to_file_promotes_fp16_buffer(tmp_path):
    sd = {"w": torch.linspace(-1, 1, 6, dtype=torch.float16), "bn.running_var": torch.ones(4, dtype=torch.float16)}
    sd["bn.running_var"][2] = math.inf
    save_file(sd, str(tmp_path / "in.safetensors"))
    source = {"w": torch.zeros(6), "bn.running_var": torch.tensor([1.0, 2.0, 1.5e6, 4.0])}
    save_file(source, str(tmp_path / "src.safetensors"))
    before = tree_digest(tmp_path)
    r = CliRunner().invoke(main, ["repair", str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors"),
                                  "--from", str(tmp_path / "src.safetensors")])
    assert r.exit_code == 0, r.output
    assert "stored as float32" in r.stdout and "buffer_dtype" in r.stderr
    out = load_file(str(tmp_path / "out.safetensors"))
    assert torch.equal(out["w"], sd["w"])  # untouched, still fp16
    assert torch.equal(out["bn.running_var"], torch.tensor([1.0, 1.0, 1.5e6, 1.0]))
    assert {k: v for k, v in tree_digest(tmp_path).items() if k in before} == before


def test_cli_dry_run_exit_1_writes_nothing(tmp_path):
    fx = _fx("s3_fp32_w2")
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, "bn.running_var", Role.MODULE, 1, math.inf, replica=None)
    source = _source(fx, tmp_path)
    r = CliRunner().invoke(main, ["repair", str(ckpt), str(tmp_path / "out"), "--from", str(source), "--dry-run"])
    assert r.exit_code == 1 and r.stderr == ""
    assert r.stdout.startswith("would patch 1 tensor(s), rewriting 2 file(s):\nbn.running_var (buffer): 1 of 7")
    assert not (tmp_path / "out").exists()
    r = CliRunner().invoke(main, ["repair", str(ckpt), str(tmp_path / "out"), "--from", str(source)])
    assert r.exit_code == 0 and "re-scan: clean" in r.stdout
    r = CliRunner().invoke(main, ["repair", str(ckpt), str(tmp_path / "out"), "--from", str(source)])
    assert r.exit_code == 2 and "already exists" in r.stderr


def test_cli_clean_input_nothing_to_do(tmp_path):
    fx = _fx("s0_fp32_w1")
    r = CliRunner().invoke(main, ["repair", str(fx.ckpt), str(tmp_path / "out"), "--from", "master"])
    assert r.exit_code == 0 and "nothing to repair" in r.stdout
    assert not (tmp_path / "out").exists()


def test_cli_needs_a_source(tmp_path):
    r = CliRunner().invoke(main, ["repair", str(_fx("s0_fp32_w1").ckpt), str(tmp_path / "out")])
    assert r.exit_code == 2 and "--from" in r.stderr


# ------------------------------------------------------------------ real fp16 fixtures (GPU-made)


@pytest.mark.parametrize("fx", REAL_FP16_BN, ids=ids(REAL_FP16_BN))
def test_real_fp16_bn_overflow_repaired_from_recorded_fp32_stats(tmp_path, fx):
    source = fx.dir / "source_fp32.safetensors"
    before = tree_digest(fx.ckpt)
    original = _fp32(fx.ckpt, tmp_path)
    plan, _ = prepare_repair(fx.ckpt, source)
    (patch,) = plan.patches
    src = load_file(str(source))["bn.running_var"]
    n_copies = fx.meta["dp_world_size"] if fx.meta["stage"] == 3 else 1
    assert (patch.name, len(patch.targets)) == ("bn.running_var", n_copies)
    assert patch.indices.tolist() == (~torch.isfinite(fx.truth()["buffer/bn.running_var"])).nonzero().flatten().tolist()
    # the recorded fp32 running_var exceeds fp16's range there, so the buffer is stored as fp32
    assert patch.promote_to == ("float32" if bool((src[patch.indices].abs() > 65504).any()) else None)
    out = tmp_path / "fixed"
    run_repair(plan, out)
    assert scan(out, nonfinite_only=True).clean
    assert tree_digest(fx.ckpt) == before
    got = _fp32(out, tmp_path)
    bad = patch.indices
    assert torch.equal(got["bn.running_var"][bad], src[bad])
    keep = torch.ones(src.numel(), dtype=torch.bool)
    keep[bad] = False
    assert torch.equal(got.pop("bn.running_var")[keep], original.pop("bn.running_var")[keep])
    assert all(torch.equal(got[n], original[n]) for n in original)


@pytest.mark.parametrize("source", ["master", "file"])
def test_real_fp16_param_overflow_is_refused_not_squeezed(source):
    """fp16 copy of fc2.weight[0,0] is +inf because its fp32 master (70000) exceeds fp16's range: no
    fp16 value is right, so repair refuses (to-fp32 of this checkpoint is already correct)."""
    fx = _fx("s2_fp16_w1_masterinf")
    src = "master" if source == "master" else fx.dir / "source_fp32.safetensors"
    with pytest.raises(RepairError, match=r"fc2.weight \(param\): source values up to 70000 do not fit its stored float16"):
        prepare_repair(fx.ckpt, src)


# ------------------------------------------------------------------ DeepSpeed loads the result


@pytest.mark.live
@pytest.mark.deepspeed
@pytest.mark.parametrize("name", ["s3_fp32_w2", "s2_bf16_w2_2groups"])
def test_deepspeed_loads_planted_then_repaired_checkpoint(tmp_path, name):
    """fp32 ZeRO-3 (buffer replicated on both ranks) and bf16 ZeRO-2 (two param groups): the repaired
    running_var is what DeepSpeed's engine holds after a plain load_checkpoint()."""
    fx = _fx(name)
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, "bn.running_var", Role.MODULE, 3, math.inf, replica=None)
    want = fx.expected_fp32()
    src_rv = want["bn.running_var"] * 2
    run_repair(prepare_repair(ckpt, _source(fx, tmp_path, **{"bn.running_var": src_rv}))[0], tmp_path / "fixed")
    expect = {n: want[n].contiguous() for n in ("bn.running_mean", "fc1.weight", "frozen.weight", "embed.weight")}
    rv = want["bn.running_var"].clone()
    rv[3] = src_rv[3]
    expect["bn.running_var"] = rv
    save_file(expect, str(tmp_path / "expect.safetensors"))
    proc = run_deepspeed("deepspeed_load_check.py", ["--fixture", fx.name, "--ckpt", str(tmp_path / "fixed"),
                                                     "--expect", str(tmp_path / "expect.safetensors")],
                         world=2, cwd=tmp_path, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("PASS", "FAIL"))]
    assert lines == [f"PASS {tmp_path / 'fixed'}"], proc.stdout[-3000:] + proc.stderr[-3000:]
