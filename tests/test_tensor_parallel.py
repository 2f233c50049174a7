"""Tensor parallelism (issue 20 phase 2): the record -> fragment mapping as pure arithmetic (Hypothesis), and the
commands on the real AutoTP / Megatron-style fixtures (``tests/fixtures/autotp/``) against DeepSpeed's own merge
(``universal_truth.safetensors``, written by ``ds_to_universal``) and the engine's logits."""

from __future__ import annotations

import dataclasses
import json
import math
import pickletools
import shutil
import struct
import sys
import zipfile
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from scan_helpers import Copy, assert_scan_and_verify_clean, copy_of, copy_tp_fixture, read_copy
from test_autotp_fixtures import (
    TP_DIR,
    TP_FIXTURES,
    TP_IDS,
    buffers,
    full_state,
    meta,
    plain_model,
    trainable,
    truth,
    universal,
)

from dsckpt import parsed_tree, safe_load, safe_save
from dsckpt.assemble import read_entry
from dsckpt.cli import main
from dsckpt.errors import DsckptError, UnsupportedCheckpointError
from dsckpt.layout import classify_files, find_tag_dir
from dsckpt.model import Fragment, Role
from dsckpt.parallel_layout import ParamCut, SplitKind
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.readers.common import lookup
from dsckpt.readers.tensor_parallel import rank_files
from dsckpt.readers.zero12 import read_zero12
from dsckpt.scan import scan
from dsckpt.stand_ins import SUBPARAM_SHAPE
from dsckpt.tensor_parallel import compose, tp_layout_from_record

ROLE_KEY = {Role.MASTER: "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


# --------------------------------------------------------------------------------------------
# Pure: record -> cut -> fragments


def _reference(cut: ParamCut) -> tuple[np.ndarray, list[np.ndarray]]:
    """The full tensor (values = flat index; -1 for vocabulary padding rows) and each rank's local slice, cut
    the way DeepSpeed's merge rules put them back together (ds_to_universal.merge_tp_slices)."""
    d = cut.dim
    assert d is not None
    padded = list(cut.full_shape)
    padded[d] = sum(sum(ws) for ws in cut.sub_widths)
    full = np.arange(math.prod(padded)).reshape(padded)
    if cut.keep_rows is not None:
        full[cut.keep_rows:] = -1
    locals_ = []
    for t in range(cut.tp_size):
        chunks, base = [], 0
        for ws in cut.sub_widths:
            start = base + sum(ws[:t])
            chunks.append(np.take(full, range(start, start + ws[t]), axis=d))
            base += sum(ws)
        locals_.append(np.concatenate(chunks, axis=d))
    return full, locals_


@st.composite
def cuts(draw):
    tp = draw(st.integers(1, 4))
    ndim = draw(st.integers(1, 3))
    kind = draw(st.sampled_from([SplitKind.COLUMN, SplitKind.ROW, SplitKind.VOCABULARY, SplitKind.SUB_PARAMS]))
    dim = 1 if kind is SplitKind.ROW or (kind is SplitKind.SUB_PARAMS and ndim > 1 and draw(st.booleans())) else 0
    ndim = max(ndim, dim + 1)
    n_sub = draw(st.integers(1, 3)) if kind is SplitKind.SUB_PARAMS else 1
    widths = tuple(tuple(draw(st.integers(0, 3)) for _ in range(tp)) for _ in range(n_sub))
    total = sum(sum(w) for w in widths)
    if total == 0:
        widths = ((1,) + widths[0][1:],) + widths[1:]
        total = 1
    other = [draw(st.integers(1, 4)) for _ in range(ndim)]
    keep = draw(st.integers(1, total)) if kind is SplitKind.VOCABULARY else None
    return make_cut(kind, dim, other, widths, keep)


def make_cut(kind: SplitKind, dim: int, other: list[int], widths: tuple[tuple[int, ...], ...],
             keep: int | None) -> ParamCut:
    """The cut of param ``w`` shaped ``other`` but on ``dim``: there each rank holds the sum of its sub-param
    ``widths`` and the full tensor their total (``keep`` rows of it for a vocabulary)."""
    full_shape = list(other)
    full_shape[dim] = keep if keep is not None else sum(map(sum, widths))
    ranks = []
    for t in range(len(widths[0])):
        s = list(other)
        s[dim] = sum(w[t] for w in widths)
        ranks.append(tuple(s))
    return ParamCut("w", kind, dim, tuple(full_shape), tuple(ranks), widths, keep)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(cut=cuts(), data=st.data())
def test_compose_places_every_local_element_once(cut, data):
    """Each rank's local flat tensor, cut into arbitrary contiguous ZeRO-like fragments, maps through
    rank_blocks + compose onto the full tensor exactly: every full element once, with its value, padding
    dropped; a fragment becomes at most 3 per block (partial head run, strided body, partial tail)."""
    full, locals_ = _reference(cut)
    logical = full.reshape(-1)[: math.prod(cut.full_shape)]
    out = np.full(logical.size, -7)
    hits = np.zeros(logical.size, dtype=int)
    for t, local in enumerate(locals_):
        flat = local.reshape(-1)
        n = flat.size
        cuts_at = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=4))) | {0, n})
        blocks = cut.rank_blocks(t)
        for a, b in pairwise(cuts_at):
            if a == b:
                continue
            src_base = data.draw(st.integers(0, 5))  # the fragment sits anywhere in its stored tensor
            frag = Fragment(Path("f"), (t,), src_base, b - a, a, t)
            mapped = compose(frag, blocks)
            assert len(mapped) <= 3 * len(blocks)
            for g in mapped:
                idx = np.array([g.dst_index(k) for k in range(g.numel)], dtype=int)
                assert [i for r in g.runs() for i in range(r.dst_offset, r.dst_offset + r.numel)] == list(idx)
                start = a + g.src_offset - src_base  # local index of the stored element g starts at
                vals = flat[start: start + g.numel]
                out[idx] = vals
                hits[idx] += 1
    assert (hits == 1).all()
    assert (out == logical).all()


