"""dsckpt diff: real DeepSpeed fixtures against their exports, their recorded truth, repaired copies, and
small hand-made state dicts whose every difference is known exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from conftest import all_fixtures, ids
from safetensors.torch import save_file

from dsckpt import open_checkpoint
from dsckpt.api import to_fp32
from dsckpt.cli import main
from dsckpt.diff import DiffInput, Status, diff, plan_diff, prepare_diff, run_diff
from dsckpt.errors import CorruptCheckpointError, UsageError
from dsckpt.model import Fragment, Kind, LogicalCheckpoint, Piece, Precision, Role, TensorEntry
from dsckpt.repair import prepare_repair, run_repair
from dsckpt.state_dict_files import TargetKind

FIXTURES = all_fixtures()
REAL_FP16_BN = [f for f in FIXTURES if f.meta.get("dtype") == "fp16" and (f.dir / "source_fp32.safetensors").exists()
                and ("bnoverflow" in f.name or "cpuforced" in f.name)]
# TinyNet fixtures only: the chunking test diffs against another TinyNet checkpoint (HF Trainer models share no names)
ZERO_MULTI_RANK = [f for f in FIXTURES if f.meta["stage"] in (1, 2, 3) and f.meta["dp_world_size"] > 1
                   and f.meta.get("pp_size", 1) == 1 and f.meta.get("client") is None]


def _fx(name):
    return next(f for f in FIXTURES if f.name == name)


def _run(*args: str):
    return CliRunner().invoke(main, ["diff", *map(str, args)])


def _by_name(report) -> dict:
    return {(t.name, t.role): t for t in report.tensors}


def _rekeyed_truth(fx, prefix: str, path: Path) -> Path:
    """truth.safetensors entries ``<prefix>/<name>`` saved as ``<name>`` (e.g. the fp32 params)."""
    save_file({k.split("/", 1)[1]: v.contiguous() for k, v in fx.truth().items() if k.startswith(prefix + "/")},
              str(path))
    return path


# --------------------------------------------------------------------------------------------
# Planning: pure, no files


def _entry(name: str, shape: tuple[int, ...], roles: dict[Role | str, str], *, frozen: bool = False,
           kind: Kind = Kind.PARAM) -> TensorEntry:
    """``roles``: dtype per copy, a role or an optimizer state key."""
    n = math.prod(shape)
    pieces = tuple(Piece(r if isinstance(r, Role) else Role.OPTIM_STATE, dt,
                         (Fragment(Path(f"/nowhere/{getattr(r, 'value', r)}.pt"), (name,), 0, n, 0),),
                         state_key=None if isinstance(r, Role) else r)
                   for r, dt in roles.items())
    return TensorEntry(name, shape, kind, not frozen, pieces)


def _side(kind: TargetKind, *entries: TensorEntry) -> DiffInput:
    logical = LogicalCheckpoint(Path("/nowhere"), "t", Path("/nowhere/t"), kind.value, 2, Precision.BF16, 1, 1, 1,
                                None, None, None, None, "none", entries, ())
    return DiffInput(Path("/nowhere"), kind, logical)


def test_plan_pairs_names_and_roles_without_files():
    full: dict[Role | str, str] = {Role.MASTER: "float32", Role.MODULE: "bfloat16", "exp_avg": "float32",
                                   "exp_avg_sq": "float32"}
    a = _side(TargetKind.DEEPSPEED, _entry("w", (2, 3), full), _entry("gone", (4,), full),
              _entry("bn.running_var", (3,), {Role.MODULE: "float32"}, kind=Kind.BUFFER),
              _entry("frozen", (5,), {Role.MODULE: "bfloat16"}, frozen=True), _entry("reshaped", (6,), full))
    b = _side(TargetKind.DEEPSPEED, _entry("new", (1,), full), _entry("reshaped", (3, 2), full),
              _entry("frozen", (5,), {Role.MODULE: "bfloat16"}, frozen=True),
              _entry("bn.running_var", (3,), {Role.MODULE: "float32"}, kind=Kind.BUFFER),
              _entry("w", (2, 3), {Role.MASTER: "float32", "exp_avg": "float32"}))
    plan = plan_diff(a, b)
    assert [(p.name, p.copy_a, p.copy_b, p.piece_a.dtype) for p in plan.pairs] == [
        ("w", "master", "master", "float32"), ("bn.running_var", "module", "module", "float32"),
        ("frozen", "module", "module", "bfloat16")]
    assert [(d.name, d.status) for d in plan.decided] == [
        ("gone", Status.ONLY_IN_A), ("reshaped", Status.SHAPE_MISMATCH), ("new", Status.ONLY_IN_B)]
    assert [n for n, _ in plan.order] == ["w", "gone", "bn.running_var", "frozen", "reshaped", "new"]
    everything = plan_diff(a, b, role="all", exclude_frozen=True)
    assert [(p.name, p.role) for p in everything.pairs] == [
        ("w", "master"), ("w", "exp_avg"), ("bn.running_var", "module")]  # roles both sides hold
    assert everything.excluded == ("frozen",)
    module = plan_diff(a, b, role="module")
    assert [(d.name, d.reason) for d in module.decided if d.status is Status.SKIPPED] == [("w", "no module copy in B")]
    # A state dict's one copy stands for the role asked; 'all' needs two DeepSpeed checkpoints.
    sd = _side(TargetKind.SAFETENSORS, _entry("w", (2, 3), {Role.MODULE: "bfloat16"}))
    assert [(p.copy_a, p.copy_b) for p in plan_diff(a, sd, role="module").pairs] == [("module", "stored")]
    assert [(p.copy_a, p.copy_b) for p in plan_diff(a, sd, role="exp_avg").pairs] == [("exp_avg", "stored")]
    with pytest.raises(UsageError, match="--role all compares the stored copies of two DeepSpeed"):
        plan_diff(a, sd, role="all")
    with pytest.raises(UsageError, match="tolerances must be finite and >= 0"):
        plan_diff(a, b, atol=math.nan)
    broken = _side(TargetKind.DEEPSPEED, TensorEntry("w", (2, 3), Kind.PARAM, True, (Piece(Role.MASTER, "float32", (
        Fragment(Path("/x"), ("w",), 0, 2, 0), Fragment(Path("/x"), ("w",), 0, 4, 3))),)))
    with pytest.raises(CorruptCheckpointError, match="'w': the fragments of its master copy leave a gap"):
        plan_diff(broken, b)


# --------------------------------------------------------------------------------------------
# Real fixtures


@pytest.mark.parametrize("fx", FIXTURES, ids=ids(FIXTURES))
def test_checkpoint_equals_its_own_export(fx, tmp_path):
    out = tmp_path / "model.safetensors"
    to_fp32(fx.ckpt, out)
    result = _run("--json", fx.ckpt, out)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["equal"] is True
    names = {e.name for e in open_checkpoint(fx.ckpt).entries}
    assert {t["name"] for t in data["tensors"]} == names
    for t in data["tensors"]:
        # The export holds the master bit for bit; 16-bit-only copies (frozen params, fp16 buffers) come
        # out upcast: same values in another dtype.
        assert t["n_differ"] == 0 and t["max_abs_diff"] == 0.0, t
        assert t["status"] == ("close" if t["dtype_a"] != t["dtype_b"] else "equal"), t
        assert t["dtype_b"] == ("int64" if t["dtype_a"] == "int64" else "float32"), t
    assert data["counts"]["compared"] == len(names)
    assert data["counts"]["within_tolerance"] == data["counts"]["dtype_differs"]


@pytest.mark.parametrize("fx", FIXTURES, ids=ids(FIXTURES))
def test_roles_equal_recorded_truth(fx, tmp_path):
    """Each stored copy equals what DeepSpeed's own API held when the fixture was made."""
    cases = [("value", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("module", "lowp")]
    checked = 0
    truth_keys = {k.split("/", 1)[0] for k in fx.truth()}
    for role, prefix in cases:
        if prefix not in truth_keys:
            continue
        ref = _rekeyed_truth(fx, prefix, tmp_path / f"{prefix}.safetensors")
        report = diff(fx.ckpt, ref, role=role)
        compared = report.of(Status.EQUAL, Status.CLOSE, Status.DIFFERENT)
        assert compared and all(t.n_differ == 0 for t in compared), [t.describe() for t in compared]
        assert not report.of(Status.DIFFERENT, Status.ONLY_IN_B, Status.SHAPE_MISMATCH)
        recorded = {k.split("/", 1)[1] for k in fx.truth() if k.startswith(prefix + "/")}
        a_names = {e.name for e in report.a.logical.entries}
        assert {t.name for t in report.of(Status.ONLY_IN_A)} == a_names - recorded  # e.g. buffers for exp_avg
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("fx", ZERO_MULTI_RANK, ids=ids(ZERO_MULTI_RANK))
def test_tiny_chunks_give_the_same_report(fx):
    """Chunks of 3 elements cut across every rank partition boundary; the result must not change."""
    other = _fx("s2_fp32_w4") if fx.name != "s2_fp32_w4" else _fx("s1_fp32_w2")
    if "moe" in fx.meta:  # another MoE model: the same names (global expert ids), other data (4 ranks)
        other = _fx("moe_s1_bf16_w4_ep2" if fx.name != "moe_s1_bf16_w4_ep2" else "moe_s2_fp32_w2_ep1")
    kwargs = {"role": "all", "atol": 1e-3, "rtol": 1e-2}
    plan_big, ca, cb = prepare_diff(fx.ckpt, other.ckpt, **kwargs)
    big = run_diff(plan_big, ca, cb)
    plan_small, ca, cb = prepare_diff(fx.ckpt, other.ckpt, chunk_numel=3, **kwargs)
    small = run_diff(plan_small, ca, cb)
    assert small.tensors == big.tensors
    assert small.nbytes_read == big.nbytes_read
    assert big.of(Status.DIFFERENT) and big.of(Status.EQUAL)  # both kinds of results are exercised


def test_one_element_perturbation(tmp_path):
    fx = _fx("s2_fp32_w3_align")
    sd = {k: v.contiguous() for k, v in fx.expected_fp32().items()}
    before = float(sd["fc1.weight"].view(-1)[17])
    sd["fc1.weight"].view(-1)[17] += 0.125
    after = float(sd["fc1.weight"].view(-1)[17])
    save_file(sd, str(tmp_path / "b.safetensors"))
    report = diff(fx.ckpt, tmp_path / "b.safetensors")
    (bad,) = report.of(Status.DIFFERENT)
    assert (bad.name, bad.n_differ, bad.n_outside_tolerance, bad.first_indices) == ("fc1.weight", 1, 1, (17,))
    assert bad.max_abs_diff == abs(before - after)
    assert bad.max_rel_diff == abs(before - after) / abs(after)
    assert (bad.max_abs_index, bad.a_at_max, bad.b_at_max) == (17, before, after)
    assert len(report.of(Status.EQUAL)) == len(report.tensors) - 1

    result = _run(fx.ckpt, tmp_path / "b.safetensors")
    assert result.exit_code == 1 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[3:-1]] == ["different"]
    assert "fc1.weight: float32; 1 of 42 values differ (1 outside tolerance)" in lines[3]
    assert lines[-1] == ("different: 13 tensors compared, 12 equal bitwise, 0 within tolerance, 1 different, "
                         "only in A: 0, only in B: 0, shape mismatch: 0")


