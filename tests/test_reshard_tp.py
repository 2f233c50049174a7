"""``reshard`` of tensor-parallel checkpoints (issue 20 phase 3): every TP rank re-planned as an ordinary
data-parallel checkpoint of its local slices (``dsckpt.tensor_parallel.rank_view``), on the real AutoTP fixtures
(``tests/fixtures/autotp/``). Checked against the source's files read independently with torch (each TP rank's
local slices rebuilt from its optimizer files), and by reading the output back through the readers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_autotp_fixtures import STATES, TP_FIXTURES, meta, stage0_slices, trainable

from dsckpt.cli import main
from dsckpt.ds_writers.facts import derive_facts
from dsckpt.errors import CorruptCheckpointError, UnsupportedCheckpointError, UsageError
from dsckpt.model import Role
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.reshard import plan_reshard, read_source_facts, run_reshard
from dsckpt.tensor_parallel import rank_view

# Megatron-style fixtures pad their vocabulary (rows 30-31 past original_vocab_size 30): resharded with the TP size
# kept (the padding rows carried); another TP size (re-padded by --make-vocab-size-divisible-by): test_reshard_tp_megatron.
RESHARDABLE = list(TP_FIXTURES)
PADDED = [fx for fx in TP_FIXTURES if fx.name.startswith("megatron")]
UNPADDED = [fx for fx in TP_FIXTURES if fx not in PADDED]


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)  # our own test output / trusted fixtures


def local_slices(tag: Path, t: int, *, stage: int, dp: int, bf16: bool,
                 frozen: tuple[str, ...] = ()) -> dict[str, dict[str, torch.Tensor]]:
    """TP rank ``t``'s local slice of every trainable param (state -> name -> tensor), rebuilt with torch from the
    files alone (test_autotp_fixtures.file_slices for any folder); ``frozen``: the frozen params (stage 0 only: its
    files do not say which module entries the optimizer owns)."""
    if stage == 0:
        return stage0_slices(_load(tag / f"mp_rank_{t:02d}_model_states.pt"), tuple(frozen))
    prefix = "bf16_" if bf16 else ""
    osds = [_load(tag / f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt")["optimizer_state_dict"]
            for d in range(dp)]
    out: dict = {s: {} for s in STATES}
    if stage in (1, 2):
        param_shapes = _load(tag / f"mp_rank_{t:02d}_model_states.pt")["param_shapes"]
        for g, shapes in enumerate(param_shapes):
            flat = {"fp32": torch.cat([o["single_partition_of_fp32_groups"][g] for o in osds]),
                    "exp_avg": torch.cat([o["base_optimizer_state"]["state"][g]["exp_avg"] for o in osds]),
                    "exp_avg_sq": torch.cat([o["base_optimizer_state"]["state"][g]["exp_avg_sq"] for o in osds])}
            pads = (osds[0].get("param_alignment_paddings") or {g: [0] * len(shapes)})[g]
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = math.prod(shape)
                for s in STATES:
                    out[s][name] = flat[s][offset:offset + n].view(tuple(shape))
                offset += n + pads[i]
    else:
        param_shapes = _load(tag / f"zero_pp_rank_0_mp_rank_{t:02d}_model_states.pt")["param_shapes"]
        for g, shapes in enumerate(param_shapes):
            flats = [{"fp32": o["fp32_flat_groups"][g], "exp_avg": o["optimizer_state_dict"]["state"][g]["exp_avg"],
                      "exp_avg_sq": o["optimizer_state_dict"]["state"][g]["exp_avg_sq"]} for o in osds]
            offset = 0
            for name, shape in shapes.items():
                n = math.prod(shape)
                part = math.ceil(n / dp)
                for s in STATES:
                    out[s][name] = torch.cat([f[s][offset:offset + part] for f in flats])[:n].view(tuple(shape))
                offset += part
    return out


def _scalers(tag: Path, t: int, dp: int, *, bf16: bool) -> list[tuple[str, dict]]:
    """(class, attributes) of the loss scaler in each of TP rank ``t``'s ``dp`` optimizer files."""
    prefix = "bf16_" if bf16 else ""
    scalers = [_load(tag / f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt")["optimizer_state_dict"].get(
        "loss_scaler") for d in range(dp)]
    return [(type(sc).__name__, dict(vars(sc)) if sc is not None else {}) for sc in scalers]  # BF16_Optimizer: None


def _assert_scaler_carried(fx: Path, src_tag: Path, new_tag: Path, t_new: int, dp_new: int) -> None:
    """Every optimizer file of TP rank ``t_new`` in the output holds the source's loss scaler (that of TP rank 0,
    DP rank 0; all source files agree); for fp16 fixtures it is the DynamicLossScaler state generate_autotp.py
    recorded from the live engine (scale, iteration, last overflow, hysteresis)."""
    m = meta(fx)
    if m["stage"] == 0:  # fp32 / bf16 without ZeRO: no optimizer files, no loss scaler to carry
        return
    bf16 = m["dtype"] == "bf16"
    src = _scalers(src_tag, 0, m["dp_world_size"], bf16=bf16)
    if src[0][0] == "NoneType":  # BF16_Optimizer keeps no loss scaler
        return
    assert all(s == src[0] for t in range(m["tp_size"]) for s in _scalers(src_tag, t, m["dp_world_size"], bf16=bf16))
    assert _scalers(new_tag, t_new, dp_new, bf16=bf16) == [src[0]] * dp_new
    if m["dtype"] == "fp16":
        cls, attrs = src[0]
        rec = m["loss_scaler"]
        assert cls == rec["class"] == "DynamicLossScaler"
        assert {k: str(v) if k == "dtype" else v for k, v in attrs.items()} == {
            k: v for k, v in rec.items() if k != "class"}


def _reshard(fx: Path, out: Path, world: int, **kw) -> None:
    cache = FileCache()
    ckpt = read_checkpoint(fx / "ckpt", cache=cache)
    plan = plan_reshard(ckpt, world, facts=read_source_facts(ckpt, cache), **kw)
    run_reshard(plan, out, cache=cache, verify="full", workers=1)


CASES = [(fx, dp, stage) for fx in RESHARDABLE
         for dp, stage in ({1: [(2, None), (3, None)], 2: [(1, None), (3, None)]}[meta(fx)["dp_world_size"]]
                           + [(2, 3 if meta(fx)["stage"] != 3 else 1)])]


