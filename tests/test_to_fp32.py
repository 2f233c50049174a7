"""to-fp32 and the readers, against real DeepSpeed checkpoints and the truth recorded when they were made."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from conftest import all_fixtures, fixtures_where, ids, tree_digest
from safetensors import safe_open
from safetensors.torch import load_file

import dsckpt
from dsckpt import open_checkpoint, to_fp32
from dsckpt.cli import main
from dsckpt.model import Kind, Role

FIXTURES = all_fixtures()
LOWP = fixtures_where(dtype=lambda d: d in ("bf16", "fp16"))


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        # Exact: bit-for-bit, NaN in the same places (torch.equal treats NaN != NaN).
        assert torch.equal(got[name].view(-1).view(torch.uint8) if t.dtype == torch.bool else
                           torch.nan_to_num(got[name], nan=1234.5), torch.nan_to_num(t, nan=1234.5)), name


@pytest.mark.parametrize("fx", FIXTURES, ids=ids(FIXTURES))
def test_to_fp32_matches_ground_truth_exactly(fx, tmp_path):
    before = tree_digest(fx.ckpt)
    out = tmp_path / "model.safetensors"
    result = to_fp32(fx.ckpt, out)
    assert result.files == (out,)
    _assert_same(load_file(str(out)), fx.expected_fp32())
    assert tree_digest(fx.ckpt) == before, "the input checkpoint was modified"


@pytest.mark.parametrize("fx", FIXTURES, ids=ids(FIXTURES))
def test_logical_model_matches_recorded_metadata(fx):
    c = open_checkpoint(fx.ckpt).logical
    meta = fx.meta
    assert c.zero_stage == meta["stage"]
    assert c.precision.value == meta["dtype"]
    assert c.dp_world_size == meta["dp_world_size"]
    assert c.pp_world_size == meta.get("pp_size", 1)
    assert c.global_steps == meta["global_steps"]
    assert c.global_samples == meta["global_samples"]
    assert c.ds_version == meta["ds_version"]
    assert c.tag == meta["tag"]
    trainable = {e.name for e in c.entries if e.kind is Kind.PARAM and e.trainable}
    frozen = {e.name for e in c.entries if e.kind is Kind.PARAM and not e.trainable}
    assert trainable == set(meta["trainable"])
    assert frozen == set(meta["frozen"])
    assert {e.name for e in c.buffers} == set(meta["buffers"])
    assert c.tied == meta.get("tied", {})


@pytest.mark.parametrize("fx", FIXTURES, ids=ids(FIXTURES))
def test_adam_moments_match_ground_truth(fx):
    c = open_checkpoint(fx.ckpt)
    truth = fx.truth()
    checked = 0
    for e in c.entries:
        for state in ("exp_avg", "exp_avg_sq"):
            key = f"{state}/{e.name}"
            if key in truth:
                assert e.state_piece(state) is not None, f"{key} not found by the reader"
                assert torch.equal(c.tensor(e.name, state=state), truth[key]), key
                checked += 1
    assert checked == sum(1 for k in truth if k.startswith(("exp_avg/", "exp_avg_sq/")))


@pytest.mark.parametrize("fx", LOWP, ids=ids(LOWP))
def test_fp32_master_rounds_to_saved_16bit_copy(fx):
    """Cross-check of the ground truth and of the reader: each fp32 master value, cast to the training
    dtype, is exactly the 16-bit weight DeepSpeed saved in the module (stage 3 saves none: use the
    gathered copy recorded at generation time)."""
    c = open_checkpoint(fx.ckpt)
    truth = fx.truth()
    checked = 0
    for e in c.logical.params:
        if not e.trainable:
            continue
        master = c.tensor(e.name, role=Role.MASTER)
        if e.piece(Role.MODULE) is not None:
            saved = c.tensor(e.name, role=Role.MODULE)
        else:
            saved = truth[f"lowp/{e.name}"]
        assert saved.dtype in (torch.bfloat16, torch.float16)
        assert torch.equal(master.to(saved.dtype), saved), e.name
        assert torch.equal(master, truth[f"param/{e.name}"]), e.name
        checked += 1
    assert checked == len(fx.meta["trainable"])


def _zero_to_fp32_works(fx) -> bool:
    """zero_to_fp32 (0.19.8) fails on stage 0, BF16_Optimizer files, pipeline, legacy non-zip
    files (it mmaps them) and MoE expert files (test_deepspeed_zero_to_fp32_fails_on_moe)."""
    legacy = (fx.meta["config"].get("checkpoint") or {}).get("checkpoint_serialization") is False
    return fx.meta["stage"] in (1, 2, 3) and fx.meta.get("optimizer_wrapper") != "BF16_Optimizer" \
        and fx.meta.get("pp_size", 1) == 1 and not legacy and "moe" not in fx.meta


ZERO = [fx for fx in FIXTURES if _zero_to_fp32_works(fx)]


MOE = [fx for fx in FIXTURES if "moe" in fx.meta]


@pytest.mark.parametrize("fx", MOE, ids=ids(MOE))
def test_deepspeed_zero_to_fp32_fails_on_moe(fx, tmp_path):
    """What issue 10 reports: DeepSpeed's own converter cannot read MoE saves; dsckpt can (the generic
    to-fp32 tests run on these fixtures too)."""
    zero_to_fp32 = pytest.importorskip("deepspeed.utils.zero_to_fp32")
    shutil.copytree(fx.ckpt, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="is not a model state checkpoint"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "ckpt"))
    assert fx.meta["crosscheck"]["zero_to_fp32"]["ok"] is False


@pytest.mark.parametrize("fx", ZERO, ids=ids(ZERO))
def test_agrees_with_deepspeed_zero_to_fp32(fx, tmp_path):
    """Where DeepSpeed's own tool works, dsckpt gives the same fp32 values for trainable params.
    (It leaves frozen params in 16 bit and drops them at stage 1; dsckpt upcasts and keeps them.)"""
    zero_to_fp32 = pytest.importorskip("deepspeed.utils.zero_to_fp32")
    copy = tmp_path / "ckpt"
    shutil.copytree(fx.ckpt, copy)
    theirs = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(copy))
    ours = open_checkpoint(fx.ckpt)
    for name in fx.meta["trainable"]:
        assert torch.equal(ours.tensor(name), theirs[name].float()), name
    for name in fx.meta["frozen"]:
        if name in theirs:
            assert torch.equal(ours.tensor(name).float(), theirs[name].float()), name


def test_sharded_output_with_index(tmp_path):
    fx = fixtures_where(stage=3, dtype="bf16", client=None)[0]  # a plain DeepSpeed save dir: every name exported
    out = tmp_path / "hf"
    res = CliRunner().invoke(main, ["to-fp32", str(fx.ckpt), str(out), "--max-shard-size", "300B"])
    assert res.exit_code == 0, res.output
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 1
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(shards)
    merged = {}
    for shard in shards:
        part = load_file(str(out / shard))
        assert all(index["weight_map"][k] == shard for k in part)
        merged.update(part)
    _assert_same(merged, fx.expected_fp32())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())


def test_directory_output_single_shard_is_model_safetensors(tmp_path):
    fx = next(f for f in FIXTURES if f.meta.get("client") is None)  # HF Trainer folders also get their model files
    out = tmp_path / "hf"
    out.mkdir()
    assert CliRunner().invoke(main, ["to-fp32", str(fx.ckpt), str(out)]).exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    _assert_same(load_file(str(out / "model.safetensors")), fx.expected_fp32())


def test_torch_output_loads_with_weights_only(tmp_path):
    fx = fixtures_where(stage=2, dtype="bf16")[0]
    out = tmp_path / "pytorch_model.bin"
    assert CliRunner().invoke(main, ["to-fp32", str(fx.ckpt), str(out)]).exit_code == 0
    _assert_same(torch.load(out, weights_only=True), fx.expected_fp32())


def test_dtype_option_casts_floats_and_keeps_integer_buffers(tmp_path):
    fx = fixtures_where(stage=1, dtype="fp32", pp_size=1)[0]
    out = tmp_path / "m.safetensors"
    assert CliRunner().invoke(main, ["to-fp32", str(fx.ckpt), str(out), "--dtype", "bf16"]).exit_code == 0
    got = load_file(str(out))
    for name, t in fx.expected_fp32().items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name
    assert got["bn.num_batches_tracked"].dtype == torch.int64


def test_exclude_frozen(tmp_path):
    fx = fixtures_where(stage=2, dtype="bf16")[0]
    out = tmp_path / "m.safetensors"
    assert CliRunner().invoke(main, ["to-fp32", str(fx.ckpt), str(out), "--exclude-frozen"]).exit_code == 0
    got = load_file(str(out))
    assert set(fx.meta["frozen"]).isdisjoint(got)
    assert set(fx.meta["trainable"]) <= set(got)


def test_safetensors_metadata(tmp_path):
    fx = fixtures_where(stage=3, dtype="fp32")[0]
    out = tmp_path / "m.safetensors"
    to_fp32(fx.ckpt, out)
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    assert meta["source_tag"] == fx.meta["tag"]
    assert meta["deepspeed_version"] == fx.meta["ds_version"]  # as the files say, whatever release wrote them
    assert meta["dsckpt_version"] == dsckpt.__version__ != "0+unknown"  # pyproject's version, as installed


def test_refuses_to_overwrite_without_force(tmp_path):
    fx = FIXTURES[0]
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"precious")
    res = CliRunner().invoke(main, ["to-fp32", str(fx.ckpt), str(out)])
    assert res.exit_code == 2
    assert "already exists; pass --force" in res.stderr
    assert out.read_bytes() == b"precious"
    assert CliRunner().invoke(main, ["to-fp32", str(fx.ckpt), str(out), "--force"]).exit_code == 0
    _assert_same(load_file(str(out)), fx.expected_fp32())


def test_dry_run_writes_nothing(tmp_path):
    fx = FIXTURES[0]
    out = tmp_path / "m.safetensors"
    res = CliRunner().invoke(main, ["to-fp32", str(fx.ckpt), str(out), "--dry-run"])
    assert res.exit_code == 1
    assert f"would write {len(fx.expected_fp32())} tensors" in res.stdout
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_library_iterates_lazily_in_module_order():
    fx = fixtures_where(stage=3, dtype="bf16")[0]
    c = open_checkpoint(fx.ckpt)
    it = c.iter_tensors()
    name, t = next(it)
    assert name == fx.meta["state_dict_names"][0]
    assert t.dtype == torch.float32
    assert [n for n, _ in c.iter_tensors()] == fx.meta["state_dict_names"]


def test_nonfinite_values_are_warned_by_name(tmp_path):
    """A GPU-made fp16 checkpoint whose BatchNorm running_var overflowed: converted as stored (inf),
    with a warning on stderr naming the tensor and pointing to scan/repair."""
    fx = next(f for f in FIXTURES if f.name == "s2_fp16_w1_bnoverflow")
    out = tmp_path / "m.safetensors"
    res = CliRunner().invoke(main, ["to-fp32", str(fx.ckpt), str(out)])
    assert res.exit_code == 0
    assert res.stderr.splitlines() == [
        "dsckpt: warning: non-finite values in bn.running_var: 2 +inf of 7 values; see 'dsckpt scan' and "
        "'dsckpt repair'"
    ]
    assert res.stdout.startswith("wrote 13 tensors")
    _assert_same(load_file(str(out)), fx.expected_fp32())


def test_strict_fails_and_writes_nothing(tmp_path):
    fx = next(f for f in FIXTURES if f.name == "s3_fp16_w1_bnoverflow")
    out = tmp_path / "m.safetensors"
    res = CliRunner().invoke(main, ["to-fp32", str(fx.ckpt), str(out), "--strict"])
    assert res.exit_code == 1
    assert "non-finite values in bn.running_var: 2 +inf of 7 values; nothing was written" in res.stderr
    assert list(tmp_path.iterdir()) == []


GROUPED = [f for f in FIXTURES if f.meta.get("param_groups")]


@pytest.mark.parametrize("fx", GROUPED, ids=ids(GROUPED))
def test_optimizer_groups_as_saved(fx):
    """LogicalCheckpoint.optimizer_groups: each param group's params in the optimizer's order (round robin undone),
    its step and hyper-parameters, as the engine had them (truth.json param_groups / optimizer_step). A pipeline's
    stages' groups merged by index (the truth lists them so); a native-MoE expert group under global expert names (the
    truth lists them in another order: compared as sets)."""
    c = open_checkpoint(fx.ckpt).logical
    if c.layout not in ("zero1", "zero2", "zero3", "stage0", "stage0-bf16-optimizer", "pipeline", "moe-zero1",
                        "moe-zero2", "moe-stage0"):
        pytest.skip(f"{c.layout}: groups not read")
    want = [[n for n in g if n in fx.meta["trainable"] and n not in fx.meta.get("tied", {})]
            for g in fx.meta["param_groups"]]
    if fx.meta["config"].get("zero_optimization", {}).get("elastic_checkpoint"):
        # an elastic save keeps a list of per-group states and no param_groups: no hyper-parameters to show
        assert c.optimizer_groups == () and {float(c.optimizer_step)} == set(fx.meta["optimizer_step"])
        return
    if fx.meta.get("frozen_in_optimizer"):  # requires_grad=False params the stage-0 wrapper holds (README)
        assert sorted(n for g in c.optimizer_groups for n in g.param_names) == sorted(
            n for n in fx.meta["trainable"] if n not in fx.meta.get("tied", {}))
    elif "moe" in fx.meta:
        assert [sorted(g.param_names) for g in c.optimizer_groups] == [sorted(g) for g in want]
    else:
        assert [list(g.param_names) for g in c.optimizer_groups] == want
    assert [g.index for g in c.optimizer_groups] == list(range(len(want)))
    assert {float(g.step) for g in c.optimizer_groups} == set(fx.meta["optimizer_step"])
    assert all(g.hyperparam("lr") == fx.meta["config"]["optimizer"]["params"]["lr"] for g in c.optimizer_groups)
    assert c.optimizer_type == fx.meta["config"]["optimizer"]["type"]