@settings(derandomize=True, max_examples=300, deadline=None)
@given(cut=cuts())
def test_padding_blocks_place_every_padding_row_once(cut):
    """rank_blocks and padding_blocks together cover each rank's local elements exactly once; the padding blocks
    place every element of the padding rows [keep_rows, padded) once, with its value (its padded full index)."""
    full, locals_ = _reference(cut)
    padded_full = np.arange(full.size).reshape(full.shape)
    _, padded_locals = _reference(dataclasses.replace(cut, keep_rows=None))
    inner = math.prod(cut.full_shape[1:]) if cut.dim == 0 else 0
    pad_numel = cut.padding_rows * inner
    pad_out = np.full(pad_numel, -7)
    pad_hits = np.zeros(pad_numel, dtype=int)
    for t, local in enumerate(locals_):
        hits = np.zeros(local.size, dtype=int)
        for b in cut.rank_blocks(t):
            hits[b.local_offset: b.local_offset + b.numel] += 1
        for b in cut.padding_blocks(t):
            assert cut.kind is SplitKind.VOCABULARY and not b.run_numel
            hits[b.local_offset: b.local_offset + b.numel] += 1
            pad_out[b.full_offset: b.full_offset + b.numel] = padded_locals[t].reshape(-1)[
                b.local_offset: b.local_offset + b.numel]
            pad_hits[b.full_offset: b.full_offset + b.numel] += 1
        assert (hits == 1).all()
    assert (pad_hits == 1).all()
    keep = cut.keep_rows or 0
    assert (pad_out == padded_full.reshape(-1)[keep * inner: keep * inner + pad_numel]).all()


def _record(**cats) -> dict:
    return {"universal_checkpoint_version": 0.4, **cats}


def test_layout_from_record_categories():
    shapes = {"emb": [(16, 8), (16, 8)], "q": [(8, 8), (4, 8)], "o": [(8, 8), (8, 4)], "fc1": [(12, 8), (12, 8)],
              "ln": [(8,), (8,)]}
    rec = _record(tp_replicated_parameter_patterns=["ln"], parameter_with_row_parallelism_patterns=["o"],
                  vocabulary_parameter_patterns=["emb"], parameter_with_2_sub_params_cat_dim_0=["fc1"],
                  original_vocab_size=30, padded_vocab_size=32)
    layout = tp_layout_from_record(rec, shapes, where="x")
    c = layout.name_to_cut
    assert layout.source == "megatron"
    assert (c["emb"].kind, c["emb"].full_shape, c["emb"].keep_rows) == (SplitKind.VOCABULARY, (30, 8), 30)
    assert (c["q"].kind, c["q"].full_shape) == (SplitKind.COLUMN, (12, 8))  # uneven 8 / 4 rows
    assert (c["o"].kind, c["o"].full_shape) == (SplitKind.ROW, (8, 12))
    assert (c["fc1"].kind, c["fc1"].sub_widths) == (SplitKind.SUB_PARAMS, ((6, 6), (6, 6)))
    assert c["ln"].kind is SplitKind.REPLICATED
    assert c["o"].rank_blocks(1) == (c["o"].rank_blocks(1)[0],) and c["o"].rank_blocks(1)[0].run_numel == 4


@pytest.mark.parametrize("record, shapes, match", [
    (None, {"w": [(4, 2), (4, 2)]}, r"without a 'universal_checkpoint_info' record.*w"),
    (_record(affine_map={"version": 1, "params": {"^a$": {"logical_shape": [8, 2], "ranks": {}}}}),
     {"a": [(4, 2), (4, 2)], "b": [(4, 2), (4, 2)]}, r"'b' has no affine_map entry"),
    (_record(parameter_to_average_patterns=["w"]), {"w": [(4,), (4,)]}, r"'w' is averaged"),
    (_record(tp_replicated_parameter_patterns=["w"]), {"w": [(4,), (3,)]}, r"'w' is replicated but"),
    (_record(affine_map={"version": 1, "params": {"^a$": {"logical_shape": [4, 4]}}}), {"a": [(4, 2), (4, 2)]},
     r"affine_map says \[4, 4\]"),
    (_record(affine_map={"version": 1, "params": {"^a$": {"logical_shape": [8, 2]}}}), {"a": [(4, 2), (4, 2)]},
     r"'a': its affine_map entry is malformed"),
    (_record(vocabulary_parameter_patterns=["v"], original_vocab_size=14, padded_vocab_size=32),
     {"v": [(8, 2), (8, 2)]}, r"padded_vocab_size says 32"),
    (_record(autotp_unsupported_parameter_patterns={"^w$": "why"}), {"w": [(4,), (4,)]}, r"unsupported"),
])
def test_record_refusals(record, shapes, match):
    with pytest.raises(UnsupportedCheckpointError, match=match):
        tp_layout_from_record(record, shapes, where="ckpt/global_step3/mp_rank_00_model_states.pt")


# --------------------------------------------------------------------------------------------
# Real fixtures


@pytest.mark.parametrize("fx", TP_FIXTURES, ids=TP_IDS)
def test_to_fp32_is_bit_identical_to_deepspeed_merge(fx, tmp_path):
    out = tmp_path / "m.safetensors"
    r = CliRunner().invoke(main, ["to-fp32", str(fx / "ckpt"), str(out)])
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    # frozen params (their 16-bit module copy, upcast) and buffers: the live values merged at generation time
    got, want = load_file(str(out)), full_state(fx)
    assert sorted(got) == sorted(meta(fx)["params"] + buffers(fx))
    for n in got:
        assert torch.equal(got[n], want[n]), n


@pytest.mark.parametrize("fx", TP_FIXTURES, ids=TP_IDS)
def test_moments_and_16bit_copy_merge_exactly(fx):
    """Adam moments equal ds_to_universal's; the module copy (ZeRO-1/2) equals the live engine's params merged
    at generation time (truth lowp/<name>), vocabulary padding cut."""
    cache_ = FileCache()
    ckpt = read_checkpoint(fx / "ckpt", cache=cache_)
    assert ckpt.tp_world_size == meta(fx)["tp_size"] and ckpt.dp_world_size == meta(fx)["dp_world_size"]
    u, tr = universal(fx), truth(fx)
    for n in meta(fx)["params"]:
        e = ckpt.entry(n)
        assert list(e.shape) == meta(fx)["full_shapes"][n]
        assert e.trainable == (n in trainable(fx))
        for role, key in ROLE_KEY.items() if e.trainable else ():
            if role is Role.MASTER and e.piece(role) is None:  # fp32 stage 0: the module weights are the master
                assert (meta(fx)["stage"], meta(fx)["dtype"]) == (0, "fp32")
                role = Role.MODULE
            assert torch.equal(read_copy(e, cache_, role), u[f"{key}/{n}"]), (role, n)
        if meta(fx)["stage"] < 3:
            assert torch.equal(read_entry(e, cache_, Role.MODULE).float(), tr[f"lowp/{n}"].float()), n
    cache_.finish_checks()