@pytest.mark.parametrize(("fx", "dp", "stage"), CASES, ids=[f"{fx.name}-dp{dp}-z{s}" for fx, dp, s in CASES])
def test_dp_change_keeps_every_tp_rank_slice(fx, dp, stage, tmp_path):
    """TP kept, data-parallel size (and optionally the ZeRO stage) changed: every TP rank's local fp32 master and
    Adam moments (and, between ZeRO-1/2 layouts, its 16-bit module weights) equal the source's exactly --
    vocabulary padding rows included (megatron_*: local rows 14-15 of TP rank 1) --, file names carry the TP rank,
    and universal_checkpoint_info and the other model-states keys are carried unchanged."""
    m = meta(fx)
    tp = m["tp_size"]
    out = tmp_path / "out"
    _reshard(fx, out, tp * dp, zero_stage=stage)
    src_tag, new_tag = fx / "ckpt" / m["tag"], out / m["tag"]
    new_stage = stage or m["stage"]
    bf16 = m["dtype"] == "bf16"
    for t in range(tp):
        a = local_slices(src_tag, t, stage=m["stage"], dp=m["dp_world_size"], bf16=bf16)
        b = local_slices(new_tag, t, stage=new_stage, dp=dp, bf16=bf16)
        for s in STATES:
            assert a[s].keys() == b[s].keys()
            for name in a[s]:
                assert torch.equal(a[s][name], b[s][name]), (t, s, name)
        src_model = "zero_pp_rank_0_mp_rank_{t:02d}_model_states.pt" if m["stage"] == 3 else "mp_rank_{t:02d}_model_states.pt"
        new_model = "zero_pp_rank_0_mp_rank_{t:02d}_model_states.pt" if new_stage == 3 else "mp_rank_{t:02d}_model_states.pt"
        ms_a, ms_b = _load(src_tag / src_model.format(t=t)), _load(new_tag / new_model.format(t=t))
        assert ms_b["universal_checkpoint_info"] == ms_a["universal_checkpoint_info"]
        assert ms_b["dp_world_size"] == dp
        if 3 not in (m["stage"], new_stage):
            assert ms_a["module"].keys() == ms_b["module"].keys()
            for name, v in ms_a["module"].items():
                assert v.dtype == ms_b["module"][name].dtype and torch.equal(v, ms_b["module"][name]), (t, name)
        for key in ("mp_world_size", "global_steps", "global_samples", "skipped_steps",
                    "checkpoint_parallel_dimensions"):
            assert ms_b.get(key) == ms_a.get(key), key
        _assert_scaler_carried(fx, src_tag, new_tag, t, dp)
    names = sorted(p.name for p in new_tag.iterdir())
    assert all(any(f"mp_rank_{t:02d}" in n for t in range(tp)) for n in names)
    assert len([n for n in names if "optim_states" in n]) == (tp * dp if new_stage else 0)
    back = read_checkpoint(out)
    assert (back.tp_world_size, back.dp_world_size) == (tp, dp)


T1_CASES = [(fx, dp, stage) for fx in UNPADDED for dp, stage in ((1, None), (2, None), (3, 3 if meta(fx)["stage"] != 3 else 1))]


@pytest.mark.parametrize(("fx", "dp", "stage"), T1_CASES, ids=[f"{fx.name}-dp{dp}-z{s}" for fx, dp, s in T1_CASES])
def test_tp_to_1_is_a_plain_checkpoint_of_full_tensors(fx, dp, stage, tmp_path):
    """TP 2 -> 1: one mp_rank_00, full fp32 masters and Adam moments equal to what the source engine returned
    (truth.safetensors, merged from its live TP slices), the 16-bit module weights too; the model-states keys say
    TP 1 as DeepSpeed 0.19.8 writes them at autotp_size 1: no universal_checkpoint_info, mp_world_size 1,
    tp_degree 1, no tensor_parallel section in ds_config."""
    from test_autotp_fixtures import truth

    m = meta(fx)
    out = tmp_path / "out"
    _reshard(fx, out, dp, tp_size=1, zero_stage=stage)
    new_stage = stage or m["stage"]
    tag = out / m["tag"]
    assert not [p.name for p in tag.iterdir() if "mp_rank_00" not in p.name]
    got = local_slices(tag, 0, stage=new_stage, dp=dp, bf16=m["dtype"] == "bf16")
    want = truth(fx)
    for s in STATES:
        for name, v in got[s].items():
            assert torch.equal(v, want[f"{'param' if s == 'fp32' else s}/{name}"]), (s, name)
    model = "zero_pp_rank_0_mp_rank_00_model_states.pt" if new_stage == 3 else "mp_rank_00_model_states.pt"
    ms = _load(tag / model)
    assert "universal_checkpoint_info" not in ms
    assert (ms["mp_world_size"], ms["checkpoint_parallel_dimensions"]["tp_degree"], ms["dp_world_size"]) == (1, 1, dp)
    assert "tensor_parallel" not in ms["ds_config"]
    assert ms["skipped_steps"] == m.get("skipped_steps", 0)
    _assert_scaler_carried(fx, fx / "ckpt" / m["tag"], tag, 0, dp)
    if new_stage != 3:
        for name, v in ms["module"].items():
            assert torch.equal(v, want[f"lowp/{name}" if f"lowp/{name}" in want else f"buffer/{name}"]), name
    back = read_checkpoint(out)
    assert (back.tp_world_size, back.tensor_parallel, back.dp_world_size) == (1, None, dp)


def test_same_size_round_trip_reproduces_source_values(tmp_path):
    """TP2 x DP2 -> TP2 x DP1 -> TP2 x DP2: every stored value as in the source (full read-back both ways)."""
    fx = next(f for f in RESHARDABLE if f.name == "autotp_z2_fp32_tp2_dp2")
    _reshard(fx, tmp_path / "a", 2)
    cache = FileCache()
    mid = read_checkpoint(tmp_path / "a", cache=cache)
    run_reshard(plan_reshard(mid, 4, facts=read_source_facts(mid, cache)), tmp_path / "b", cache=cache,
                verify="full", workers=1)
    a = local_slices(fx / "ckpt" / "global_step3", 1, stage=2, dp=2, bf16=False)
    b = local_slices(tmp_path / "b" / "global_step3", 1, stage=2, dp=2, bf16=False)
    for s in STATES:
        for name in a[s]:
            assert torch.equal(a[s][name], b[s][name])


def test_verify_sees_the_padding_rows(tmp_path):
    """The read-back verification compares the vocabulary padding rows too: one changed padding value of the
    output (head.weight's exp_avg, TP rank 1's local row 15 = padding row 31) is a difference naming them."""
    from dsckpt.ds_writers.readback import compare_checkpoints

    fx = TP_DIR / "megatron_z2_fp32_tp2_dp2"
    _reshard(fx, tmp_path / "o", 2)
    f = tmp_path / "o" / "global_step3" / "zero_pp_rank_0_mp_rank_01_optim_states.pt"
    sd = _load(f)
    shapes = _load(tmp_path / "o" / "global_step3" / "mp_rank_01_model_states.pt")["param_shapes"][0]
    assert list(shapes)[-1] == "head.weight"
    sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"][
        sum(math.prod(s) for s in shapes.values()) - 1] += 1.0
    torch.save(sd, f)
    src_cache, new_cache = FileCache(), FileCache()
    src, new = read_checkpoint(fx / "ckpt", cache=src_cache), read_checkpoint(tmp_path / "o", cache=new_cache)
    assert compare_checkpoints(src, src_cache, new, new_cache, full=True, padding=False) > 0
    with pytest.raises(CorruptCheckpointError, match=r"'head.weight' \(exp_avg padding rows\) differs in elements "
                                                     r"\[0, 16\)"):
        compare_checkpoints(src, src_cache, new, new_cache, full=True)


def test_universal_source_has_no_padding_to_carry(tmp_path):
    """A universal folder of a padded vocabulary keeps no padding values for the masters and moments
    (ds_to_universal cuts them; the copied model-states files keep the module's): its TP rank 1 view (which holds
    the padding rows) is refused, naming them; rank 0's holds none and is planned."""
    fx = TP_DIR / "megatron_z1_bf16_tp2_dp1"
    r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(tmp_path / "u"), "--universal", "-q"])
    assert r.exit_code == 0, r.output
    u = read_checkpoint(tmp_path / "u")
    e = u.entry("embed.weight")
    assert (e.padding_rows, [p.role for p in e.padding]) == (2, [Role.MODULE])
    assert rank_view(u, u.tensor_parallel, 0).entry("embed.weight").shape == (16, 8)
    with pytest.raises(UnsupportedCheckpointError, match=r"holds no values for the vocabulary padding rows of "
                                                         r"embed.weight \(master\), embed.weight \(exp_avg\)"):
        rank_view(u, u.tensor_parallel, 1)