@pytest.mark.parametrize("fx", REAL_FP16_BN, ids=ids(REAL_FP16_BN))
def test_repaired_checkpoint_differs_exactly_where_patched(fx, tmp_path):
    plan, _ = prepare_repair(fx.ckpt, fx.dir / "source_fp32.safetensors")
    out = tmp_path / "fixed"
    run_repair(plan, out)
    report = diff(fx.ckpt, out, role="all")
    assert not report.equal
    patched = {p.name: p for p in plan.patches}
    changed = {}
    for t in report.of(Status.DIFFERENT, Status.CLOSE):
        changed.setdefault(t.name, []).append(t)
    assert set(changed) == set(patched)
    for name, recs in changed.items():
        p = patched[name]
        roles = {t.role for t in recs}
        assert roles == {"module"}, roles  # buffers: only the module copy exists
        (t,) = recs
        want = p.indices.tolist()
        assert (t.n_differ, list(t.first_indices)) == (len(want), want[:8])
        assert t.max_abs_diff == math.inf and t.a_at_max == math.inf  # the overflowed fp16 value
        assert t.b_at_max in p.values.tolist()
    assert not report.of(Status.ONLY_IN_A, Status.ONLY_IN_B, Status.SHAPE_MISMATCH, Status.SKIPPED)
    # Everything else is bitwise the same: repair copied it.
    assert len(report.of(Status.EQUAL)) == len(report.tensors) - len(changed)


