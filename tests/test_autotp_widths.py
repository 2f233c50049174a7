"""DeepSpeed AutoTP's width rule at another TP size (dsckpt/autotp_widths.py): pure tests, no DeepSpeed launch.

The rule is checked against DeepSpeed 0.19.8's own ``get_shard_size_list`` over a grid, against the layouts DeepSpeed
itself chose for the same model at TP 2 and TP 4 (fixtures autotp_z1_bf16_tp{2,4}_dp1_kv6), and its refusals: a
rule the source's widths do not prove, fewer KV heads than target ranks, fused sub-params, no config.json."""

from __future__ import annotations

import itertools
import re
from functools import cache

import pytest
from test_autotp_fixtures import TP_DIR, load, meta

from dsckpt.autotp_widths import (
    AutoTpMeta,
    affine_entry,
    autotp_meta_from_config,
    read_autotp_meta,
    record_at,
    shard_widths,
    target_layout,
)
from dsckpt.errors import UnsupportedCheckpointError
from dsckpt.readers import read_checkpoint
from dsckpt.tensor_parallel import resize_layout

KV6_TP2 = TP_DIR / "autotp_z1_bf16_tp2_dp1_kv6"
KV6_TP4 = TP_DIR / "autotp_z1_bf16_tp4_dp1_kv6"


@cache
def layout(name: str):
    return read_checkpoint(TP_DIR / name / "ckpt").tensor_parallel


def fixture_meta(name: str) -> AutoTpMeta:
    """The rule's inputs from the model config the fixture was trained with (truth.json; the older fixtures have no
    config.json beside them)."""
    return autotp_meta_from_config(meta(TP_DIR / name)["model_config"], where="truth.json")


NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.3.mlp.gate_proj", "lm_head", "model.lm_head", "embed_out",
         "transformer.h.0.self_attention.query_key_value", "block.experts.w1", "layers.0.attn.down_proj", None]


def test_shard_widths_equal_deepspeeds_get_shard_size_list():
    """Every (total, tp, kv heads, grain, layer name) of a grid: the same widths as DeepSpeed 0.19.8's own function,
    or both refuse (DeepSpeed asserts, dsckpt raises ValueError)."""
    tp_shard = pytest.importorskip("deepspeed.module_inject.tp_shard")
    checked = 0
    for total, tp, kv, grain, name in itertools.product(range(1, 41), (1, 2, 3, 4, 8), (None, 1, 2, 3, 4, 6, 8),
                                                        (1, 2, 4), NAMES):
        ds_meta = tp_shard.AutoTPMeta(num_kv_heads=kv, tp_grain_size=grain)
        try:
            want = tuple(tp_shard.get_shard_size_list(total, tp, ds_meta, name))
        except AssertionError:
            want = None
        try:
            got = shard_widths(total, tp, AutoTpMeta(kv, grain), str(name))
        except ValueError:
            got = None
        assert got == want, (total, tp, kv, grain, name)
        checked += 1
    assert checked == 40 * 5 * 7 * 3 * len(NAMES)


def test_tp2_to_tp4_is_the_cut_deepspeed_chose_at_tp4():
    """The kv6 model trained at TP 2, resized to 4 by the rule: every param's per-rank shapes and widths equal the
    layout DeepSpeed itself wrote when training the same model at TP 4 (q_proj 8/8/4/4: 2/2/1/1 KV heads), and back."""
    meta6 = read_autotp_meta(KV6_TP2 / "ckpt", None)
    assert meta6 == AutoTpMeta(6, 1, f"num_key_value_heads=6 in {KV6_TP2 / 'ckpt' / 'config.json'}")
    src, ds4 = layout(KV6_TP2.name), layout(KV6_TP4.name)
    got = target_layout(src, 4, meta6)
    assert got.tp_size == 4 and got.name_to_cut == ds4.name_to_cut
    assert got.name_to_cut["model.layers.0.self_attn.q_proj.weight"].sub_widths == ((8, 8, 4, 4),)
    assert resize_layout(ds4, 2, meta=meta6).name_to_cut == src.name_to_cut


def test_kv3_rule_is_proven_and_refuses_more_ranks_than_kv_heads():
    """6 q / 3 KV heads at TP 2 (q_proj 16/8): proven with 3 KV heads; TP 3 gives one head per rank; TP 4 would
    leave a rank without a head (T not dividing the heads, more ranks than heads): refused naming the params."""
    src = layout("autotp_z1_bf16_tp2_dp1_kv3")
    kv3 = fixture_meta("autotp_z1_bf16_tp2_dp1_kv3")
    assert kv3.num_kv_heads == 3
    tp3 = target_layout(src, 3, kv3)
    assert tp3.name_to_cut["model.layers.1.self_attn.q_proj.weight"].sub_widths == ((8, 8, 8),)
    assert tp3.name_to_cut["model.layers.1.mlp.down_proj.weight"].rank_shapes == ((12, 4),) * 3
    assert tp3.name_to_cut["lm_head.weight"].sub_widths == ((11, 11, 10),)
    with pytest.raises(UnsupportedCheckpointError, match=re.escape(
            "'model.layers.0.self_attn.q_proj.weight': AutoTP's rule cuts its 24 along dim 0 as 8/8/8/0 at TP 4 "
            "(num_key_value_heads=3 in truth.json): TP rank 3 would hold none of it (fewer key/value heads than TP "
            "ranks)")):
        target_layout(src, 4, kv3)