def test_plan_is_one_data_parallel_plan_per_tp_rank():
    """Pure: the plan of a TP checkpoint is one ordinary plan per TP rank, planned from that rank's view."""
    fx = next(f for f in RESHARDABLE if f.name == "autotp_z1_bf16_tp2_dp1_kv3")
    ckpt = read_checkpoint(fx / "ckpt")
    plan = plan_reshard(ckpt, 6, facts=derive_facts(ckpt))
    assert (plan.tp_size, plan.world_size, plan.total_world_size, plan.has_work) == (2, 3, 6, True)
    assert [p.mp_rank for p in plan.parts()] == [0, 1]
    assert [r.optim_file for r in plan.mp_ranks[1].ranks] == [
        f"bf16_zero_pp_rank_{d}_mp_rank_01_optim_states.pt" for d in range(3)]
    # uneven KV heads: TP rank 0 holds more of k_proj than rank 1, and its view says so
    cut = ckpt.tensor_parallel.name_to_cut["model.layers.0.self_attn.k_proj.weight"]
    v0, v1 = (rank_view(ckpt, ckpt.tensor_parallel, t) for t in range(2))
    assert v0.entry(cut.name).shape == cut.rank_shapes[0] != v1.entry(cut.name).shape == cut.rank_shapes[1]
    assert all(p.numel == v1.entry(cut.name).numel for p in v1.entry(cut.name).pieces)


def test_cli_tp_kept(tmp_path):
    fx = next(f for f in RESHARDABLE if f.name == "autotp_z2_fp32_tp2_dp2")
    r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(tmp_path / "o"), "-n", "2", "-q"])
    assert r.exit_code == 0, r.output
    assert "from 4 to 2 ranks (TP 2 x DP 2 -> TP 2 x DP 1)" in r.stdout
    r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(tmp_path / "p"), "-n", "3"])
    assert r.exit_code == 2 and "not a multiple of the tensor-parallel size 2" in r.stderr


# ds_to_universal takes ZeRO optimizer files: stage-0 sources have none (reshard --universal writes them as the folder
# of their ZeRO-1 files, tests/test_universal.py test_stage0_source_*)
WITH_ZERO = [fx for fx in RESHARDABLE if meta(fx)["stage"] != 0]


@pytest.mark.parametrize("fx", WITH_ZERO, ids=[fx.name for fx in WITH_ZERO])
def test_universal_of_tp_equals_ds_to_universal(fx, tmp_path):
    """reshard --universal of a TP checkpoint against DeepSpeed's own ds_to_universal of the same folder (recorded
    by tests/fixtures/record_ds_to_universal.py): the same files (every TP rank's model-states file copied), and in
    each the same keys in order, dtypes, full shapes and values. AutoTP: {"param"}, and {"vocab_tensor": True,
    "param"} for vocabulary params; Megatron-style records: per-category keys ({"cat_dim": 1, "param"}
    row-parallel, {"cat_dim": 0, "param_n_sub_params": 2, "param"} fused [gate; up], {"sub_param_shape":
    SubparamShape(...), "param"} for parameter_with_sub_params (the GQA fixture's fused qkv), {"cat_dim": 0,
    "vocab_tensor": True, "param"} with the vocabulary cut to original_vocab_size, {"param"} replicated)."""
    from universal_record import ds_to_universal_differences

    r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(tmp_path / "ours"), "--universal", "--verify",
                                  "full", "-q"])
    assert r.exit_code == 0, r.output
    assert ds_to_universal_differences(fx, tmp_path / "ours") == []


FROZEN_BUF = next(fx for fx in TP_FIXTURES if fx.name == "autotp_z1_bf16_tp2_dp1_frozen_buf")