def test_sharded_folder_and_torch_file_equal_the_single_file(tmp_path):
    fx = _fx("s3_bf16_w3_subgroups")
    single, shards, binfile = tmp_path / "m.safetensors", tmp_path / "shards", tmp_path / "m.bin"
    to_fp32(fx.ckpt, single)
    to_fp32(fx.ckpt, shards, max_shard_size=300)
    to_fp32(fx.ckpt, binfile)
    assert len(list(shards.glob("*.safetensors"))) > 2
    for other in (shards, binfile):
        for a, b in ((single, other), (other, single)):
            report = diff(a, b)
            assert report.equal and len(report.of(Status.EQUAL)) == len(report.tensors) == 13, report.summary()
    result = _run(binfile, shards)
    assert result.exit_code == 0
    assert result.stdout.splitlines()[-1] == ("equal: 13 tensors compared, 13 equal bitwise, 0 within tolerance, "
                                              "0 different, only in A: 0, only in B: 0, shape mismatch: 0")


def test_bf16_export_against_fp32_export(tmp_path):
    fx = _fx("s1_fp32_w2")
    fp32, bf16 = tmp_path / "fp32.safetensors", tmp_path / "bf16.safetensors"
    to_fp32(fx.ckpt, fp32)
    to_fp32(fx.ckpt, bf16, dtype="bf16")
    truth = fx.expected_fp32()
    exact = diff(bf16, fp32)
    for t in exact.tensors:
        want = truth[t.name]
        if not want.is_floating_point():
            assert (t.status, t.dtype_a, t.dtype_b) == (Status.EQUAL, "int64", "int64")
            continue
        rounded = want.to(torch.bfloat16).float()
        n = int((rounded != want).sum())
        assert (t.dtype_a, t.dtype_b, t.n_differ) == ("bfloat16", "float32", n), t.name
        assert t.status is (Status.DIFFERENT if n else Status.CLOSE)
        assert t.max_abs_diff == float((rounded.double() - want.double()).abs().max())
    # bf16 keeps 8 significant bits: rounding to nearest moves a value by at most 2**-8 of itself.
    loose = diff(bf16, fp32, rtol=2.0**-8)
    assert loose.equal and not loose.of(Status.DIFFERENT)
    assert loose.counts()["within_tolerance"] == loose.counts()["dtype_differs"] == 12
    quiet = _run("--rtol", 2.0**-8, bf16, fp32)
    assert quiet.exit_code == 0 and len(quiet.stdout.splitlines()) == 4  # A, B, rule, summary
    assert quiet.stdout.splitlines()[-1].startswith("equal: 13 tensors compared, 1 equal bitwise, 12 within")
    verbose = _run("-v", "--rtol", 2.0**-8, bf16, fp32)
    assert [ln.split()[0] for ln in verbose.stdout.splitlines()[3:-1]] == ["close"] * 12
    strict = _run("--rtol", 2.0**-8, "--strict-dtype", bf16, fp32)
    assert strict.exit_code == 1
    assert "dtypes differ (strict dtype)" in strict.stdout
    assert "12 different" in strict.stdout.splitlines()[-1]


