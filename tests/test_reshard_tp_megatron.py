"""``reshard --tp-size T`` of Megatron-style TP checkpoints (issue 32): every split param cut in equal parts at the new
size, the vocabulary re-padded to a multiple of ``--make-vocab-size-divisible-by`` x T (``megatron_*`` fixtures:
30 rows padded to 32 at TP 2, a multiple of D x 2 for D in 2, 4, 8, 16).

Checked against DeepSpeed's own route for the same change, ``ds_to_universal`` then ``load_universal`` at TP T:
the recorded ``ds_to_universal`` output of each fixture (``universal_truth.safetensors``,
tests/fixtures/record_ds_to_universal.py) cut as ``universal_checkpoint.load_hp_checkpoint_state`` (DeepSpeed 0.19.8)
cuts it -- the vocabulary zero-padded to the model's padded size, then ``torch.chunk`` per TP rank (each of a fused
param's 2 sub-params apart, row-parallel params on dim 1, replicated params whole) -- must equal every TP rank's
fp32 master, both Adam moments (read with torch from our files), and the module copy (the engine's 16-bit weights,
zero-padded and cut the same way); Adam's step is carried. Read back by dsckpt, the real rows of every copy equal the
engine's recorded truth."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from test_autotp_fixtures import STATES, TRUTH_KIND, meta, truth, universal
from test_reshard_tp import _load, _reshard, local_slices

from dsckpt.assemble import read_piece
from dsckpt.cli import main
from dsckpt.ds_writers.facts import derive_facts
from dsckpt.errors import UnsupportedCheckpointError, UsageError
from dsckpt.model import Role
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.reshard import plan_reshard
from dsckpt.tensor_parallel import padded_vocab_size

TP_DIR = Path(__file__).parent / "fixtures" / "autotp"
MEGATRON = ["megatron_z1_bf16_tp2_dp1", "megatron_z2_fp32_tp2_dp2", "megatron_z1_bf16_tp2_dp2_bf16opt"]
# (fixture, target TP, target DP, make_vocab_size_divisible_by): D = 2 keeps 32 rows at TP 4 (the padding moves to
# TP rank 3) and gives the unpadded 30 at TP 1; D = 16 pads to 64 at TP 4 (TP ranks 2 and 3: padding only) and to 32
# at TP 1 (the TP-1 files keep the Megatron record, which says rows 30 and 31 are padding)
CASES = [(fx, tp, dp, d) for fx in MEGATRON for tp, dp, d in ((4, 1, 2), (4, 1, 16), (1, 2, 2), (1, 2, 16))] + [
    ("megatron_z1_bf16_tp2_dp1", 4, 2, 16)]
# The fused GQA qkv (parameter_with_sub_params with sub_param_shard_widths): TP 1 only (another TP > 1 is refused:
# test_megatron_sub_params_tp_change_refused); the TP-1 record's widths are TP 1's
GQA = "megatron_z1_fp32_tp2_dp1_gqa"
CASES += [(GQA, 1, 2, 2), (GQA, 1, 2, 16)]


def _ds_route(fx: Path, full: torch.Tensor, name: str, t: int, tp: int, padded: int) -> torch.Tensor:
    """``full`` (the ds_to_universal tensor of param ``name``) as DeepSpeed's universal loader gives it to TP rank
    ``t`` of ``tp`` (load_hp_checkpoint_state): the record's categories say how ds_to_universal merged it."""
    record = meta(fx)["universal_checkpoint_info"]

    def matches(key: str) -> bool:
        return any(re.match(p, name) for p in record.get(key) or [])

    if matches("tp_replicated_parameter_patterns"):
        return full
    if matches("vocabulary_parameter_patterns"):
        full = F.pad(full, (0, 0, 0, padded - full.shape[0]), "constant", 0)
    if matches("parameter_with_2_sub_params_cat_dim_0"):
        return torch.cat([p.chunk(tp, dim=0)[t] for p in full.chunk(2, dim=0)], dim=0)
    sub = next((e for e in record.get("parameter_with_sub_params") or [] if any(re.match(p, name)
                                                                               for p in e["patterns"])), None)
    if sub is not None:  # each sub-param (sizes at shape[partition_dim]) cut in tp equal parts
        dim = sub["partition_dim"]
        return torch.cat([p.chunk(tp, dim=dim)[t] for p in full.split(sub["shape"][dim], dim=dim)], dim=dim)
    dim = 1 if matches("parameter_with_row_parallelism_patterns") else 0
    return full.chunk(tp, dim=dim)[t]