def test_universal_of_tp_with_frozen_param_and_buffer(tmp_path):
    """A TP source whose module holds a frozen param that AutoTP splits (layer 0's q_proj, (16, 8) as two (8, 8)
    slices) and a buffer: zero/<name>/fp32.pt holds TP rank 0's local tensor, upcast and unmerged, as ds_to_universal
    0.19.8 writes it (the file-for-file comparison is test_universal_of_tp_equals_ds_to_universal); the plan says so.
    Read back, the folder gives the source engine's trainable masters and moments (truth.safetensors), and its frozen
    param and buffer whole from the copied model-states files of every TP rank, not from those files."""
    from safetensors.torch import load_file
    from scan_helpers import read_copy
    from test_autotp_fixtures import truth

    fx, frozen, buf = FROZEN_BUF, "model.layers.0.self_attn.q_proj.weight", "model.norm.running_mean"
    m, tr = meta(fx), truth(fx)
    assert m["frozen"] == [frozen] and m["buffers"] == [buf]
    r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(tmp_path / "u"), "--universal", "--dry-run"])
    assert r.exit_code == 1, r.output
    assert (f"note: zero/<name>/fp32.pt of {frozen}, {buf} (buffers, frozen params) hold TP rank 0's local tensor "
            "from mp_rank_00_model_states.pt, unmerged, as ds_to_universal 0.19.8 writes them; DeepSpeed's universal "
            "loader does not read these files") in r.stdout
    assert f"zero/{frozen}/fp32.pt: bfloat16 module copy as float32" in r.stdout
    r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(tmp_path / "u"), "--universal", "-q"])
    assert r.exit_code == 0, r.output
    tag = tmp_path / "u" / f"{m['tag']}_universal"
    assert sorted(_load(tag / f"zero/{frozen}/fp32.pt")) == ["param"]
    assert torch.equal(_load(tag / f"zero/{frozen}/fp32.pt")["param"], tr[f"tp0/param/{frozen}"])  # (8, 8)
    assert torch.equal(_load(tag / f"zero/{buf}/fp32.pt")["param"], tr[f"tp0/buffer/{buf}"])
    cache = FileCache()
    back = read_checkpoint(tmp_path / "u", cache=cache)
    assert (back.tp_world_size, back.entry(frozen).trainable, back.entry(frozen).shape) == (2, False, (16, 8))
    for n in trainable(fx):
        e = back.entry(n)
        for role, key in ((Role.MASTER, "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            assert torch.equal(read_copy(e, cache, role), tr[f"{key}/{n}"]), (n, key)
    cache.finish_checks()
    r = CliRunner().invoke(main, ["to-fp32", str(tmp_path / "u"), str(tmp_path / "m.safetensors")])
    assert r.exit_code == 0, r.output
    got = load_file(str(tmp_path / "m.safetensors"))
    assert sorted(got) == sorted(m["params"] + m["buffers"])
    assert torch.equal(got[frozen], tr[f"param/{frozen}"]) and got[frozen].shape == (16, 8)  # both TP slices
    assert torch.equal(got[buf], tr[f"buffer/{buf}"])
    assert all(torch.equal(got[n], tr[f"param/{n}"]) for n in trainable(fx))


def test_universal_refuses_tp_module_tensor_without_rank0_copy():
    """Where TP rank 0's model states hold no copy of a buffer (the logical checkpoint edited to lose it), there is
    nothing to write zero/<name>/fp32.pt from as ds_to_universal does: refused, naming the tensor and the file."""
    import dataclasses

    from dsckpt.reshard import plan_universal_reshard

    ckpt = read_checkpoint(FROZEN_BUF / "ckpt")
    buf = ckpt.entry("model.norm.running_mean")
    lost = dataclasses.replace(buf, pieces=tuple(p for p in buf.pieces
                                                 if all(f.file.name != "mp_rank_00_model_states.pt"
                                                        for f in p.fragments)))
    assert lost.pieces and len(lost.pieces) < len(buf.pieces)
    edited = dataclasses.replace(ckpt, entries=tuple(lost if e.name == buf.name else e for e in ckpt.entries))
    plan_universal_reshard(ckpt)  # the fixture as saved plans
    with pytest.raises(UnsupportedCheckpointError, match=r"'model\.norm\.running_mean' \(a buffer or frozen param\) "
                                                         r"has no single module copy in TP rank 0's "
                                                         r"mp_rank_00_model_states\.pt"):
        plan_universal_reshard(edited)


def test_world_size_usage_errors():
    fx = next(f for f in RESHARDABLE if f.name == "autotp_z2_fp32_tp2_dp2")
    ckpt = read_checkpoint(fx / "ckpt")
    with pytest.raises(UsageError, match="not a multiple"):
        plan_reshard(ckpt, 3, facts=derive_facts(ckpt))
    with pytest.raises(UnsupportedCheckpointError, match="from 2 to 4 needs the model's HF config.json beside the "
                                                         "checkpoint"):
        plan_reshard(ckpt, 4, tp_size=4, facts=derive_facts(ckpt))


# --------------------------------------------------------------------------------------------
# Another TP size > 1 (dsckpt.autotp_widths): the kv6 model, which DeepSpeed trained at TP 2 and at TP 4

KV6_TP2 = Path(__file__).parent / "fixtures" / "autotp" / "autotp_z1_bf16_tp2_dp1_kv6"
KV6_TP4 = Path(__file__).parent / "fixtures" / "autotp" / "autotp_z1_bf16_tp4_dp1_kv6"


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def _cut_truth(fx: Path, layout_fx: Path, t: int) -> dict[str, dict[str, torch.Tensor]]:
    """``fx``'s full (merged) truth cut for TP rank ``t`` as DeepSpeed cut the same model in ``layout_fx`` (its
    truth.json local shapes): state -> name -> the slice that rank must hold; ``lowp`` for the module copy."""
    from test_autotp_fixtures import TRUTH_KIND, truth

    full, shapes, tp = truth(fx), meta(layout_fx)["local_shapes"], meta(layout_fx)["tp_size"]
    out: dict = {s: {} for s in (*STATES, "lowp")}
    for s, slices in out.items():
        for name in meta(fx)["params"]:
            x = full[f"{TRUTH_KIND.get(s, s)}/{name}"]
            mine = shapes[f"tp{t}"][name]
            dim = next((d for d, (a, b) in enumerate(zip(mine, x.shape)) if a != b), None)
            if dim is None:  # replicated
                slices[name] = x
            else:
                widths = [shapes[f"tp{r}"][name][dim] for r in range(tp)]
                slices[name] = torch.split(x, widths, dim=dim)[t]
    return out


def _check_values(out: Path, fx: Path, layout_fx: Path, stage: int = 1) -> None:
    """Every TP rank's stored fp32 master, Adam moments and module copy in ``out`` (ZeRO ``stage``, DP 1) equal
    ``fx``'s truth cut as DeepSpeed cut the model in ``layout_fx``, exactly."""
    m = meta(layout_fx)
    for t in range(m["tp_size"]):
        got = local_slices(out / "global_step3", t, stage=stage, dp=1, bf16=True)
        want = _cut_truth(fx, layout_fx, t)
        for s in STATES:
            for name, v in want[s].items():
                assert torch.equal(got[s][name], v), (t, s, name)
        module = _load(out / "global_step3" / f"mp_rank_{t:02d}_model_states.pt")["module"]
        for name, v in want["lowp"].items():
            assert torch.equal(module[name], v), (t, name)


def _same_layout_files(ours: Path, ds: Path) -> None:
    """``ours`` is laid out as DeepSpeed's own save ``ds`` of the same model at the same TP x DP: the same files;
    per model-states file the same keys in order, the same universal_checkpoint_info (affine maps included), module
    names/shapes/dtypes, param_shapes and size keys; per optimizer file the same keys and partition shapes. Values
    differ (another training run) except where noted by the caller."""
    assert _files(ours) == _files(ds)
    for rel in sorted(_files(ds)):
        if not rel.endswith(".pt"):
            continue
        a, b = _load(ours / rel), _load(ds / rel)
        assert list(a) == list(b), rel
        if "model_states" in rel:
            assert a["universal_checkpoint_info"] == b["universal_checkpoint_info"], rel
            assert [(k, v.shape, v.dtype) for k, v in a["module"].items()] == \
                [(k, v.shape, v.dtype) for k, v in b["module"].items()], rel
            for k in ("param_shapes", "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions",
                      "ds_config", "buffer_names", "shared_params"):
                assert a[k] == b[k], (rel, k)
        else:
            oa, ob = a["optimizer_state_dict"], b["optimizer_state_dict"]
            assert list(oa) == list(ob), rel
            assert [x.shape for x in oa["single_partition_of_fp32_groups"]] == \
                [x.shape for x in ob["single_partition_of_fp32_groups"]], rel
            assert oa["param_slice_mappings"] == ob["param_slice_mappings"], rel


def test_tp2_to_tp4_is_laid_out_as_deepspeed_at_tp4(tmp_path):
    """TP 2 -> TP 4 of the kv6 model: the files, keys, record and every shape DeepSpeed wrote when training the same
    model at TP 4 (uneven attention: q_proj 8/8/4/4); the values are the TP-2 source's, cut as DeepSpeed cuts at TP 4."""
    out = tmp_path / "tp4"
    _reshard(KV6_TP2, out, 4, tp_size=4)
    _same_layout_files(out, KV6_TP4 / "ckpt")
    _check_values(out, KV6_TP2, KV6_TP4)
    back = read_checkpoint(out)
    assert (back.tp_world_size, back.dp_world_size) == (4, 1)
    assert back.tensor_parallel.name_to_cut == read_checkpoint(KV6_TP4 / "ckpt").tensor_parallel.name_to_cut


def test_tp4_to_tp2_is_laid_out_as_deepspeed_at_tp2(tmp_path):
    out = tmp_path / "tp2"
    _reshard(KV6_TP4, out, 2, tp_size=2)
    _same_layout_files(out, KV6_TP2 / "ckpt")
    _check_values(out, KV6_TP4, KV6_TP2)


def test_tp_round_trip_2_4_2_is_the_source(tmp_path):
    """TP 2 -> TP 4 -> TP 2 (DP 1 -> 2 -> 1 on the way): every tensor of every file equal to the source's, bit for
    bit (fp32 masters, moments, module copies, the record)."""
    from test_universal import _same

    _reshard(KV6_TP2, tmp_path / "tp4", 8, tp_size=4)
    cache = FileCache()
    mid = read_checkpoint(tmp_path / "tp4", cache=cache)
    assert (mid.tp_world_size, mid.dp_world_size) == (4, 2)
    run_reshard(plan_reshard(mid, 2, tp_size=2, facts=read_source_facts(mid, cache)), tmp_path / "tp2", cache=cache,
                verify="full", workers=1)
    src = KV6_TP2 / "ckpt"
    assert _files(tmp_path / "tp2") == _files(src)
    for rel in sorted(_files(src)):
        if rel.endswith(".pt"):
            _same(_load(src / rel), _load(tmp_path / "tp2" / rel), [rel])
        else:
            assert (src / rel).read_bytes() == (tmp_path / "tp2" / rel).read_bytes(), rel


KV6_Z0 = Path(__file__).parent / "fixtures" / "autotp" / "autotp_z0_bf16_tp2_dp1_kv6"


@pytest.mark.parametrize(("src", "stage"), [(KV6_Z0, None), (KV6_Z0, 1), (KV6_TP2, 0)],
                         ids=["z0-kept", "z0-to-z1", "z1-to-z0"])
def test_stage0_tp2_to_tp4_is_cut_as_deepspeed_at_tp4(src, stage, tmp_path):
    """TP 2 -> 4 from or to stage 0 (the kv6 model): every TP rank's fp32 master, Adam moments and module slice
    are the TP-2 source's truth cut as DeepSpeed cut the same model at TP 4 (q_proj 8/8/4/4), the record is the one
    DeepSpeed wrote at TP 4, and at stage 0 each mp_rank_0t file is the only file of its TP rank."""
    out = tmp_path / "tp4"
    _reshard(src, out, 4, tp_size=4, zero_stage=stage)
    new_stage = meta(src)["stage"] if stage is None else stage
    _check_values(out, src, KV6_TP4, stage=new_stage)
    want_uc = _load(KV6_TP4 / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt")["universal_checkpoint_info"]
    for t in range(4):
        ms = _load(out / "global_step3" / f"mp_rank_{t:02d}_model_states.pt")
        assert ms["universal_checkpoint_info"] == want_uc
        assert (ms["mp_world_size"], ms["checkpoint_parallel_dimensions"]["tp_degree"]) == (4, 4)
    if new_stage == 0:
        assert sorted(p.name for p in (out / "global_step3").iterdir()) == [
            f"mp_rank_{t:02d}_model_states.pt" for t in range(4)]
    back = read_checkpoint(out)
    assert (back.tp_world_size, back.zero_stage) == (4, new_stage)


ZERO_SOURCES = [fx for fx in RESHARDABLE if meta(fx)["stage"] != 0]


@pytest.mark.parametrize("fx", ZERO_SOURCES, ids=[fx.name for fx in ZERO_SOURCES])
def test_zero_to_stage0_keeps_every_tp_rank_slice(fx, tmp_path):
    """ZeRO-1/2/3 -> stage 0, TP kept, DP 2: one mp_rank_0t_model_states.pt per TP rank (no optimizer files), whose
    stage-0 optimizer (fp32: torch Adam over the module; 16-bit: FP16_UnfusedOptimizer's fp32_groups) holds that TP
    rank's source slices exactly, and whose module holds the live engine's 16-bit slices (truth tp{t}/lowp)."""
    from test_autotp_fixtures import TRUTH_KIND, truth

    m = meta(fx)
    tp = m["tp_size"]
    out = tmp_path / "out"
    _reshard(fx, out, tp * 2, zero_stage=0)
    tag = out / m["tag"]
    assert sorted(p.name for p in tag.iterdir()) == [f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)]
    tr = truth(fx)
    for t in range(tp):
        got = local_slices(tag, t, stage=0, dp=2, bf16=m["dtype"] == "bf16", frozen=tuple(m.get("frozen", ())))
        for s in STATES:
            for name in trainable(fx):
                assert torch.equal(got[s][name], tr[f"tp{t}/{TRUTH_KIND[s]}/{name}"]), (t, s, name)
        ms = _load(tag / f"mp_rank_{t:02d}_model_states.pt")
        for name in m["params"]:
            assert torch.equal(ms["module"][name].float(), tr[f"tp{t}/lowp/{name}"].float()), (t, name)
        assert (ms["dp_world_size"], ms["mp_world_size"], ms["param_shapes"]) == (2, tp, None)
    back = read_checkpoint(out)
    assert (back.tp_world_size, back.dp_world_size, back.zero_stage) == (tp, 2, 0)


def test_cli_stage0_dry_run_names_every_tp_rank_file(tmp_path):
    """--dry-run of a TP target at stage 0 lists one model-states file per TP rank, nothing written."""
    r = CliRunner().invoke(main, ["reshard", str(TP_DIR / "autotp_z1_bf16_tp2_dp1" / "ckpt"), str(tmp_path / "o"),
                                  "-n", "4", "--zero-stage", "0", "--dry-run"])
    assert r.exit_code == 1 and not (tmp_path / "o").exists(), r.output
    assert "to ZeRO stage 0 (FP16_UnfusedOptimizer)" in r.stdout
    assert "rewrite mp_rank_00_model_states.pt, mp_rank_01_model_states.pt with dp_world_size=2" in r.stdout


def test_cli_tp_resize(tmp_path):
    r = CliRunner().invoke(main, ["reshard", str(KV6_TP2 / "ckpt"), str(tmp_path / "o"), "-n", "4", "--tp-size", "4",
                                  "-q"])
    assert r.exit_code == 0, r.output
    assert "from 2 to 4 ranks (TP 2 x DP 1 -> TP 4 x DP 1)" in r.stdout
    r = CliRunner().invoke(main, ["reshard", str(KV6_TP2 / "ckpt"), str(tmp_path / "d"), "-n", "4", "--tp-size", "4",
                                  "--dry-run"])
    assert r.exit_code == 1 and not (tmp_path / "d").exists()
    assert "note: tensor parallelism 2 -> 4: every param cut as DeepSpeed AutoTP cuts it at autotp_size 4 " \
           "(num_key_value_heads=6 in " in r.stdout and "the rule reproduced the source's widths of all 15 split " \
           "params" in r.stdout
    # Llama with 2 KV heads at TP 4: refused naming what AutoTP would do, nothing written
    fx = TP_DIR / "autotp_z1_bf16_tp2_dp1"
    r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(tmp_path / "p"), "-n", "4", "--tp-size", "4"])
    assert r.exit_code == 3 and "needs the model's HF config.json beside the checkpoint" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "p").exists()