# --------------------------------------------------------------------------------------------
# Hand-made state dicts: exact tolerance boundaries, NaN/inf, names, shapes, integers


def _pair(tmp_path: Path, a: dict, b: dict, sub: str = "") -> tuple[Path, Path]:
    folder = tmp_path / sub
    folder.mkdir(exist_ok=True)
    pa, pb = folder / "a.safetensors", folder / "b.safetensors"
    save_file(a, str(pa))
    save_file(b, str(pb))
    return pa, pb


def test_tolerance_boundaries_are_exact(tmp_path):
    d = 2.0**-10
    b = torch.tensor([1.0, 4.0, -3.0], dtype=torch.float32)
    a = b.clone()
    a[0] += d  # exactly representable: |a - b| == d
    pa, pb = _pair(tmp_path, {"x": a}, {"x": b})
    assert diff(pa, pb, atol=d).of(Status.CLOSE)
    assert diff(pa, pb, atol=float(np.nextafter(d, 0))).of(Status.DIFFERENT)
    # The next float32 above 1 + d is outside atol = d.
    a_up = a.clone()
    a_up[0] = float(np.nextafter(np.float32(1.0 + d), np.float32(2)))
    pa2, _ = _pair(tmp_path, {"x": a_up}, {"x": b}, "up")
    (t,) = diff(pa2, pb, atol=d).tensors
    assert (t.status, t.n_differ, t.n_outside_tolerance) == (Status.DIFFERENT, 1, 1)
    assert t.max_abs_diff == d + 2.0**-23
    # rtol: |a - b| == rtol * |b| passes, with B the reference (|a| is larger and would pass more).
    c = b.clone()
    c[1] = 4.0 + 2.0**-8
    pc, _ = _pair(tmp_path, {"x": c}, {"x": b}, "rtol")
    assert diff(pc, pb, rtol=2.0**-10).of(Status.CLOSE)
    (t,) = diff(pc, pb, rtol=float(np.nextafter(2.0**-10, 0))).tensors
    assert (t.status, t.max_rel_diff, t.first_indices) == (Status.DIFFERENT, 2.0**-10, (1,))
    # atol and rtol add up.
    assert diff(pc, pb, atol=2.0**-9, rtol=2.0**-11).of(Status.CLOSE)
    assert _run("--rtol", 2.0**-10, pc, pb).exit_code == 0
    assert _run("--rtol", 2.0**-11, pc, pb).exit_code == 1