def _split(fx: Path) -> dict[str, str]:
    r = CliRunner().invoke(main, ["info", "--json", str(fx / "ckpt")])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["tp_world_size"] == 2 and s["tensor_parallel"]["tp_size"] == 2
    return {t["name"]: t["tp_split"] for t in s["tensors"]}


def test_info_shows_split_per_tensor():
    sp = _split(TP_DIR / "autotp_z1_bf16_tp2_dp1")
    assert sp["model.layers.0.self_attn.q_proj.weight"] == "column dim 0 (8/8)"
    assert sp["model.layers.0.self_attn.o_proj.weight"] == "row dim 1 (8/8)"
    assert sp["model.norm.weight"] == "replicated"
    assert sp["lm_head.weight"] == "vocabulary dim 0 (16/16, 32 rows kept)"
    assert _split(TP_DIR / "autotp_z1_bf16_tp2_dp1_kv3")["model.layers.0.self_attn.q_proj.weight"] == \
        "column dim 0 (16/8)"
    assert _split(TP_DIR / "autotp_z1_bf16_tp2_dp1_vocab33")["lm_head.weight"] == \
        "vocabulary dim 0 (17/16, 33 rows kept)"
    assert _split(TP_DIR / "autotp_z1_bf16_tp2_dp1_falcon")["transformer.h.0.self_attention.query_key_value.weight"] \
        == "sub-params dim 0 (12/12, 1 sub-params)"
    sp = _split(TP_DIR / "megatron_z1_bf16_tp2_dp1")
    assert sp["embed.weight"] == "vocabulary dim 0 (16/16, 30 rows kept)"
    assert sp["layers.0.fc1.weight"] == "sub-params dim 0 (12/12, 2 sub-params)"
    assert sp["layers.0.fc2.weight"] == "row dim 1 (6/6)" and sp["layers.0.fc2.bias"] == "replicated"
    r = CliRunner().invoke(main, ["info", "--tensors", str(TP_DIR / "megatron_z1_bf16_tp2_dp1" / "ckpt")])
    assert "parallelism  data 1, pipeline 1, tensor 2" in r.stdout
    assert "tp sub-params dim 0 (12/12, 2 sub-params)" in r.stdout


@pytest.mark.parametrize("fx", TP_FIXTURES, ids=TP_IDS)
def test_scan_and_verify_clean(fx):
    assert_scan_and_verify_clean(fx / "ckpt")


def _set_local(ckpt: Path, tp_rank: int, name: str, role: Copy, local_index: int, value: float) -> None:
    """Set element ``local_index`` of TP rank ``tp_rank``'s local slice, located by the plain ZeRO-1/2 reader of
    that rank alone (no TP mapping involved)."""
    root, tag, tag_dir = find_tag_dir(ckpt, None)
    local = read_zero12(rank_files(classify_files(root, tag, tag_dir), tp_rank), FileCache())
    piece = copy_of(local.entry(name), role)
    assert piece is not None
    f = next(f for f in piece.fragments if f.dst_offset <= local_index < f.dst_offset + f.numel)
    tree = parsed_tree.materialize(safe_load.load(f.file))
    lookup(tree, f.key, f.file).view(-1)[f.src_offset + local_index - f.dst_offset] = value
    safe_save.save(tree, f.file)


@pytest.mark.parametrize("fx_name, name, tp_rank, local_rc, local_shape_cols, full_index", [
    # row-parallel o_proj (8, 16): TP rank 1 holds columns 8..15; local (3, 5) is full (3, 13)
    ("autotp_z2_fp32_tp2_dp2", "model.layers.1.self_attn.o_proj.weight", 1, (3, 5), 8, 3 * 16 + 13),
    # Megatron fused [gate; up] fc1 (24, 8): TP rank 1's local row 7 is its up-half row 1 -> full row 12 + 6 + 1
    ("megatron_z2_fp32_tp2_dp2", "layers.0.fc1.weight", 1, (7, 2), 8, 19 * 8 + 2),
    # vocab33 lm_head: TP rank 1's local row 0 is full row 17
    ("autotp_z1_bf16_tp2_dp1_vocab33", "lm_head.weight", 1, (0, 4), 8, 17 * 8 + 4),
    # fp16 (CPU forced): the same row-parallel o_proj cut as the fp32 one
    ("autotp_z1_fp16_tp2_dp1_cpuforced", "model.layers.1.self_attn.o_proj.weight", 1, (3, 5), 8, 3 * 16 + 13),
])
def test_scan_finds_inf_in_one_tp_slice_at_full_index(tmp_path, fx_name, name, tp_rank, local_rc, local_shape_cols,
                                                      full_index):
    ckpt = copy_tp_fixture(TP_DIR / fx_name, tmp_path)
    _set_local(ckpt, tp_rank, name, Role.MASTER, local_rc[0] * local_shape_cols + local_rc[1], float("inf"))
    report = scan(ckpt)
    bad = [f for f in report.findings if f.count]
    assert len(bad) >= 1
    master = [f for f in bad if f.name == name and f.kind.value == "fp32 master"]
    assert len(master) == 1 and master[0].first_indices == (full_index,) and master[0].posinf == 1, \
        [f.describe() for f in bad]
    assert f"mp_rank_{tp_rank:02d}" in master[0].file.name
    r = CliRunner().invoke(main, ["scan", str(ckpt)])
    assert r.exit_code == 1 and name in r.stdout