def test_tp1_to_tp2_refused(tmp_path):
    """A TP-1 checkpoint (here the kv6 model written at TP 1, config.json beside it) has no split record: refused,
    saying what is missing, nothing written."""
    _reshard(KV6_TP2, tmp_path / "tp1", 1, tp_size=1)
    r = CliRunner().invoke(main, ["reshard", str(tmp_path / "tp1"), str(tmp_path / "o"), "-n", "2", "--tp-size", "2"])
    assert r.exit_code == 3, r.output
    assert "it was saved without tensor parallelism, so it has no record of how each param splits" in r.stderr
    assert 'Write it with --universal instead and load that with "checkpoint": {"load_universal": true} and ' \
           "autotp_size 2" in r.stderr  # the route test_deepspeed_loads_padded_vocabulary_universal runs
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------
# Real DeepSpeed (AutoTP on CPU ranks) loads the output with plain load_checkpoint()

from ds_launch import DEEPSPEED, passed_except_controls, run_check_script

TP_DIR = Path(__file__).parent / "fixtures" / "autotp"
# (launch ranks, TP size, --zero-stage) -> fixtures resharded for it
# (megatron_*: padded vocabulary, the padding rows carried with the TP size kept)
DS_TP_CASES: dict[tuple[int, int, int | None], list[str]] = {
    # DP 2 -> 1 (megatron: the padded vocabulary carried); TP 4 -> 2 of the kv6 model trained at TP 4;
    # TP 2 -> 4 -> 2 of the one trained at TP 2 (VIA_TP)
    (2, 2, None): ["autotp_z2_fp32_tp2_dp2", "autotp_z3_fp32_tp2_dp2", "megatron_z2_fp32_tp2_dp2",
                   "megatron_z1_bf16_tp2_dp2_bf16opt", "autotp_z1_bf16_tp4_dp1_kv6", "autotp_z1_bf16_tp2_dp1_kv6",
                   "autotp_z0_fp32_tp2_dp2"],  # stage 0 (fp32, torch Adam) DP 2 -> 1
    # TP 2 -> 4: uneven attention (q_proj 8/8/4/4); Megatron-style (MEGATRON_DIVISOR): equal parts, the 32-row
    # vocabulary's padding (rows 30-31) now on TP rank 3, zero
    (4, 4, None): ["autotp_z1_bf16_tp2_dp1_kv6", "megatron_z1_bf16_tp2_dp1", "megatron_z2_fp32_tp2_dp2",
                   "megatron_z1_bf16_tp2_dp2_bf16opt", "autotp_z0_bf16_tp2_dp1_kv6"],  # stage 0 re-cut for TP 4
    (4, 2, None): ["autotp_z1_bf16_tp2_dp1", "autotp_z3_bf16_tp2_dp1", "autotp_z1_bf16_tp2_dp1_vocab33",
                   "autotp_z1_bf16_tp2_dp1_falcon", "megatron_z1_bf16_tp2_dp1",  # DP 1 -> 2
                   "autotp_z1_fp16_tp2_dp1_cpuforced", "autotp_z3_fp16_tp2_dp1_cpuforced",  # fp16 (CPU forced)
                   "autotp_z0_bf16_tp2_dp1_kv6"],  # stage 0 kept (FP16_UnfusedOptimizer)
    # DP 1 -> 2 and ZeRO-1 -> ZeRO-2: uneven KV heads; a padded vocabulary; the kv6 model trained at TP 4 also TP 4 -> 2;
    # stage 0 -> ZeRO-2 (fp32: the module was the master; bf16: FP16_UnfusedOptimizer's fp32_groups)
    (4, 2, 2): ["autotp_z1_bf16_tp2_dp1_kv3", "megatron_z1_bf16_tp2_dp1", "autotp_z1_bf16_tp4_dp1_kv6",
                "autotp_z0_fp32_tp2_dp2", "autotp_z0_bf16_tp2_dp1_kv6"],
    # ZeRO-1/2/3 -> stage 0, TP 2 kept (bf16: FP16_UnfusedOptimizer, the Adam state in each mp_rank_0t file;
    # megatron: fp32, the padded vocabulary's padding rows carried in the module, which is the master)
    (4, 2, 0): ["autotp_z1_bf16_tp2_dp1", "autotp_z2_fp32_tp2_dp2", "autotp_z3_bf16_tp2_dp1", "megatron_z2_fp32_tp2_dp2"],
    # ZeRO-1 -> stage 0 with TP 2 -> 4 (the kv6 model; each TP rank's module and optimizer state re-cut)
    (4, 4, 0): ["autotp_z1_bf16_tp2_dp1_kv6"],
    # TP 2 -> 1: plain checkpoints of full tensors, DP 2
    (2, 1, None): ["autotp_z2_fp32_tp2_dp2", "autotp_z3_fp32_tp2_dp2", "autotp_z1_bf16_tp2_dp1",
                   "autotp_z3_bf16_tp2_dp1", "autotp_z1_bf16_tp2_dp1_kv3", "autotp_z1_bf16_tp2_dp1_vocab33",
                   "autotp_z1_bf16_tp2_dp1_falcon", "autotp_z1_fp16_tp2_dp1_cpuforced",
                   "autotp_z3_fp16_tp2_dp1_cpuforced", "autotp_z0_fp32_tp2_dp2", "autotp_z0_bf16_tp2_dp1_kv6",
                   # Megatron-style at TP 1: the plain 30-row model (MEGATRON_DIVISOR pads nothing at TP 1) and
                   # ("@padded", PADDED_TP1_DIVISOR) the model whose vocabulary stays padded to 32 rows at TP 1
                   "megatron_z1_bf16_tp2_dp1", "megatron_z2_fp32_tp2_dp2", "megatron_z1_bf16_tp2_dp2_bf16opt",
                   "megatron_z2_fp32_tp2_dp2@padded", "megatron_z1_bf16_tp2_dp1@padded"],
}
# make_vocab_size_divisible_by of tp_megatron_models.MegatronNet: 30 rows -> 30 at TP 1, 32 at TP 2 and at TP 4
MEGATRON_DIVISOR = 2
# ... and of MegatronNet(padded_at_tp1=True): 30 rows -> 32 at TP 1 (the TP-1 files keep the Megatron record)
PADDED_TP1_DIVISOR = 16
# case -> (fixture, launch ranks) of its tampered control
TAMPERED_CASES = {(2, 2, None): ("autotp_z2_fp32_tp2_dp2", 2), (2, 1, None): ("autotp_z2_fp32_tp2_dp2", 2),
                  (4, 4, None): ("autotp_z1_bf16_tp2_dp1_kv6", 4), (4, 2, 0): ("autotp_z0_bf16_tp2_dp1_kv6", 4)}