def test_nan_and_inf_positions(tmp_path):
    nan, inf = math.nan, math.inf
    a = torch.tensor([nan, 1.0, inf, -inf, 0.0, nan, 5.0, inf])
    b = torch.tensor([nan, 1.0, inf, inf, -0.0, 2.0, nan, 7.0])
    pa, pb = _pair(tmp_path, {"x": a, "same": a.clone()}, {"x": b, "same": a.clone()})
    report = diff(pa, pb, atol=1e30)
    same, t = report.tensors  # safetensors headers list names sorted
    assert (same.name, t.name) == ("same", "x")
    # NaN==NaN and inf==inf at the same place, -0.0 == 0.0; the rest differ whatever the tolerance.
    assert (t.status, t.n_differ, t.n_outside_tolerance, t.first_indices) == (Status.DIFFERENT, 4, 4, (3, 5, 6, 7))
    assert (t.max_abs_diff, t.max_rel_diff, t.max_abs_index, t.a_at_max, t.b_at_max) == (inf, inf, 3, -inf, inf)
    assert (same.status, same.bitwise_equal) == (Status.EQUAL, True)
    data = json.loads(_run("--json", pa, pb).stdout)
    assert (data["tensors"][1]["max_abs_diff"], data["tensors"][1]["a_at_max"]) == ("inf", "-inf")
    # -0.0 vs 0.0 only: equal values, not equal bits.
    z = torch.tensor([0.0, 1.0])
    pz, pz2 = _pair(tmp_path, {"z": z}, {"z": torch.tensor([-0.0, 1.0])}, "zero")
    (t,) = diff(pz, pz2).tensors
    assert (t.status, t.bitwise_equal, t.n_differ) == (Status.CLOSE, False, 0)


def test_names_shapes_and_integers(tmp_path):
    a = {"both": torch.ones(3), "only_a": torch.zeros(2), "shape": torch.zeros(2, 3),
         "steps": torch.tensor(7, dtype=torch.int64), "flags": torch.tensor([True, False])}
    b = {"both": torch.ones(3), "only_b": torch.zeros(4, dtype=torch.float16), "shape": torch.zeros(3, 2),
         "steps": torch.tensor(8, dtype=torch.int64), "flags": torch.tensor([True, True])}
    pa, pb = _pair(tmp_path, a, b)
    report = diff(pa, pb, atol=100.0, rtol=1.0)
    got = {t.name: t for t in report.tensors}
    assert got["only_a"].status is Status.ONLY_IN_A and got["only_a"].shape_a == (2,)
    assert got["only_b"].status is Status.ONLY_IN_B and got["only_b"].dtype_b == "float16"
    assert (got["shape"].status, got["shape"].shape_a, got["shape"].shape_b) == (Status.SHAPE_MISMATCH, (2, 3), (3, 2))
    # Integers and bools compare exactly: no tolerance.
    assert (got["steps"].status, got["steps"].exact, got["steps"].n_differ, got["steps"].max_abs_diff) == \
        (Status.DIFFERENT, True, 1, 1.0)
    assert (got["flags"].status, got["flags"].first_indices) == (Status.DIFFERENT, (1,))
    assert got["both"].status is Status.EQUAL
    assert report.counts() == {"compared": 3, "equal_bitwise": 1, "within_tolerance": 0, "different": 2,
                               "only_in_a": 1, "only_in_b": 1, "shape_mismatch": 1, "skipped": 0,
                               "dtype_differs": 0, "excluded_frozen": 0}
    # A name only on one side or a shape mismatch fails on its own.
    for drop in ("only_a", "shape"):
        pa2, pb2 = _pair(tmp_path, {k: v for k, v in a.items() if k in ("both", drop)},
                         {k: v for k, v in b.items() if k == "both" or (drop == "shape" and k == "shape")}, drop)
        r = _run(pa2, pb2)
        assert r.exit_code == 1, r.output
        assert r.stdout.splitlines()[-1].startswith("different: ")