@pytest.mark.parametrize("chunk_numel", [None, 7, 40])
def test_scan_reads_a_row_slice_whole_and_names_full_indices_in_order(tmp_path, chunk_numel):
    """A row-parallel slice is strided in the full tensor; scan reads the part of it each chunk needs in one go
    (chunks of 7 cut its rows of 8 anywhere) and still reports every full index, in increasing order: two infs in
    TP rank 1's master (full rows 1 and 6) and a changed 16-bit module value on TP rank 0 (a mismatch)."""
    name = "model.layers.1.self_attn.o_proj.weight"  # (8, 16), rank 0 columns 0..7, rank 1 columns 8..15
    ckpt = copy_tp_fixture(TP_DIR / "autotp_z1_bf16_tp2_dp1", tmp_path)
    _set_local(ckpt, 1, name, Role.MASTER, 6 * 8 + 2, float("-inf"))
    _set_local(ckpt, 1, name, Role.MASTER, 1 * 8 + 7, float("inf"))
    _set_local(ckpt, 0, name, Role.MODULE, 4 * 8 + 3, 1000.0)
    report = scan(ckpt, chunk_numel=chunk_numel)
    got = sorted((f.check.value, f.kind.value, f.count, f.first_indices, f.file.name) for f in report.findings)
    assert got == [
        ("mismatch", "param", 1, (4 * 16 + 3,), "mp_rank_00_model_states.pt"),
        ("nonfinite", "fp32 master", 2, (1 * 16 + 15, 6 * 16 + 10), "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"),
    ], [f.describe() for f in report.findings]


@pytest.mark.parametrize("fx_name, role, kind", [
    ("megatron_z2_fp32_tp2_dp2", Role.MASTER, "fp32 master"),
    ("megatron_z1_bf16_tp2_dp1", "exp_avg_sq", "exp_avg_sq"),
    ("megatron_z1_bf16_tp2_dp1", Role.MODULE, "param"),
])
def test_scan_finds_inf_in_a_vocabulary_padding_row(tmp_path, fx_name, role, kind):
    """Padding rows (30-31 of the 32-row vocabulary, on TP rank 1 as its local rows 14-15) are trained values: an
    inf there is a finding under the param's name, saying which padding rows and where (file, key), with its index
    into the padding rows; to-fp32 still writes the 30 real rows only."""
    ckpt = copy_tp_fixture(TP_DIR / fx_name, tmp_path)
    _set_local(ckpt, 1, "head.weight", role, 15 * 8 + 3, float("inf"))  # padding row 31, column 3
    report = scan(ckpt)
    assert [(f.name, f.padding_rows, f.kind.value, f.first_indices, f.posinf) for f in report.findings] == [
        ("head.weight", (30, 32), kind, (8 + 3,), 1)], [f.describe() for f in report.findings]
    assert "mp_rank_01" in report.findings[0].file.name
    r = CliRunner().invoke(main, ["scan", str(ckpt)])
    assert r.exit_code == 1 and "head.weight vocabulary padding rows 30-31: " in r.stdout
    ckpt_logical = read_checkpoint(ckpt)
    e = ckpt_logical.entry("head.weight")
    assert (e.shape, e.padding_rows, e.padding_numel) == ((30, 8), 2, 16)
    assert bool(torch.isfinite(read_copy(e, FileCache(), role)).all())


FP16_TP = [TP_DIR / "autotp_z1_fp16_tp2_dp1_cpuforced", TP_DIR / "autotp_z3_fp16_tp2_dp1_cpuforced"]


@pytest.mark.parametrize("fx", FP16_TP, ids=[f.name for f in FP16_TP])
def test_fp16_tp_info_names_precision_and_loss_scale_checks(fx, tmp_path):
    """fp16 AutoTP (CPU forced, DynamicLossScaler): info says fp16 and TP 2 and the ZeRO wrapper DeepSpeed used;
    the recorded run had no overflow (skipped steps 0, scale 2**8 kept, Adam step = global steps). The loss scaler
    is checked as in any fp16 checkpoint: an inf scale in both TP ranks' optimizer files is a scan finding per
    file; a scale that differs between the TP ranks' files is a verify problem naming both files."""
    m = meta(fx)
    assert (m["device"], m["dtype"], m["skipped_steps"], m["global_steps"], m["adam_step"]) == \
        ("cpu-forced-fp16", "fp16", 0, 3, [3.0])
    assert (m["loss_scaler"]["class"], m["loss_scaler"]["cur_scale"], m["loss_scaler"]["last_overflow_iter"]) == \
        ("DynamicLossScaler", 256, -1)
    r = CliRunner().invoke(main, ["info", "--json", str(fx / "ckpt")])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert (s["precision"], s["tp_world_size"], s["dp_world_size"], s["zero_stage"], s["optimizer_wrapper"]) == \
        ("fp16", 2, 1, m["stage"], m["optimizer_wrapper"])
    assert s["health"]["ok"] and s["tensor_parallel"]["tp_size"] == 2

    def set_scale(ckpt: Path, tp_rank: int, value: float) -> None:
        f = ckpt / m["tag"] / f"zero_pp_rank_0_mp_rank_{tp_rank:02d}_optim_states.pt"
        tree = parsed_tree.materialize(safe_load.load(f))
        tree["optimizer_state_dict"]["loss_scaler"].__dict__["cur_scale"] = value
        safe_save.save(tree, f)

    inf_scale = copy_tp_fixture(fx, tmp_path / "inf")
    for t in range(2):
        set_scale(inf_scale, t, math.inf)
    report = scan(inf_scale)
    key = "['optimizer_state_dict']['loss_scaler']['cur_scale']"
    assert sorted((f.file.name, f.key_str, f.posinf) for f in report.findings) == [
        (f"zero_pp_rank_0_mp_rank_{t:02d}_optim_states.pt", key, 1) for t in range(2)]
    odd_scale = copy_tp_fixture(fx, tmp_path / "odd")
    set_scale(odd_scale, 1, 128.0)
    r = CliRunner().invoke(main, ["verify", str(odd_scale)])
    assert r.exit_code == 1, r.output
    assert ("loss_scaler: files disagree (loss_scaler.cur_scale = 256 in zero_pp_rank_0_mp_rank_00_optim_states.pt"
            " | loss_scaler.cur_scale = 128.0 in zero_pp_rank_0_mp_rank_01_optim_states.pt)") in r.stdout