PADDING_TAMPERED_CASES = {(2, 2, None), (4, 4, None), (2, 1, None)}
# cases with an fp16 control whose loss scale was changed on one rank (the check must see the loss scaler)
SCALER_TAMPERED_CASES = {(4, 2, None)}
SCALER = "<loss scaler>"
# (launch ranks, TP size, --zero-stage) -> {fixture: TP size it is resharded to first, at 1 DP rank per TP rank}
VIA_TP = {(2, 2, None): {"autotp_z1_bf16_tp2_dp1_kv6": 4}}


def _write_tampered(out: Path, tp: int, fixture: str, world: int) -> tuple[str, int | tuple[int, ...]]:
    """``fixture`` resharded to TP ``tp`` x DP ``world / tp`` with one fp32 master element of the last TP rank
    changed: the check must fail on it, or it could not see a wrong slice. Returns the param whose master was
    changed and the global rank that holds it. A stage-0 bf16 fixture stays at stage 0: the first element of its
    FP16_UnfusedOptimizer master ``fp32_groups[0][0]`` in the last TP rank's one model-states file, which every DP
    rank of that TP rank loads (global ranks ``tp - 1 + tp * d``)."""
    _reshard(TP_DIR / fixture, out, world, tp_size=tp)
    if meta(TP_DIR / fixture)["stage"] == 0:
        f = out / "global_step3" / f"mp_rank_{tp - 1:02d}_model_states.pt"
        sd = _load(f)
        with torch.no_grad():
            sd["optimizer"]["fp32_groups"][0][0].view(-1)[0] += 1.0
        torch.save(sd, f)
        return next(iter(sd["module"])), tuple(tp - 1 + tp * d for d in range(world // tp))
    (f,) = (out / "global_step3").glob(f"*zero_pp_rank_0_mp_rank_{tp - 1:02d}_optim_states.pt")
    sd = _load(f)
    sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][0] += 1.0
    torch.save(sd, f)
    name = next(iter(_load(out / "global_step3" / f"mp_rank_{tp - 1:02d}_model_states.pt")["param_shapes"][0]))
    return name, tp - 1


def _write_scaler_tampered(out: Path) -> tuple[str, int]:
    """autotp_z1_fp16_tp2_dp1_cpuforced at TP 2 x DP 2 with the DynamicLossScaler's ``cur_scale`` halved (256 ->
    128) in the optimizer file of TP rank 1, DP rank 1 (global rank 3 = t + 2 d), which only that rank loads."""
    _reshard(TP_DIR / "autotp_z1_fp16_tp2_dp1_cpuforced", out, 4)
    f = out / "global_step3" / "zero_pp_rank_1_mp_rank_01_optim_states.pt"
    sd = _load(f)
    scaler = sd["optimizer_state_dict"]["loss_scaler"]
    assert type(scaler).__name__ == "DynamicLossScaler" and scaler.cur_scale == 256
    scaler.cur_scale = 128
    torch.save(sd, f)
    return SCALER, 3


def _write_padding_tampered(out: Path, tp: int) -> tuple[str, int]:
    """megatron_z2_fp32_tp2_dp2 at TP ``tp`` x DP 1 with the fp32 master of head.weight's last padding element (row
    31, past the 30-row vocabulary, on the last TP rank: carried at TP 2, a new zero row at TP 4) changed: the check
    must see the padding rows. At TP 1: TP 1 x DP 2 with the vocabulary padded to 32 rows (PADDED_TP1_DIVISOR), the
    element in DP rank 1's partition (every DP rank gathers it). Returns the param and the global rank that holds
    it."""
    world = 2 if tp == 1 else tp
    kw = {"make_vocab_size_divisible_by": PADDED_TP1_DIVISOR} if tp == 1 else _divisor("megatron_z2_fp32_tp2_dp2", tp)
    _reshard(TP_DIR / "megatron_z2_fp32_tp2_dp2", out, world, tp_size=tp, **kw)
    shapes = _load(out / "global_step3" / f"mp_rank_{tp - 1:02d}_model_states.pt")["param_shapes"][0]
    assert list(shapes)[-1] == "head.weight"
    end = sum(math.prod(s) for s in shapes.values())
    files = [out / "global_step3" / f"zero_pp_rank_{d}_mp_rank_{tp - 1:02d}_optim_states.pt" for d in range(world // tp)]
    sds = [_load(f) for f in files]
    flats = [sd["optimizer_state_dict"]["single_partition_of_fp32_groups"][0] for sd in sds]
    # the last element is head.weight[-1, 7]: the last TP rank's last row = padding row 31
    assert sum(f.numel() for f in flats) == end
    with torch.no_grad():
        flats[-1][-1] += 1.0
    torch.save(sds[-1], files[-1])
    return "head.weight", tp - 1


def _divisor(name: str, tp: int) -> dict:
    """``make_vocab_size_divisible_by`` for a Megatron-style fixture at another TP size."""
    return {"make_vocab_size_divisible_by": MEGATRON_DIVISOR} if name.startswith("megatron") and tp != 2 else {}


@pytest.fixture(scope="module")
def ds_tp_runs(tmp_path_factory):
    """``run(case)``: the case's reshards and their DeepSpeed launch, made on first use (so ``-k`` one case launches
    only that one)."""
    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    base = tmp_path_factory.mktemp("ds_tp_reshard")
    runs: dict = {}

    def run(case):
        if case not in runs:
            runs[case] = _ds_tp_run(base, *case)
        return runs[case]

    return run


def _ds_tp_run(base: Path, world: int, tp: int, stage: int | None):
    names = DS_TP_CASES[(world, tp, stage)]
    cwd = base / f"to{world}_tp{tp}_z{stage}"
    cwd.mkdir()
    pairs = []
    for name in names:
        out = cwd / name
        if name.endswith("@padded"):
            _reshard(TP_DIR / name.split("@")[0], out, world, tp_size=tp, zero_stage=stage,
                     make_vocab_size_divisible_by=PADDED_TP1_DIVISOR)
            pairs.append(f"{name}={out}")
            continue
        via = VIA_TP.get((world, tp, stage), {}).get(name)
        if via is not None:
            _reshard(TP_DIR / name, cwd / f"{name}_tp{via}", via, tp_size=via)
            cache = FileCache()
            mid = read_checkpoint(cwd / f"{name}_tp{via}", cache=cache)
            run_reshard(plan_reshard(mid, world, tp_size=tp, zero_stage=stage, facts=read_source_facts(mid, cache)),
                        out, cache=cache, verify="full", workers=1)
        else:
            _reshard(TP_DIR / name, out, world, tp_size=tp, zero_stage=stage, **_divisor(name, tp))
        pairs.append(f"{name}={out}")
    tampered = {}
    if (world, tp, stage) in TAMPERED_CASES:
        fixture, fixture_world = TAMPERED_CASES[(world, tp, stage)]
        tampered[str(cwd / "tampered")] = _write_tampered(cwd / "tampered", tp, fixture, fixture_world)
        pairs.append(f"{fixture}={cwd / 'tampered'}")
    if (world, tp, stage) in PADDING_TAMPERED_CASES:
        tampered[str(cwd / "padding_tampered")] = _write_padding_tampered(cwd / "padding_tampered", tp)
        pairs.append(f"megatron_z2_fp32_tp2_dp2{'@padded' if tp == 1 else ''}={cwd / 'padding_tampered'}")
    if (world, tp, stage) in SCALER_TAMPERED_CASES:
        tampered[str(cwd / "scaler_tampered")] = _write_scaler_tampered(cwd / "scaler_tampered")
        pairs.append(f"autotp_z1_fp16_tp2_dp1_cpuforced={cwd / 'scaler_tampered'}")
    args = ["--tp-size", str(tp), *(("--zero-stage", str(stage)) if stage is not None else ())]
    return (*run_check_script("ds_tp_reshard_check.py", pairs, args=args, world=world, cwd=cwd, timeout=900),
            tampered)


@pytest.mark.live
@pytest.mark.deepspeed
@pytest.mark.parametrize("case", list(DS_TP_CASES), ids=lambda c: f"to{c[0]}ranks_tp{c[1]}_z{'same' if c[2] is None else c[2]}")
def test_deepspeed_loads_tp_resharded(ds_tp_runs, case):
    """fp32 masters, Adam moments, module weights, step, global steps/samples exact (each TP rank's slice through
    safe_get_full_fp32_param / safe_get_full_optimizer_state; at TP 1 the full tensors), logits within another
    CPU's rounding of the source engine's (ds_tp_reshard_check.logits_slack; plus what phase 1 recorded at TP 1);
    one more step runs; each tampered control (one changed master element; for megatron one in a vocabulary padding
    row; for fp16 a changed loss scale) fails naming the changed param (the loss scaler) on the rank that holds it
    (and nothing else). fp16 fixtures (CPU forced): loss scaler state and skipped steps exact too."""
    rc, results, log, tampered = ds_tp_runs(case)
    results, controls = passed_except_controls(results, log)
    assert {r["fixture"] for r in results} == set(DS_TP_CASES[case])
    assert sorted(c["ckpt"] for c in controls) == sorted(tampered), log
    for control in controls:
        assert not control["ok"], log
        problems = control["problems"]
        name, holder = tampered[control["ckpt"]]
        if name == SCALER:  # the fp16 control: only the rank that loads the changed optimizer file
            assert len(problems) == 1 and problems[0].startswith(f"rank {holder}: loss scaler DynamicLossScaler "
                                                                 "{'cur_scale': 128,"), problems
        elif case[1] > 1:  # TP T x DP 1: only TP rank T - 1 (global rank T - 1) holds the changed slice
            holders = holder if isinstance(holder, tuple) else (holder,)  # stage 0: every DP rank of it
            assert problems == [f"rank {h}: param of '{name}' differs from the source" for h in holders], problems
        else:  # TP 1 x DP 2: safe_get_full_fp32_param gathers over DP, so every rank sees the changed element
            assert problems == [f"rank {r}: param of '{name}' differs from the source" for r in range(2)], problems
    if not tampered:
        assert rc == 0, log


# A padded vocabulary at another TP size: refused by reshard, which points to --universal + load_universal. That
# route, in real DeepSpeed: (launch ranks, TP size) -> fixtures written with reshard --universal.
# The same route takes a checkpoint saved *without* TP to TP 2 (TP 1 -> 2; "NAME@tp1": the fixture first resharded
# to TP 1 x DP 1, a plain checkpoint with no record, then written --universal): DeepSpeed's universal loader cuts each
# param by the live AutoTP layer, which reshard cannot know from a TP-1 checkpoint.
# Stage-0 AutoTP saves (which ds_to_universal does not read; reshard --universal writes the folder of their ZeRO-1
# files) are loaded by a ZeRO-1 engine (the third key: the loading engine's ZeRO stage, None for the fixture's).
# megatron_z1_fp32_tp2_dp1_gqa: parameter_with_sub_params (a fused GQA qkv of 8/4/4 rows), whose files carry the
# SubparamShape DeepSpeed's loader cuts each sub-param by; its control (SUBPARAM_TAMPERED) is the same folder without
# sub_param_shape, which DeepSpeed then cuts as one tensor: the qkv slices must come out wrong.
GQA = "megatron_z1_fp32_tp2_dp1_gqa"
DS_TP_UNIVERSAL_CASES: dict[tuple[int, int, int | None], list[str]] = {
    (2, 1, None): ["megatron_z2_fp32_tp2_dp2", "megatron_z1_bf16_tp2_dp1", GQA],  # TP 2 -> TP 1 x DP 2
    (2, 2, None): ["megatron_z2_fp32_tp2_dp2", "megatron_z1_bf16_tp2_dp1", GQA,  # TP 2 x DP 1
                   "autotp_z1_bf16_tp2_dp1_kv6@tp1", "autotp_z2_fp32_tp2_dp2@tp1",  # TP 1 -> TP 2
                   FROZEN_BUF.name],  # a frozen split param and a buffer: zero/<name>/fp32.pt of TP rank 0
    (2, 2, 1): ["autotp_z0_fp32_tp2_dp2", "autotp_z0_bf16_tp2_dp1_kv6"],  # stage 0 TP 2 x DP 2 (1) -> ZeRO-1 x DP 1
}
SUBPARAM_TAMPERED = {(2, 2, None)}


def _write_subparam_tampered(written: Path, out: Path) -> None:
    """``written`` (the GQA fixture's --universal folder) without ``sub_param_shape`` in its qkv state files."""
    import shutil

    shutil.copytree(written, out)
    for f in out.glob("*/zero/layers.*.attn.qkv.weight/*.pt"):
        if f.name != "step.pt":
            d = torch.load(f, weights_only=False)  # our own output, test side
            del d["sub_param_shape"]
            torch.save(d, f)


@pytest.fixture(scope="module")
def ds_tp_universal_runs(tmp_path_factory):
    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    base = tmp_path_factory.mktemp("ds_tp_universal")
    written = {}
    for name in dict.fromkeys(n for names in DS_TP_UNIVERSAL_CASES.values() for n in names):
        out = base / name
        src = TP_DIR / name.split("@")[0] / "ckpt"
        if name.endswith("@tp1"):  # a plain TP-1 checkpoint first: no TP record left
            r = CliRunner().invoke(main, ["reshard", str(src), str(base / f"{name}-plain"), "-n", "1", "--tp-size",
                                          "1", "-q"])
            assert r.exit_code == 0, r.output
            src = base / f"{name}-plain"
            assert read_checkpoint(src).tensor_parallel is None
        r = CliRunner().invoke(main, ["reshard", str(src), str(out), "--universal", "-q"])
        assert r.exit_code == 0, r.output
        written[name] = out
    runs = {}
    for (world, tp, stage), names in DS_TP_UNIVERSAL_CASES.items():
        cwd = base / f"to{world}_tp{tp}_zero{stage}"
        cwd.mkdir()
        pairs = [f"{n.split('@')[0]}={written[n]}" for n in names]
        if (world, tp, stage) in SUBPARAM_TAMPERED:
            _write_subparam_tampered(written[GQA], cwd / "subparam_tampered")
            pairs.append(f"{GQA}={cwd / 'subparam_tampered'}")
        runs[(world, tp, stage)] = run_check_script(
            "ds_tp_reshard_check.py", pairs,
            args=["--tp-size", str(tp), "--universal", *(["--zero-stage", str(stage)] if stage is not None else [])],
            world=world, cwd=cwd, timeout=900)
    return runs


@pytest.mark.live
@pytest.mark.deepspeed
@pytest.mark.parametrize("case", list(DS_TP_UNIVERSAL_CASES),
                         ids=lambda c: f"to{c[0]}ranks_tp{c[1]}" + ("" if c[2] is None else f"_zero{c[2]}"))
def test_deepspeed_loads_padded_vocabulary_universal(ds_tp_universal_runs, case):
    """reshard --universal of a padded-vocabulary TP checkpoint, loaded with load_universal at TP 1 (the plain
    30-row model) and at TP 2 (model + mpu): fp32 masters, Adam moments, module weights, step exact -- the padding
    rows zero at TP 2, as DeepSpeed's universal loader re-pads them --, logits as for the reshard checks. And TP 1
    -> 2: a plain TP-1 checkpoint (no record) written --universal, loaded by AutoTP at TP 2: each rank's slices
    equal the TP-2 run's own (same AutoTP widths), exactly. And stage-0 AutoTP saves (fp32 TP 2 x DP 2, bf16 TP 2 x
    DP 1) written --universal, loaded by a ZeRO-1 engine at TP 2 x DP 1: every slice exact, one more step. And a
    Megatron-style parameter_with_sub_params (the GQA fixture's fused qkv, sub-params of 8/4/4 rows), whose files
    carry dsckpt's pickled SubparamShape, at TP 2 and TP 1: exact; its control without sub_param_shape (DeepSpeed
    then cuts the fused qkv as one tensor) fails on the qkv params only (and, from them, the logits). And a TP run
    with a frozen param AutoTP splits and a buffer (their zero/<name>/fp32.pt TP rank 0's local tensor, as
    ds_to_universal writes them): the trainable state exact, the frozen param frozen and intact, the buffer intact."""
    rc, results, log = ds_tp_universal_runs[case]
    results, controls = passed_except_controls(results, log)
    assert [r["fixture"] for r in results] == [n.split("@")[0] for n in DS_TP_UNIVERSAL_CASES[case]]
    assert len(controls) == (case in SUBPARAM_TAMPERED), log
    for control in controls:
        # "rank r: param of 'NAME' differs from the source" per param and copy, then the logits they give
        named = [p for p in control["problems"] if not p.split(": ", 1)[1].startswith("logits differ")]
        assert not control["ok"] and named, log
        assert all(".attn.qkv.weight' differs" in p for p in named), control["problems"]
    if not controls:
        assert rc == 0, log


def test_cli_dry_run_names_tp_and_dp(tmp_path):
    fx = TP_DIR / "autotp_z2_fp32_tp2_dp2"
    r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(tmp_path / "o"), "-n", "2", "--tp-size", "1",
                                  "--dry-run"])
    assert r.exit_code == 1, r.output
    assert "from 4 to 2 ranks (TP 2 x DP 2 -> TP 1 x DP 2)" in r.stdout.splitlines()[0]
    assert "rank 1: zero_pp_rank_1_mp_rank_00_optim_states.pt" in r.stdout
    assert not (tmp_path / "o").exists()