@pytest.mark.parametrize(("name", "tp", "dp", "d"), CASES, ids=[f"{n}-tp{t}-dp{p}-D{d}" for n, t, p, d in CASES])
def test_megatron_tp_change_equals_deepspeed_universal_route(name, tp, dp, d, tmp_path):
    fx = TP_DIR / name
    m = meta(fx)
    out = tmp_path / "o"
    _reshard(fx, out, tp * dp, tp_size=tp, make_vocab_size_divisible_by=d)
    padded = padded_vocab_size(30, d, tp)
    uni, tr = universal(fx), truth(fx)
    stage, bf16 = m["stage"], m["dtype"] == "bf16"
    src_step = _load(next((fx / "ckpt" / m["tag"]).glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt")))
    for t in range(tp):
        got = local_slices(out / m["tag"], t, stage=stage, dp=dp, bf16=bf16)
        for s in STATES:
            for n in m["params"]:
                want = _ds_route(fx, uni[f"{s}/{n}"], n, t, tp, padded)
                assert torch.equal(got[s][n], want), (t, s, n)
        ms = _load(out / m["tag"] / f"mp_rank_{t:02d}_model_states.pt")
        for n, v in ms["module"].items():
            assert torch.equal(v, _ds_route(fx, tr[f"lowp/{n}"], n, t, tp, padded)), (t, n)
        assert ms["mp_world_size"] == ms["checkpoint_parallel_dimensions"]["tp_degree"] == tp
        assert ms["args"]["tensor_model_parallel_size"] == tp
        assert ms["args"]["padded_vocab_size"] == ms["checkpoint_info"]["padded_vocab_size"] == padded
        # Megatron-DeepSpeed saves its record at every TP size (megatron/checkpointing.py), TP 1 included; its
        # sub_param_shard_widths are the target's (JSON: truth.json's record has lists for the saved tuples)
        want_record = {**m["universal_checkpoint_info"], "padded_vocab_size": padded}
        if "sub_param_shard_widths" in want_record:
            want_record["sub_param_shard_widths"] = {
                p: [[sum(w) // tp] * tp for w in ws] for p, ws in want_record["sub_param_shard_widths"].items()}
        assert json.loads(json.dumps(ms["universal_checkpoint_info"])) == want_record
        for f in (out / m["tag"]).glob(f"*zero_pp_rank_*_mp_rank_{t:02d}_optim_states.pt"):
            steps = {float(st["step"]) for st in _load(f)["optimizer_state_dict"]["base_optimizer_state"]["state"]
                     .values()}
            assert steps == {float(st["step"]) for st in src_step["optimizer_state_dict"]["base_optimizer_state"]
                             ["state"].values()} == {3.0}
    # read back by dsckpt: the real rows of every stored copy are the engine's truth, the padding rows zero
    cache = FileCache()
    back = read_checkpoint(out, cache=cache)
    assert (back.tp_world_size if tp > 1 else 1, back.dp_world_size) == (tp, dp)
    for n in m["params"]:
        e = back.entry(n)
        for s in STATES:
            p = e.piece(Role.MASTER) if s == "fp32" else e.state_piece(s)
            assert torch.equal(read_piece(p, e.shape, cache, name=n), tr[f"{TRUTH_KIND[s]}/{n}"]), (s, n)
        assert e.padding_rows == (padded - 30 if n in ("embed.weight", "head.weight") else 0)
        for p in e.padding:
            assert not read_piece(p, (e.padding_rows, *e.shape[1:]), cache, name=n).any(), (n, p.label)


@pytest.mark.parametrize(("mid_tp", "mid_dp", "d"), [(4, 1, 2), (1, 2, 16)], ids=["via-tp4-D2", "via-tp1-D16"])
def test_round_trip_keeps_real_rows_and_zeroes_old_padding(mid_tp, mid_dp, d, tmp_path):
    """TP 2 -> 4 -> 2 (D = 2) and TP 2 -> 1 -> 2 (D = 16: 32 rows at TP 1, the padding rows said by the TP-1 files'
    Megatron record): every real row of every copy as in the source; the source's padding rows (trained values) are
    not carried, as in DeepSpeed's route: zero after the round trip. Both reshards verify what they wrote in full."""
    fx = TP_DIR / "megatron_z2_fp32_tp2_dp2"
    _reshard(fx, tmp_path / "a", mid_tp * mid_dp, tp_size=mid_tp, make_vocab_size_divisible_by=d)
    cache = FileCache()
    from dsckpt.reshard import read_source_facts, run_reshard

    mid = read_checkpoint(tmp_path / "a", cache=cache)
    run_reshard(plan_reshard(mid, 4, tp_size=2, make_vocab_size_divisible_by=d, facts=read_source_facts(mid, cache)),
                tmp_path / "b", cache=cache, verify="full", workers=1)
    for t in range(2):
        src = local_slices(fx / "ckpt" / "global_step3", t, stage=2, dp=2, bf16=False)
        back = local_slices(tmp_path / "b" / "global_step3", t, stage=2, dp=2, bf16=False)
        for s in STATES:
            for n, v in src[s].items():
                if t == 1 and n in ("embed.weight", "head.weight"):  # TP rank 1's rows 16-31: 14 real, then padding
                    assert torch.equal(back[s][n][:14], v[:14]) and not back[s][n][14:].any(), (s, n)
                    # the source's padding rows held values (this model's loss never sees them: their initial values,
                    # weight-decayed; no gradient, so zero moments)
                    assert s != "fp32" or v[14:].any(), (s, n)
                else:
                    assert torch.equal(back[s][n], v), (t, s, n)


def test_tp1_padded_vocabulary_reads_as_original_rows(tmp_path):
    """TP 2 -> TP 1 with D = 16 (32 rows at TP 1): the TP-1 files keep the Megatron record (padded_vocab_size 32), so
    dsckpt reads the vocabulary as its 30 original rows -- ``to-fp32`` exports ds_to_universal's tensors exactly --
    and the 2 padding rows apart, zero. Control: the same files without the record read 32 rows (what every
    reader of a TP-1 checkpoint without it must do), and a record whose padded size disagrees with the rows is
    refused."""
    from safetensors.torch import load_file

    fx = TP_DIR / "megatron_z1_bf16_tp2_dp1"
    out = tmp_path / "tp1"
    _reshard(fx, out, 2, tp_size=1, make_vocab_size_divisible_by=16)
    r = CliRunner().invoke(main, ["to-fp32", str(out), str(tmp_path / "m.safetensors"), "-q"])
    assert r.exit_code == 0, r.output
    got, uni = load_file(tmp_path / "m.safetensors"), universal(fx)
    assert set(got) == set(meta(fx)["params"])
    for n, v in got.items():
        assert torch.equal(v, uni[f"fp32/{n}"]), n
    # --universal of the TP-1 files: ds_to_universal's tensors (the vocabulary cut to 30 rows, vocab_tensor set),
    # as DeepSpeed's own ds_to_universal writes them from these files (checked once by hand: all 56 files equal)
    r = CliRunner().invoke(main, ["reshard", str(out), str(tmp_path / "u"), "--universal", "-q"])
    assert r.exit_code == 0, r.output
    for n in meta(fx)["params"]:
        for s in STATES:
            d = _load(tmp_path / "u" / "global_step3_universal" / "zero" / n / f"{s}.pt")
            assert torch.equal(d["param"], uni[f"{s}/{n}"]), (s, n)
            assert d.get("vocab_tensor", False) == (n in ("embed.weight", "head.weight")), n
    cache = FileCache()
    back = read_checkpoint(out, cache=cache)
    assert back.tensor_parallel is not None and back.tensor_parallel.tp_size == 1
    assert any("read as its 30 original rows, 2 padding rows kept apart" in n for n in back.notes)
    e = back.entry("embed.weight")
    assert (e.shape, e.padding_rows, len(e.padding)) == ((30, 8), 2, len(e.pieces))
    for p in e.padding:
        assert not read_piece(p, (2, 8), cache, name=e.name).any(), p.label
    ms_path = out / "global_step3" / "mp_rank_00_model_states.pt"
    ms = _load(ms_path)
    del ms["universal_checkpoint_info"]
    torch.save(ms, ms_path)
    assert read_checkpoint(out).entry("embed.weight").shape == (32, 8)
    ms["universal_checkpoint_info"] = {**meta(fx)["universal_checkpoint_info"], "padded_vocab_size": 64}
    torch.save(ms, ms_path)
    with pytest.raises(UnsupportedCheckpointError, match=r"'embed.weight': TP ranks hold 32 rows, padded_vocab_size "
                                                         r"says 64"):
        read_checkpoint(out)


@pytest.mark.parametrize("name", MEGATRON)
def test_tp_change_without_divisor_refused(name, tmp_path):
    """The padded size at the new TP size is the model's (make_vocab_size_divisible_by x TP): without the option (and
    no make_vocab_size_divisible_by in the checkpoint's args) the change is refused, naming the option."""
    fx = TP_DIR / name
    for tp in ("4", "1"):
        r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(tmp_path / "o"), "-n", tp, "--tp-size", tp])
        assert r.exit_code == 3, r.output
        assert (f"changing the tensor-parallel size from 2 to {tp} re-pads the vocabulary of embed.weight, "
                "head.weight (30 rows, padded to 32 at TP 2)") in r.stderr
        assert "pass --make-vocab-size-divisible-by with the value the model trains with" in r.stderr
        assert not (tmp_path / "o").exists()


def test_wrong_divisor_or_uneven_split_refused(tmp_path):
    """A divisor that does not give the source's padded size is a usage error (exit 2); a split dim that does not
    divide by the new TP size is refused (exit 3)."""
    fx = TP_DIR / "megatron_z1_bf16_tp2_dp1"
    ckpt = read_checkpoint(fx / "ckpt")
    with pytest.raises(UsageError, match=r"--make-vocab-size-divisible-by 32 pads the 30-row vocabulary to 64 rows at "
                                         r"the source's TP size 2, but embed.weight, head.weight hold 32"):
        plan_reshard(ckpt, 4, tp_size=4, make_vocab_size_divisible_by=32, facts=derive_facts(ckpt))
    with pytest.raises(UnsupportedCheckpointError, match=r"'layers.0.fc1.weight': 12 \+ 12 on dim 0 do not split into "
                                                         r"5 equal parts"):
        plan_reshard(ckpt, 5, tp_size=5, make_vocab_size_divisible_by=2, facts=derive_facts(ckpt))


def test_divisor_recorded_in_args_is_used(tmp_path):
    """Megatron-DeepSpeed saves its args (an argparse.Namespace, make_vocab_size_divisible_by among them): a
    checkpoint that records it needs no option, and the output's args (still a Namespace) say the new TP size and
    padded vocabulary. Here the fixture's args dict replaced by such a Namespace (a hand-edited copy)."""
    import argparse
    import shutil

    from dsckpt.reshard import read_source_facts, run_reshard

    src = tmp_path / "src"
    shutil.copytree(TP_DIR / "megatron_z1_bf16_tp2_dp1" / "ckpt", src)
    for t in range(2):
        f = src / "global_step3" / f"mp_rank_{t:02d}_model_states.pt"
        sd = _load(f)
        sd["args"] = argparse.Namespace(**sd["args"], make_vocab_size_divisible_by=16)
        torch.save(sd, f)
    cache = FileCache()
    ckpt = read_checkpoint(src, cache=cache)
    facts = read_source_facts(ckpt, cache)
    assert facts.vocab_divisor == 16
    plan = plan_reshard(ckpt, 4, tp_size=4, facts=facts)
    assert plan.parallel.tp.name_to_cut["embed.weight"].rank_shapes == ((16, 8),) * 4
    assert any("padded to 64 (34 zero rows in every copy" in n for n in plan.notes)
    run_reshard(plan, tmp_path / "o", cache=cache, verify="full", workers=1)
    args = _load(tmp_path / "o" / "global_step3" / "mp_rank_03_model_states.pt")["args"]
    assert isinstance(args, argparse.Namespace)
    assert vars(args) == {**vars(_load(src / "global_step3" / "mp_rank_00_model_states.pt")["args"]),
                          "tensor_model_parallel_size": 4, "padded_vocab_size": 64}


def test_cli_megatron_tp_change(tmp_path):
    fx = TP_DIR / "megatron_z1_bf16_tp2_dp1"
    r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(tmp_path / "o"), "-n", "4", "--tp-size", "4",
                                  "--make-vocab-size-divisible-by", "16", "-q"])
    assert r.exit_code == 0, r.output
    assert "from 2 to 4 ranks (TP 2 x DP 1 -> TP 4 x DP 1)" in r.stdout
    r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(tmp_path / "u"), "--universal",
                                  "--make-vocab-size-divisible-by", "16"])
    assert r.exit_code == 2 and "--make-vocab-size-divisible-by" in r.stderr


def test_megatron_sub_params_tp_change_refused(tmp_path):
    """Another TP size > 1 for a fused param whose record gives its own per-rank widths (sub_param_shard_widths:
    the training code's cut, which Megatron's equal parts need not be) is refused, naming both params; nothing is
    written. TP 1 is test_megatron_tp_change_equals_deepspeed_universal_route, --universal test_tensor_parallel."""
    r = CliRunner().invoke(main, ["reshard", str(TP_DIR / GQA / "ckpt"), str(tmp_path / "o"), "-n", "4", "--tp-size",
                                  "4", "--make-vocab-size-divisible-by", "2"])
    assert r.exit_code == 3 and not (tmp_path / "o").exists()
    assert ("changing the tensor-parallel size of a Megatron-style TP record from 2 to 4 is not supported for 2 "
            "param(s): 'layers.0.attn.qkv.weight' is a fused param with recorded sub_param_shard_widths") in r.stderr