def test_verify_flips_when_replicated_copies_disagree(tmp_path):
    ckpt = copy_tp_fixture(TP_DIR / "autotp_z2_fp32_tp2_dp2", tmp_path)
    _set_local(ckpt, 1, "model.norm.weight", Role.MASTER, 2, 0.5)
    r = CliRunner().invoke(main, ["verify", str(ckpt)])
    assert r.exit_code == 1, r.output
    line = next(ln for ln in r.stdout.splitlines() if "model.norm.weight" in ln)
    assert "replica" in line and "differs from replica 0 in 1 element(s)" in line and "first at flat index 2" in line
    assert "mp_rank_01" in line


def test_diff_export_vs_deepspeed_merge_is_equal(tmp_path):
    fx = TP_DIR / "autotp_z1_bf16_tp2_dp1_falcon"
    out = tmp_path / "m.safetensors"
    assert CliRunner().invoke(main, ["to-fp32", str(fx / "ckpt"), str(out)]).exit_code == 0
    from safetensors.torch import save_file

    ref = tmp_path / "ref.safetensors"
    save_file({k[5:]: v.contiguous() for k, v in universal(fx).items() if k.startswith("fp32/")}, str(ref))
    for a in (out, fx / "ckpt"):
        r = CliRunner().invoke(main, ["diff", str(a), str(ref)])
        assert r.exit_code == 0, r.output


@pytest.mark.parametrize("chunk_numel", [1 << 20, 7])
def test_diff_reads_row_slices_whole_and_names_full_indices(tmp_path, chunk_numel):
    """diff reads a TP row slice a window at a time in one go and places it strided: two changed master elements
    of TP rank 1's o_proj slice (full rows 1 and 6) are the only differences, at their full indices, whatever
    the window; every other tensor, row-parallel ones included, is bitwise equal."""
    from dsckpt.diff import diff

    name = "model.layers.1.self_attn.o_proj.weight"  # (8, 16), rank 1 columns 8..15
    ckpt = copy_tp_fixture(TP_DIR / "autotp_z1_bf16_tp2_dp1", tmp_path)
    _set_local(ckpt, 1, name, Role.MASTER, 6 * 8 + 2, 5.0)
    _set_local(ckpt, 1, name, Role.MASTER, 1 * 8 + 7, -5.0)
    report = diff(ckpt, TP_DIR / "autotp_z1_bf16_tp2_dp1" / "ckpt", chunk_numel=chunk_numel)
    differ = [(t.name, t.n_differ, t.first_indices) for t in report.tensors if not t.bitwise_equal]
    assert differ == [(name, 2, (1 * 16 + 15, 6 * 16 + 10))], [t.describe() for t in report.tensors]
    assert len(report.tensors) > 20


def _edit_record(ckpt: Path, edit) -> None:
    for t in range(2):
        p = ckpt / "global_step3" / f"mp_rank_{t:02d}_model_states.pt"
        tree = parsed_tree.materialize(safe_load.load(p))
        edit(tree["universal_checkpoint_info"])
        safe_save.save(tree, p)


def test_record_without_param_is_refused(tmp_path):
    """A param the AutoTP record does not cover: exit 3 naming it, nothing guessed."""
    ckpt = copy_tp_fixture(TP_DIR / "autotp_z1_bf16_tp2_dp1", tmp_path)
    _edit_record(ckpt, lambda uc: uc["affine_map"]["params"].pop(r"^model\.layers\.1\.mlp\.up_proj\.weight$"))
    r = CliRunner().invoke(main, ["to-fp32", str(ckpt), str(tmp_path / "o.safetensors")])
    assert r.exit_code == 3 and r.stdout == ""
    assert "'model.layers.1.mlp.up_proj.weight' has no affine_map entry" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.safetensors").exists()


def test_affine_map_contradicting_the_patterns_is_refused(tmp_path):
    """AutoTP's affine_map is checked against the category patterns: a row-parallel param whose map says it is
    cut by rows (as if column-parallel) is refused, not read either way."""
    ckpt = copy_tp_fixture(TP_DIR / "autotp_z1_bf16_tp2_dp1", tmp_path)
    key = r"^model\.layers\.0\.self_attn\.o_proj\.weight$"

    def edit(uc):
        uc["affine_map"]["params"][key]["ranks"][1]["pieces"][0]["source"] = [64, [16, 1]]

    _edit_record(ckpt, edit)
    r = CliRunner().invoke(main, ["info", str(ckpt)])
    assert r.exit_code == 3
    assert "'model.layers.0.self_attn.o_proj.weight': TP rank 1's local element 0 goes to full element 64 by its " \
           "affine_map, to 8 by the category patterns" in r.stderr


def test_reshard_refuses_tensor_parallel_size_change(tmp_path):
    # Another TP size needs the KV heads from config.json (tests/test_reshard_tp.py, tests/test_autotp_widths.py);
    # with it, 2 KV heads at TP 4 would leave two ranks without a head: refused, nothing written
    import json
    import shutil

    r = CliRunner().invoke(main, ["reshard", str(TP_DIR / "autotp_z1_bf16_tp2_dp1" / "ckpt"), str(tmp_path / "o"),
                                  "-n", "4", "--tp-size", "4"])
    assert r.exit_code == 3
    assert "tensor-parallel size from 2 to 4 needs the model's HF config.json beside the checkpoint" in r.stderr
    ckpt = shutil.copytree(TP_DIR / "autotp_z1_bf16_tp2_dp1" / "ckpt", tmp_path / "ckpt")
    (ckpt / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2}))
    r = CliRunner().invoke(main, ["reshard", str(ckpt), str(tmp_path / "o"), "-n", "4", "--tp-size", "4"])
    assert r.exit_code == 3 and not (tmp_path / "o").exists()
    assert "dsckpt cannot derive AutoTP's cut of 8 param(s): 'model.layers.0.self_attn.q_proj.weight': AutoTP's " \
           "rule cuts its 16 along dim 0 as 8/8/0/0 at TP 4 (num_key_value_heads=2 in" in r.stderr


UNIVERSAL_CASES = ["autotp_z1_bf16_tp2_dp1_falcon", "autotp_z3_fp32_tp2_dp2", "megatron_z1_bf16_tp2_dp2_bf16opt",
                   "megatron_z1_fp32_tp2_dp1_gqa"]