def test_unprovable_rule_refused():
    """A rule that does not reproduce the source's widths is refused, naming the params: the kv3 checkpoint with a
    wrong head count (4: q_proj 24 is not a multiple, so AutoTP would split it evenly, 12/12; the checkpoint holds
    16/8), or none at all."""
    src = layout("autotp_z1_bf16_tp2_dp1_kv3")
    for wrong in (AutoTpMeta(4, 1, "num_key_value_heads=4"), AutoTpMeta(None, 1, "no heads")):
        with pytest.raises(UnsupportedCheckpointError) as e:
            target_layout(src, 3, wrong)
        msg = str(e.value)
        assert "'model.layers.0.self_attn.q_proj.weight': AutoTP's rule" in msg and "gives 12/12 at TP 2, the " \
            "checkpoint holds 16/8, so the rule is not proven for it" in msg
        assert "mlp" not in msg  # MLP widths do not depend on the heads: proven either way
    with pytest.raises(UnsupportedCheckpointError, match="needs the model's HF config.json beside the checkpoint"):
        target_layout(src, 3, None)


def test_refusals_fused_megatron_llama_kv2():
    falcon = layout("autotp_z1_bf16_tp2_dp1_falcon")
    with pytest.raises(UnsupportedCheckpointError, match=r"'transformer\.h\.0\.self_attention\.query_key_value\.weight'"
                                                         r" is fused from 1 sub-params"):
        target_layout(falcon, 4, fixture_meta("autotp_z1_bf16_tp2_dp1_falcon"))
    with pytest.raises(UnsupportedCheckpointError, match="Megatron-style TP record from 2 to 4 is not supported"):
        target_layout(layout("megatron_z2_fp32_tp2_dp2"), 4, AutoTpMeta(2))
    with pytest.raises(UnsupportedCheckpointError, match="pass --make-vocab-size-divisible-by"):
        resize_layout(layout("megatron_z1_bf16_tp2_dp1"), 4, meta=AutoTpMeta(2))
    with pytest.raises(UnsupportedCheckpointError, match=r"k_proj\.weight': AutoTP's rule cuts its 8 along dim 0 as "
                                                         r"4/4/0/0 at TP 4"):
        target_layout(layout("autotp_z1_bf16_tp2_dp1"), 4, fixture_meta("autotp_z1_bf16_tp2_dp1"))


def test_meta_from_config():
    assert autotp_meta_from_config({"num_attention_heads": 8, "num_key_value_heads": 2}).num_kv_heads == 2
    assert autotp_meta_from_config({"num_attention_heads": 8, "num_key_value_heads": None}).num_kv_heads == 8
    assert autotp_meta_from_config({"n_head_kv": 3, "num_attention_heads": 8}).num_kv_heads == 3
    assert autotp_meta_from_config({"num_attention_heads": 16, "text_config": {"num_kv_heads": 4}}).num_kv_heads == 4
    with pytest.raises(UnsupportedCheckpointError, match="names no key/value head count"):
        autotp_meta_from_config({"n_head": 12})  # GPT-2: DeepSpeed reads it through the class's attribute_map
    with pytest.raises(UnsupportedCheckpointError, match="is '4', not a positive integer"):
        autotp_meta_from_config({"num_key_value_heads": "4"})


def test_config_json_and_grain(tmp_path):
    assert read_autotp_meta(tmp_path, None) is None
    (tmp_path / "config.json").write_text('{"num_key_value_heads": 4}')
    assert read_autotp_meta(tmp_path, {"tensor_parallel": {"autotp_size": 2, "tp_grain_size": 8}}).tp_grain_size == 8
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(Exception, match="not a readable JSON model config"):
        read_autotp_meta(tmp_path, None)


def test_record_at_tp4_is_deepspeeds_record():
    """The TP-2 record rewritten for TP 4 equals, key for key and entry for entry, the record DeepSpeed wrote when
    training the same model at TP 4; a source entry the writer cannot reproduce is refused."""
    src, ds4 = layout(KV6_TP2.name), layout(KV6_TP4.name)
    rec2 = load(KV6_TP2 / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt")["universal_checkpoint_info"]
    rec4 = load(KV6_TP4 / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt")["universal_checkpoint_info"]
    got = record_at(rec2, src, target_layout(src, 4, AutoTpMeta(6)))
    assert got == rec4 and list(got) == list(rec4)
    assert list(got["affine_map"]["params"]) == list(rec4["affine_map"]["params"])
    assert record_at(rec4, ds4, src) == rec2
    assert affine_entry(src.name_to_cut["lm_head.weight"]) == rec2["affine_map"]["params"][r"^lm_head\.weight$"]
    bad = {**rec2, "affine_map": {**rec2["affine_map"], "params": dict(rec2["affine_map"]["params"])}}
    entry = bad["affine_map"]["params"][r"^lm_head\.weight$"]
    bad["affine_map"]["params"][r"^lm_head\.weight$"] = {**entry, "logical_shape": [31, 12]}
    with pytest.raises(UnsupportedCheckpointError, match=r"'lm_head\.weight': its affine_map entry is not the one"):
        record_at(bad, src, target_layout(src, 4, AutoTpMeta(6)))