def test_strided_torch_tensor_reads_in_logical_order(tmp_path):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    torch.save({"w": base.t(), "bf": base.to(torch.bfloat16).t()}, tmp_path / "a.pt")
    assert not base.t().is_contiguous()
    save_file({"w": base.t().contiguous(), "bf": base.to(torch.bfloat16).t().contiguous()},
              str(tmp_path / "b.safetensors"))
    report = diff(tmp_path / "a.pt", tmp_path / "b.safetensors", chunk_numel=5)
    assert [t.status for t in report.tensors] == [Status.EQUAL, Status.EQUAL]


def test_exclude_frozen(tmp_path):
    fx = _fx("s2_bf16_w2_2groups")
    out = tmp_path / "m.safetensors"
    to_fp32(fx.ckpt, out, exclude_frozen=True)
    plain = _run(fx.ckpt, out)
    assert plain.exit_code == 1
    assert "only in A: 2" in plain.stdout.splitlines()[-1]
    assert "only in A  frozen.weight: [5, 7] bfloat16" in plain.stdout
    result = _run("--exclude-frozen", "--json", fx.ckpt, out)
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["excluded"] == ["frozen.weight", "frozen.bias"]
    assert data["counts"]["compared"] == data["counts"]["equal_bitwise"] == 11


@pytest.mark.parametrize("fx", [_fx("s3_fp32_w2"), _fx("s0_fp32_w1")], ids=["zero3", "stage0_fp32"])
def test_missing_copies_are_skipped_not_different(fx):
    """ZeRO-3 params have no module copy, stage-0 fp32 no master, buffers neither moment: skipped."""
    logical = open_checkpoint(fx.ckpt).logical
    for role in ("master", "module", "exp_avg"):
        report = diff(fx.ckpt, fx.ckpt, role=role)
        want_skipped = {e.name for e in logical.entries
                        if (e.state_piece(role) if role == "exp_avg" else e.piece(Role(role))) is None}
        assert {t.name for t in report.of(Status.SKIPPED)} == want_skipped
        assert all(t.reason == f"no {role} copy in A and B" for t in report.of(Status.SKIPPED))
        assert report.equal and len(report.of(Status.EQUAL)) == len(logical.entries) - len(want_skipped)
    result = _run("--role", "master", fx.ckpt, fx.ckpt)
    assert result.exit_code == 0 and "skipped (no such copy)" in result.stdout


# --------------------------------------------------------------------------------------------
# Errors and usage


def test_usage_and_unreadable_inputs(tmp_path):
    fx = _fx("s1_fp32_w2")
    out = tmp_path / "m.safetensors"
    to_fp32(fx.ckpt, out)
    r = _run("--role", "all", fx.ckpt, out)
    assert r.exit_code == 2 and r.stdout == ""
    assert "--role all compares the stored copies of two DeepSpeed checkpoints" in r.stderr
    with pytest.raises(UsageError, match="not a DeepSpeed checkpoint"):
        prepare_diff(fx.ckpt, out, tag_b="global_step3")
    r = _run("--tag", "nope", fx.ckpt, out)
    assert r.exit_code == 3 and "nope" in r.stderr and r.stdout == ""
    assert _run("--tag", "global_step3", fx.ckpt, out).exit_code == 0  # --tag applies to DeepSpeed inputs only
    assert _run("--atol", "-1", fx.ckpt, out).exit_code == 2
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(out.read_bytes()[:100])
    r = _run(fx.ckpt, bad)
    assert r.exit_code == 3 and r.stdout == ""
    assert r.stderr.startswith("dsckpt: error: ") and str(bad) in r.stderr and len(r.stderr.splitlines()) == 1
    with pytest.raises(CorruptCheckpointError, match="bad.safetensors"):
        diff(out, bad)