@pytest.mark.parametrize("name", UNIVERSAL_CASES, ids=UNIVERSAL_CASES)
def test_reads_ds_to_universal_output_of_tp_run(name, tmp_path):
    """ds_to_universal's folder of a TP run reads as the run: masters and Adam moments equal DeepSpeed's merge, the
    16-bit copies the live engine's. The folder is dsckpt's reshard --universal, shown here to be ds_to_universal's
    file for file (its output recorded by tests/fixtures/record_ds_to_universal.py)."""
    from universal_record import ds_to_universal_differences

    fx = TP_DIR / name
    r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(tmp_path / "u"), "--universal", "-q"])
    assert r.exit_code == 0, r.output
    assert ds_to_universal_differences(fx, tmp_path / "u") == []
    out = tmp_path / "u" / f"{meta(fx)['tag']}_universal"
    cache_ = FileCache()
    ckpt = read_checkpoint(out, cache=cache_)
    assert ckpt.layout.startswith("universal") and ckpt.tp_world_size == 2
    u = universal(fx)
    for n in meta(fx)["params"]:
        e = ckpt.entry(n)
        for role, key in ROLE_KEY.items():
            if role is Role.MASTER and e.piece(role) is None:  # fp32 stage 0: the module weights are the master
                assert (meta(fx)["stage"], meta(fx)["dtype"]) == (0, "fp32")
                role = Role.MODULE
            assert torch.equal(read_copy(e, cache_, role), u[f"{key}/{n}"]), (role, n)
        if meta(fx)["stage"] < 3:  # the 16-bit copies come from the copied TP-rank model-states files
            assert torch.equal(read_entry(e, cache_, Role.MODULE).float(), truth(fx)[f"lowp/{n}"].float()), n
    assert scan(out).findings == ()


# --------------------------------------------------------------------------------------------
# parameter_with_sub_params (Megatron-style): ds_to_universal pickles DeepSpeed's SubparamShape

GQA = TP_DIR / "megatron_z1_fp32_tp2_dp1_gqa"
QKV = [f"layers.{i}.attn.qkv.weight" for i in range(2)]
# The sub_param_shape value of ds_to_universal 0.19.8's zero/layers.<i>.attn.qkv.weight/<state>.pt of this fixture,
# read with pickletools (memo opcodes left out): protocol 2's pickle of a dataclass instance -- the class by GLOBAL,
# NEWOBJ of no arguments, its __dict__ (the record's entry, fields in the dataclass's order), BUILD
SUBPARAM_SHAPE_OPS = [
    ("GLOBAL", "deepspeed.checkpoint.universal_checkpoint SubparamShape"), ("EMPTY_TUPLE", None), ("NEWOBJ", None),
    ("EMPTY_DICT", None), ("MARK", None),
    ("BINUNICODE", "patterns"), ("EMPTY_LIST", None), ("BINUNICODE", r"layers\.\d+\.attn\.qkv\.weight"),
    ("APPEND", None),
    ("BINUNICODE", "shape"), ("EMPTY_LIST", None), ("MARK", None), ("BININT1", 8), ("BININT1", 4), ("BININT1", 4),
    ("TUPLE3", None), ("BININT1", 8), ("APPENDS", None),
    ("BINUNICODE", "partition_dim"), ("BININT1", 0), ("SETITEMS", None), ("BUILD", None)]
GQA_ENTRY = {"patterns": [r"layers\.\d+\.attn\.qkv\.weight"], "shape": [(8, 4, 4), 8], "partition_dim": 0}


def _data_pkl(path: Path) -> bytes:
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def _sub_param_shape_pickle(path: Path) -> tuple[list[tuple[str, object]], bytes]:
    """The opcodes (memo ones left out) of the ``sub_param_shape`` value in the torch file ``path``, and the bytes
    of its pickle up to that value's BUILD (the first key of both DeepSpeed's dict and dsckpt's)."""
    data = _data_pkl(path)
    ops = [(op.name, arg, pos) for op, arg, pos in pickletools.genops(data) if "PUT" not in op.name
           and op.name != "MEMOIZE"]
    start = [(n, a) for n, a, _ in ops].index(("BINUNICODE", "sub_param_shape")) + 1
    end = next(i for i in range(start, len(ops)) if ops[i][0] == "BUILD")
    return [(n, a) for n, a, _ in ops[start:end + 1]], data[:ops[end][2] + 1]


def test_sub_param_shape_is_pickled_as_ds_to_universal_pickles_it(tmp_path):
    """reshard --universal of a Megatron-style record with parameter_with_sub_params (the GQA fixture's fused qkv,
    sub-params of 8/4/4 rows): each qkv state file is {"sub_param_shape": SubparamShape, "param": <full>}, as
    ds_to_universal writes it, the SubparamShape opcode for opcode as DeepSpeed pickles it, and the pickled bytes of
    that value equal DeepSpeed's own (its files of this fixture, ``ds_to_universal_qkv/``, kept for this). dsckpt's
    safe loader reads it as the stand-in of exactly the record's entry (the sizes a tuple, which DeepSpeed's
    universal loader needs); the other params keep their category keys."""
    r = CliRunner().invoke(main, ["reshard", str(GQA / "ckpt"), str(tmp_path / "u"), "--universal", "-q"])
    assert r.exit_code == 0, r.output
    zero = tmp_path / "u" / "global_step3_universal" / "zero"
    assert meta(GQA)["universal_checkpoint_info"]["parameter_with_sub_params"] == [
        {**GQA_ENTRY, "shape": [[8, 4, 4], 8]}]  # truth.json: JSON
    for name in QKV:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            ours, theirs = zero / name / f"{state}.pt", GQA / "ds_to_universal_qkv" / "zero" / name / f"{state}.pt"
            (ops, raw), (ds_ops, ds_raw) = _sub_param_shape_pickle(ours), _sub_param_shape_pickle(theirs)
            assert ops == ds_ops == SUBPARAM_SHAPE_OPS
            assert raw == ds_raw
            tree = safe_load.load(ours)
            assert list(tree) == ["sub_param_shape", "param"]
            sps = tree["sub_param_shape"]
            assert (type(sps).ds_module, type(sps).ds_name) == SUBPARAM_SHAPE
            assert list(sps.__dict__.items()) == list(GQA_ENTRY.items())
            assert type(sps.shape) is list and type(sps.shape[0]) is tuple
    assert list(safe_load.load(zero / "layers.0.fc1.weight" / "fp32.pt")) == ["cat_dim", "param_n_sub_params", "param"]
    assert list(safe_load.load(zero / "layers.0.attn.dense.weight" / "fp32.pt")) == ["cat_dim", "param"]


def test_reads_ds_to_universal_sub_param_files(tmp_path):
    """DeepSpeed's own qkv files of the GQA fixture (``ds_to_universal_qkv/``: ds_to_universal 0.19.8's
    zero/layers.<i>.attn.qkv.weight/{fp32,exp_avg,exp_avg_sq}.pt, SubparamShape pickled in them) in the universal
    folder read through dsckpt's allow-list as the run: masters and Adam moments equal DeepSpeed's merge and the
    engine's truth; to-fp32 exports every param exactly. (The whole folder ds_to_universal writes: live,
    test_ds_to_universal_record.py test_reads_ds_to_universal_folder_of_sub_params_live.)"""
    r = CliRunner().invoke(main, ["reshard", str(GQA / "ckpt"), str(tmp_path / "u"), "--universal", "-q"])
    assert r.exit_code == 0, r.output
    zero = tmp_path / "u" / "global_step3_universal" / "zero"
    for name in QKV:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            shutil.copyfile(GQA / "ds_to_universal_qkv" / "zero" / name / f"{state}.pt", zero / name / f"{state}.pt")
    cache_ = FileCache()
    ckpt = read_checkpoint(tmp_path / "u" / "global_step3_universal", cache=cache_)
    u, tr = universal(GQA), truth(GQA)
    for name in QKV:
        e = ckpt.entry(name)
        assert e.shape == (16, 8)
        for role, key in ROLE_KEY.items():
            assert torch.equal(read_copy(e, cache_, role), u[f"{key}/{name}"]), (role, name)
    r = CliRunner().invoke(main, ["to-fp32", str(tmp_path / "u"), str(tmp_path / "m.safetensors"), "-q"])
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "m.safetensors"))
    assert sorted(got) == sorted(meta(GQA)["params"])
    assert all(torch.equal(got[n], tr[f"param/{n}"]) for n in got)


def _subparam_pickle(state: bytes) -> bytes:
    """A pickle of ``SubparamShape`` with ``state`` (pickle opcodes) as what BUILD sets: hand-built, malformed ones
    included."""
    return (b"\x80\x02cdeepspeed.checkpoint.universal_checkpoint\nSubparamShape\n)\x81" + state + b"b.")


def _u(x: str) -> bytes:
    raw = x.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


_FIELDS = {"patterns": b"]" + _u("p") + b"a", "shape": b"](K\x08K\x04K\x04\x87K\x08e", "partition_dim": b"K\x00"}


@pytest.mark.parametrize("state, ok", [
    (b"}(" + b"".join(_u(k) + v for k, v in _FIELDS.items()) + b"u", True),
    (b"}(" + b"".join(_u(k) + v for k, v in _FIELDS.items() if k != "partition_dim") + b"u", False),
    (b"}(" + b"".join(_u(k) + v for k, v in _FIELDS.items()) + _u("extra") + b"K\x01u", False),
    (b"}(" + b"".join(_u(k) + v for k, v in _FIELDS.items()) + _u("__reduce_ex__") + b"K\x01u", False),
    (b"N", False),
], ids=["its-fields", "missing-field", "extra-field", "dunder-field", "not-a-dict"])
def test_subparam_shape_stand_in_takes_exactly_its_fields(tmp_path, state, ok):
    """The allow-list's SubparamShape stand-in takes a state of exactly the dataclass's three fields (patterns, shape,
    partition_dim); any other state is refused before anything uses it."""
    f = tmp_path / "s.pkl"
    f.write_bytes(_subparam_pickle(state))
    if ok:
        obj = safe_load.load_pickle(f)
        assert (type(obj).ds_name, obj.__dict__) == ("SubparamShape", {"patterns": ["p"], "shape": [(8, 4, 4), 8],
                                                                       "partition_dim": 0})
    else:
        with pytest.raises(DsckptError, match="refusing the state"):
            safe_load.load_pickle(f)


@pytest.mark.parametrize("entry", [
    {**GQA_ENTRY, "extra": 1},  # SubparamShape(**entry) fails in ds_to_universal
    {k: v for k, v in GQA_ENTRY.items() if k != "partition_dim"},
    {**GQA_ENTRY, "shape": [3, 8]},  # the pre-0.4 count of equal sub-params: ds_to_universal rewrites it
    {**GQA_ENTRY, "shape": [(8, 2, 6), 8]},  # sizes the widths do not add up to
    {**GQA_ENTRY, "partition_dim": 1},  # not the cut's dim
], ids=["extra-key", "no-partition-dim", "count-not-sizes", "other-sizes", "other-dim"])
def test_universal_refuses_sub_params_entry_it_cannot_write(entry):
    """A parameter_with_sub_params entry that is not the SubparamShape ds_to_universal writes back unchanged is
    refused by the universal target's rows (naming the params), as before this was written; the fixture's own entry is written."""
    from dsckpt.ds_writers.universal import universal_tp_keys
    from dsckpt.reshard import plan_universal_reshard, read_source_facts

    cache_ = FileCache()
    ckpt = read_checkpoint(GQA / "ckpt", cache=cache_)
    tp = ckpt.tensor_parallel
    assert tp is not None
    (key, value), = universal_tp_keys(tp.name_to_cut[QKV[0]], tp.source)
    assert key == "sub_param_shape" and value.__dict__ == GQA_ENTRY
    cuts = {n: dataclasses.replace(c, sub_param_entry=entry) if n in QKV else c for n, c in tp.name_to_cut.items()}
    bad = dataclasses.replace(ckpt, tensor_parallel=dataclasses.replace(tp, name_to_cut=cuts))
    with pytest.raises(UnsupportedCheckpointError, match=r"found params with sub-params \(layers\.0\.attn\.qkv\.weight, "
                       r"layers\.1\.attn\.qkv\.weight\) whose parameter_with_sub_params entry"):
        plan_universal_reshard(bad, read_source_facts(bad, cache_))


def test_universal_notes_sub_param_sizes_deepspeed_cannot_load():
    """Sub-param sizes saved as a list (JSON-like) rather than a tuple: ds_to_universal writes them back as they are,
    and so does dsckpt, but DeepSpeed 0.19.8's universal loader reads sizes only from a tuple: the plan says so. The
    fixture's tuple gets no such note."""
    from dsckpt.reshard import plan_universal_reshard, read_source_facts

    cache_ = FileCache()
    ckpt = read_checkpoint(GQA / "ckpt", cache=cache_)
    tp = ckpt.tensor_parallel
    assert tp is not None
    plan = plan_universal_reshard(ckpt, read_source_facts(ckpt, cache_))
    assert not any("as a list" in n for n in plan.describe())
    listed = {**GQA_ENTRY, "shape": [[8, 4, 4], 8]}
    cuts = {n: dataclasses.replace(c, sub_param_entry=listed) if n in QKV else c for n, c in tp.name_to_cut.items()}
    ckpt = dataclasses.replace(ckpt, tensor_parallel=dataclasses.replace(tp, name_to_cut=cuts))
    notes = [n for n in plan_universal_reshard(ckpt, read_source_facts(ckpt, cache_)).describe() if "as a list" in n]
    assert notes == ["note: the record lists the sub-param sizes of layers.0.attn.qkv.weight, layers.1.attn.qkv.weight "
                     "as a list, which DeepSpeed 0.19.8's universal loader does not take (it reads them from a tuple): "
                     "written as ds_to_universal writes them, but load_universal will fail on them as on "
                     "ds_to_universal's folder"]


HF_CASES = [f.name for f in TP_FIXTURES if meta(f)["arch"] != "megatron"]


@pytest.mark.parametrize("name", HF_CASES, ids=HF_CASES)
def test_hf_export_reproduces_engine_logits(name, tmp_path):
    """The fixtures have no config.json: write the model's config beside 'latest' in a copy; to-fp32 into a
    folder then loads with from_pretrained. Its logits equal those of a same-machine reference (DeepSpeed's
    merged fp32 in the same model) exactly, and the engine's recorded logits within phase 1's tolerances:
    fp32 runs to fp32 rounding (TP all-reduce order, 2.98e-8 recorded), bf16 runs within the bf16 rounding of the
    engine's own logits (max |logit| < 0.33 here)."""
    transformers = pytest.importorskip("transformers")
    fx = TP_DIR / name
    ckpt = copy_tp_fixture(fx, tmp_path)
    sys.path.insert(0, str(TP_DIR.parent))
    try:
        import autotp_models as am
    finally:
        sys.path.remove(str(TP_DIR.parent))
    am.make_config(meta(fx)["arch"]).save_pretrained(ckpt)
    out = tmp_path / "hf"
    r = CliRunner().invoke(main, ["to-fp32", str(ckpt), str(out)])
    assert r.exit_code == 0, r.output
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = plain_model(fx).eval()
    reference.load_state_dict(full_state(fx))
    ids = truth(fx)["input_ids"]
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, reference(input_ids=ids).logits
    assert torch.equal(got, want)
    diff = float((got - truth(fx)["logits"]).abs().max())
    assert diff <= (1e-6 if meta(fx)["dtype"] == "fp32" else 0.02), diff
    assert abs(diff - meta(fx)["crosscheck"]["merged_fp32_logits"]["max_abs_diff_fp32_model"]) < 1e-6


def test_repair_patches_a_tp_slice_from_its_master(tmp_path):
    """A 16-bit element of TP rank 1's row slice set to inf is repaired from the fp32 master (the element's full
    index maps back to the right rank file and offset); the output equals the fixture byte for byte in values."""
    fx = TP_DIR / "autotp_z1_bf16_tp2_dp1"
    ckpt = copy_tp_fixture(fx, tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    _set_local(ckpt, 1, name, Role.MODULE, 3 * 8 + 5, float("inf"))
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["repair", str(ckpt), str(out), "--from", "master", "-q"])
    assert r.exit_code == 0, r.output
    assert f"{name} (param): 1 of 128 values at [61]" in r.stdout
    cache_ = FileCache()
    fixed = read_checkpoint(out, cache=cache_)
    assert torch.equal(read_entry(fixed.entry(name), cache_, Role.MODULE).float(), truth(fx)[f"lowp/{name}"].float())
    assert scan(out).findings == ()


@pytest.mark.parametrize("fx", TP_FIXTURES, ids=TP_IDS)
@pytest.mark.parametrize("chunk_nbytes", [4, 12, 52, 1 << 20])
def test_streamed_chunks_equal_whole_tensor_reads(fx, chunk_nbytes):
    """to-fp32's bounded streaming (plan_piece_chunks/read_chunks; row slices through GatherRead) yields exactly
    what read_piece assembles, for every stored copy, with chunk edges inside and across row runs."""
    from dsckpt.assemble import read_piece
    from dsckpt.chunks import GatherRead, plan_piece_chunks, read_chunks
    from dsckpt.dtypes import DTYPES

    cache_ = FileCache()
    ckpt = read_checkpoint(fx / "ckpt", cache=cache_)
    gathered = 0
    for e in ckpt.entries:
        for p in e.pieces:
            reads = plan_piece_chunks(p, e.shape, cache_, name=e.name, chunk_nbytes=chunk_nbytes)
            assert reads is not None
            gathered += sum(isinstance(r, GatherRead) for r in reads)
            got = np.concatenate([a.copy() for _, a in read_chunks(reads, workers=1, chunk_nbytes=chunk_nbytes)])
            want = read_piece(p, e.shape, cache_, name=e.name).reshape(-1)
            want_np = want.view(torch.int16).numpy() if want.dtype == torch.bfloat16 else want.numpy()
            assert got.dtype == DTYPES[p.dtype].numpy and got.dtype.itemsize == want_np.dtype.itemsize
            assert got.tobytes() == want_np.tobytes(), (e.name, p.role)
    assert gathered > 0
