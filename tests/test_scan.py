"""dsckpt scan: finds exactly the planted / real non-finite values, nothing in clean fixtures, reads
each stored byte once. Planted values go into COPIES of real DeepSpeed fixtures."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import all_fixtures, ids
from safetensors.torch import save_file
from scan_helpers import copy_fixture, flip_record_bit, plant

from dsckpt import parsed_tree
from dsckpt.cli import main
from dsckpt.errors import CorruptCheckpointError
from dsckpt.model import Precision, Role
from dsckpt.scan import Check, StoredKind, open_target, plan_scan, prepare_scan, run_scan, scan

FIXTURES = all_fixtures()
# fp16 fixtures whose BatchNorm running_var (buffer_dtype fp16) overflowed in DeepSpeed training: GPU-made
# (*_bnoverflow) and DeepSpeed-on-CPU with fp16 forced (*_cpuforced); both carry source_fp32.safetensors.
BNOVERFLOW = [f for f in FIXTURES if f.meta.get("dtype") == "fp16" and (f.dir / "source_fp32.safetensors").exists()
              and ("bnoverflow" in f.name or "cpuforced" in f.name)]
CLEAN = [f for f in FIXTURES if f.meta.get("dtype") != "fp16"]


def _union_nbytes(logical, cache) -> int:
    """Bytes covered by floating tensor views of every file (shared views counted once)."""
    total = 0
    for f in logical.files:
        spans: dict[str, list[tuple[int, int, int]]] = {}
        for _, r in parsed_tree.walk_tensors(cache.tree(f)):
            if r.dtype.is_floating_point and r.numel:
                spans.setdefault(r.storage.key, []).append((r.storage_offset, r.storage_offset + r.numel,
                                                            r.nbytes // r.numel))
        for v in spans.values():
            end = -1
            for a, b, size in sorted(v):
                a = max(a, end)
                if b > a:
                    total += (b - a) * size
                    end = b
    return total


@pytest.mark.parametrize("fx", CLEAN, ids=ids(CLEAN))
def test_clean_fixture_scans_clean_reading_each_byte_once(fx):
    report = scan(fx.ckpt)
    assert report.findings == ()
    logical, cache, _ = open_target(fx.ckpt)
    assert report.nbytes_read == _union_nbytes(logical, cache)
    assert report.stored_tensors > 0


@pytest.mark.parametrize("fx", BNOVERFLOW, ids=ids(BNOVERFLOW))
def test_real_fp16_bn_overflow_found_exactly(fx):
    truth = fx.truth()["buffer/bn.running_var"]
    bad = (~torch.isfinite(truth)).nonzero().flatten().tolist()
    assert bad, "fixture should hold an overflowed running_var"
    report = scan(fx.ckpt, nonfinite_only=True)
    found = report.findings
    assert {f.name for f in found} == {"bn.running_var"}
    n_files = len({f.file for f in found})
    assert n_files == (fx.meta["dp_world_size"] if fx.meta["stage"] == 3 else 1)
    for f in found:
        assert (f.kind, f.dtype, f.numel) == (StoredKind.BUFFER, "float16", 7)
        assert list(f.first_indices) == bad
        assert f.posinf == int(torch.isposinf(truth).sum()) and f.nan == int(torch.isnan(truth).sum())


PLANTS = [
    # fixture, name, role, logical index, expected kind
    ("s0_fp32_w1", "fc1.weight", Role.MODULE, 5, StoredKind.PARAM),
    ("s0_bf16_w2", "fc2.weight", Role.MASTER, 7, StoredKind.MASTER),
    ("s1_bf16_w3", "fc1.weight", Role.MASTER, 41, StoredKind.MASTER),
    ("s2_fp32_w4", "embed.weight", "exp_avg", 65, StoredKind.EXP_AVG),
    ("s2_bf16_w2_2groups", "bn.bias", "exp_avg_sq", 6, StoredKind.EXP_AVG_SQ),
    ("s2_fp32_w2_legacy", "frozen.weight", Role.MODULE, 3, StoredKind.FROZEN),
    ("s3_bf16_w3_subgroups", "fc2.weight", Role.MASTER, 29, StoredKind.MASTER),
    ("s3_fp32_w2", "bn.running_var", Role.MODULE, 6, StoredKind.BUFFER),
]
PLANT_IDS = [f"{p[0]}-{p[1]}-{getattr(p[2], 'value', p[2])}" for p in PLANTS]


@pytest.mark.parametrize("fx_name,name,role,index,kind", PLANTS, ids=PLANT_IDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan], ids=["posinf", "neginf", "nan"])
def test_planted_value_found_by_logical_name_and_index(tmp_path, fx_name, name, role, index, kind, value):
    fx = next((f for f in FIXTURES if f.name == fx_name), None)
    if fx is None:
        pytest.skip(f"fixture {fx_name} not generated yet")
    ckpt = copy_fixture(fx, tmp_path)
    files = plant(ckpt, name, role, index, value)
    report = scan(ckpt, nonfinite_only=True)
    assert len(report.findings) == 1
    f = report.findings[0]
    assert (f.check, f.name, f.kind, f.file, f.count, f.first_indices) == (
        Check.NONFINITE, name, kind, files[0], 1, (index,))
    assert (f.nan, f.posinf, f.neginf) == (int(math.isnan(value)), int(value == math.inf), int(value == -math.inf))


def test_tied_weight_reported_once_with_alias(tmp_path):
    fx = next(f for f in FIXTURES if f.name == "s1_fp32_w2")
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, "embed.weight", Role.MASTER, 0, math.nan)
    (f,) = scan(ckpt).findings
    assert (f.name, f.aliases, f.rank) == ("embed.weight", ("head.weight",), 0)


def test_bf16_module_copy_disagreeing_with_master_is_a_mismatch(tmp_path):
    fx = next(f for f in FIXTURES if f.name == "s2_bf16_w2_2groups")
    ckpt = copy_fixture(fx, tmp_path)
    master = fx.truth()["param/fc1.weight"].reshape(-1)
    plant(ckpt, "fc1.weight", Role.MASTER, 3, float(master[3]) * 2 + 1)
    assert scan(ckpt, nonfinite_only=True).clean
    (f,) = scan(ckpt).findings
    assert (f.check, f.name, f.kind, f.dtype, f.count, f.first_indices) == (
        Check.MISMATCH, "fc1.weight", StoredKind.PARAM, "bfloat16", 1, (3,))


def test_fp32_master_beyond_fp16_range_flagged_when_trained_in_fp16(tmp_path):
    """The CPU fixture is fp32-trained; the plan is made as if fp16 (precision is all that differs)."""
    fx = next(f for f in FIXTURES if f.name == "s2_fp32_w4")
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, "fc2.weight", Role.MASTER, 0, 70000.0)
    plant(ckpt, "fc2.weight", Role.MASTER, 1, 65504.0)  # the largest fp16 value itself is fine
    assert scan(ckpt).clean
    logical, cache, kind = open_target(ckpt)
    logical = dataclasses.replace(logical, precision=Precision.FP16)
    plan = plan_scan(logical, {f: cache.tree(f) for f in logical.files}, cache.tensor, target=ckpt,
                     target_kind=kind)
    (f,) = run_scan(plan, cache).findings
    assert (f.check, f.name, f.kind, f.count, f.first_indices) == (
        Check.FP16_OVERFLOW, "fc2.weight", StoredKind.MASTER, 1, (0,))


@pytest.mark.parametrize("workers", [0, 1, 5])
def test_chunked_reading_gives_the_same_findings(tmp_path, workers):
    fx = next(f for f in FIXTURES if f.name == "s2_fp32_w4")
    ckpt = copy_fixture(fx, tmp_path)
    for i in (2, 30, 64):
        plant(ckpt, "embed.weight", Role.MASTER, i, math.inf)
    whole = scan(ckpt)
    plan, cache = prepare_scan(ckpt)
    chunked = run_scan(dataclasses.replace(plan, chunk_numel=7), cache, workers=workers)
    assert chunked.findings == whole.findings
    assert (chunked.numel_scanned, chunked.nbytes_read) == (whole.numel_scanned, whole.nbytes_read)
    # 165 trainable elements padded to 168 over 4 ranks: 42 per rank, embed.weight first
    assert [(f.rank, f.first_indices) for f in whole.findings] == [(0, (2, 30)), (1, (64,))]


@pytest.mark.parametrize("max_open", [1, 32], ids=["one-file-open", "default"])
@pytest.mark.parametrize("workers", [0, 3])
def test_scan_threads_keep_files_open_and_close_them_all(tmp_path, monkeypatch, workers, max_open):
    """Each scan thread opens a file once for all its reads (scan_engine.MAX_OPEN_FILES at most) and every
    descriptor is closed when the scan ends, also when it fails."""
    import os

    from dsckpt import scan_engine as scan_module

    monkeypatch.setattr(scan_module, "MAX_OPEN_FILES", max_open)
    fx = next(f for f in FIXTURES if f.name == "ds0189_s3_bf16_w2")
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, open_target(ckpt)[0].entries[0].name, Role.MASTER, 0, math.nan)
    expected = scan(ckpt).findings
    fds = set(os.listdir("/proc/self/fd"))
    plan, cache = prepare_scan(ckpt)
    assert run_scan(plan, cache, workers=workers).findings == expected
    assert set(os.listdir("/proc/self/fd")) == fds
    path = next(iter(plan.entries)).pieces[0].fragments[0].file
    data = bytearray(path.read_bytes())
    ref = cache.tensor(path, next(iter(plan.entries)).pieces[0].fragments[0].key)
    data[ref.storage.file_offset + 5] ^= 0x10  # a flipped bit: the CRC check fails mid-scan
    path.write_bytes(bytes(data))
    plan, cache = prepare_scan(ckpt)
    with pytest.raises(CorruptCheckpointError, match="fails its CRC32 check"):
        run_scan(plan, cache, workers=workers)
    assert set(os.listdir("/proc/self/fd")) == fds


class _Boom(Exception):
    pass


def _pool_run(n_tasks: int, workers: int, *, fail_work_at: int | None = None, fail_tasks_at: int | None = None):
    """Run scan's worker pool over ints with uneven work times; returns (applied, max taken ahead, error)."""
    import random
    import threading
    import time

    from dsckpt.scan_engine import run_pool

    rng = random.Random(n_tasks * 31 + workers)
    delays = [rng.choice([0, 0, 0.0005, 0.003]) for _ in range(n_tasks)]
    lock = threading.Lock()
    applied: list[int] = []
    taken = [0]
    ahead = [0]

    def tasks():
        for i in range(n_tasks):
            if i == fail_tasks_at:
                raise _Boom(f"tasks {i}")
            with lock:
                taken[0] = i + 1
                ahead[0] = max(ahead[0], taken[0] - len(applied))
            yield i

    def work(i):
        time.sleep(delays[i])
        if i == fail_work_at:
            raise _Boom(f"work {i}")
        return [i * 10]

    def apply(i, updates):
        assert updates == [i * 10]
        with lock:
            applied.append(i)

    try:
        run_pool(tasks(), work, apply, workers)
    except _Boom as e:
        return applied, ahead[0], str(e)
    return applied, ahead[0], None


@pytest.mark.parametrize("workers", [1, 3, 8])
def test_scan_pool_applies_in_task_order_and_bounds_work_ahead(workers):
    applied, ahead, error = _pool_run(300, workers)
    assert (applied, error) == (list(range(300)), None)
    assert ahead <= 4 * workers + 1


@pytest.mark.parametrize("workers", [1, 3, 8])
def test_scan_pool_raises_a_work_error_after_applying_every_earlier_task(workers):
    applied, _, error = _pool_run(300, workers, fail_work_at=137)
    assert (applied, error) == (list(range(137)), "work 137")


@pytest.mark.parametrize("workers", [1, 3, 8])
def test_scan_pool_raises_a_planning_error_after_applying_every_earlier_task(workers):
    applied, _, error = _pool_run(300, workers, fail_tasks_at=200)
    assert (applied, error) == (list(range(200)), "tasks 200")


def _state_dict_with_inf() -> dict[str, torch.Tensor]:
    sd = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4), "bn.running_var": torch.ones(5),
          "bn.num_batches_tracked": torch.tensor(3)}
    sd["a.weight"][1, 2] = math.nan
    sd["bn.running_var"][4] = -math.inf
    return sd


@pytest.mark.parametrize("layout", ["safetensors", "sharded", "torch"])
def test_consolidated_state_dicts(tmp_path, layout):
    sd = _state_dict_with_inf()
    if layout == "safetensors":
        target = tmp_path / "m.safetensors"
        save_file(sd, str(target))
    elif layout == "sharded":
        target = tmp_path / "shards"
        target.mkdir()
        save_file({"a.weight": sd["a.weight"]}, str(target / "model-00001-of-00002.safetensors"))
        save_file({k: v for k, v in sd.items() if k != "a.weight"}, str(target / "model-00002-of-00002.safetensors"))
        (target / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors", "bn.running_var": "model-00002-of-00002.safetensors",
            "bn.num_batches_tracked": "model-00002-of-00002.safetensors"}}))
    else:
        target = tmp_path / "m.pt"
        sd["tied"] = sd["a.weight"]  # shared storage: scanned once, reported once
        torch.save(sd, target)
    report = scan(target)
    got = sorted((f.name, f.kind, f.nan, f.posinf, f.neginf, f.first_indices) for f in report.findings)
    assert got == [("a.weight", StoredKind.PARAM, 1, 0, 0, (6,)), ("bn.running_var", StoredKind.BUFFER, 0, 0, 1, (4,))]


def test_cli_scan_clean_exit_0():
    fx = CLEAN[0]
    r = CliRunner().invoke(main, ["scan", str(fx.ckpt), "-q"])
    assert r.exit_code == 0, r.output
    assert "clean: nothing found" in r.stdout
    assert r.stderr == ""


def test_cli_scan_findings_exit_1_json(tmp_path):
    fx = next(f for f in FIXTURES if f.name == "s3_fp32_w2")
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, "bn.running_var", Role.MODULE, 2, math.inf, replica=None)
    r = CliRunner().invoke(main, ["scan", str(ckpt), "--nonfinite", "--json"])
    assert r.exit_code == 1
    assert r.stderr == ""
    doc = json.loads(r.stdout)
    assert doc["clean"] is False
    assert [(f["name"], f["kind"], f["posinf"], f["first_indices"], Path(f["file"]).name) for f in doc["findings"]] == [
        ("bn.running_var", "buffer", 1, [2], "zero_pp_rank_0_mp_rank_00_model_states.pt"),
        ("bn.running_var", "buffer", 1, [2], "zero_pp_rank_1_mp_rank_00_model_states.pt"),
    ]
    text = CliRunner().invoke(main, ["scan", str(ckpt), "-q"])
    assert text.exit_code == 1 and "bn.running_var: buffer, float32, 1 +inf of 7 values" in text.stdout


def test_cli_scan_missing_target_is_usage_error(tmp_path):
    r = CliRunner().invoke(main, ["scan", str(tmp_path / "nope")])
    assert r.exit_code == 2
    assert "does not exist" in r.stderr


def test_cli_scan_not_a_checkpoint_exit_3(tmp_path):
    r = CliRunner().invoke(main, ["scan", str(tmp_path)])
    assert r.exit_code == 3
    assert r.stdout == "" and "is not a DeepSpeed checkpoint" in r.stderr


def test_real_fp16_param_overflow_found_in_copy_and_master():
    """s2_fp16_w1_masterinf (GPU): fc2.weight[0, 0] is 70000 in the fp32 master, +inf in the fp16 copy."""
    fx = next(f for f in FIXTURES if f.name == "s2_fp16_w1_masterinf")
    report = scan(fx.ckpt)
    got = sorted((f.check.value, f.name, f.kind.value, f.dtype, f.count, f.posinf, f.first_indices)
                 for f in report.findings)
    assert got == [
        ("fp16_overflow", "fc2.weight", "fp32 master", "float32", 1, 0, (0,)),
        ("nonfinite", "fc2.weight", "param", "float16", 1, 1, (0,)),
    ]
    assert fx.truth()["param/fc2.weight"].view(-1)[0].item() > 65504  # 69999.99 after Adam steps
    only = scan(fx.ckpt, nonfinite_only=True)
    assert [(f.check.value, f.name) for f in only.findings] == [("nonfinite", "fc2.weight")]


@pytest.mark.parametrize("workers", [0, 3])
def test_findings_do_not_depend_on_the_block_sizes(tmp_path, monkeypatch, workers):
    """Each stored range is checked block by block while in cache (issue 35): findings, counts, first indices and
    bytes read are those of one block per chunk, for inf/NaN in several copies, a master/16-bit mismatch and fp16
    overflow (plan made as if fp16, as above)."""
    from dsckpt import scan_engine

    fx = next(f for f in FIXTURES if f.name == "s2_bf16_w2_2groups")
    ckpt = copy_fixture(fx, tmp_path)
    master = fx.truth()["param/fc1.weight"].reshape(-1)
    plant(ckpt, "fc1.weight", Role.MASTER, 3, float(master[3]) * 2 + 1)  # a mismatch
    for i in (1, 5, 6, 17):
        plant(ckpt, "fc1.weight", "exp_avg", i, math.nan)
    plant(ckpt, "fc1.weight", Role.MASTER, 9, -math.inf)
    plant(ckpt, "fc1.weight", Role.MASTER, 11, 70000.0)

    def run(workers: int):
        logical, cache, kind = open_target(ckpt)
        logical = dataclasses.replace(logical, precision=Precision.FP16)
        plan = plan_scan(logical, {f: cache.tree(f) for f in logical.files}, cache.tensor, target=ckpt,
                         target_kind=kind)
        return run_scan(plan, cache, workers=workers)

    whole = run(0)
    got = sorted((f.check.value, f.kind.value, f.count, f.first_indices) for f in whole.findings)
    assert got == [("fp16_overflow", "fp32 master", 1, (11,)),
                   ("mismatch", "param", 2, (3, 11)),  # the -inf master (9) is not compared: it is a nonfinite one
                   ("nonfinite", "exp_avg", 1, (1,)), ("nonfinite", "exp_avg", 3, (5, 6, 17)),  # two ranks' partitions
                   ("nonfinite", "fp32 master", 1, (9,))], got
    monkeypatch.setattr(scan_engine, "BLOCK_NBYTES", 8)
    monkeypatch.setattr(scan_engine, "COMPARE_BLOCK_NUMEL", 3)
    tiny = run(workers)
    assert tiny.findings == whole.findings
    assert (tiny.numel_scanned, tiny.nbytes_read, tiny.checks) == (whole.numel_scanned, whole.nbytes_read,
                                                                    whole.checks)


@pytest.mark.parametrize("target, checks", [
    ("s2_fp16_w1_bnoverflow", "inf/NaN, fp16 overflow, master/16-bit mismatch"),
    ("s2_bf16_w2_2groups", "inf/NaN, master/16-bit mismatch"),
    ("s2_fp32_w4", "inf/NaN"),
    ("safetensors", "inf/NaN"),
])
def test_scan_names_only_the_checks_that_ran(tmp_path, target, checks):
    """fp16 overflow only where an fp16 run's fp32 masters are read, the master/16-bit comparison only where a
    master has a 16-bit copy: neither in a .safetensors file or an fp32 checkpoint (issue 35)."""
    if target == "safetensors":
        path = tmp_path / "model.safetensors"
        save_file({"a": torch.ones(3, dtype=torch.float16), "b": torch.ones(2)}, str(path))
    else:
        path = next(f for f in FIXTURES if f.name == target).ckpt
    r = CliRunner().invoke(main, ["scan", str(path), "-q"])
    assert r.exit_code in (0, 1), r.output
    assert r.stdout.splitlines()[0].endswith(f"; checks: {checks}")
    doc = json.loads(CliRunner().invoke(main, ["scan", str(path), "--json"]).stdout)
    names = {"nonfinite": "inf/NaN", "fp16_overflow": "fp16 overflow", "mismatch": "master/16-bit mismatch"}
    assert ", ".join(names[c] for c in doc["checks"]) == checks
    nonfinite = CliRunner().invoke(main, ["scan", str(path), "-q", "--nonfinite"])
    assert nonfinite.stdout.splitlines()[0].endswith("; checks: inf/NaN")


@pytest.mark.parametrize("block_nbytes", [8, 4 << 20], ids=["8-byte-blocks", "default"])
def test_a_flipped_bit_fails_the_chained_crc_whatever_the_block_size(tmp_path, monkeypatch, block_nbytes):
    """A block's CRC-32 is chained onto the previous block's and handed to the record's check once per range:
    one flipped bit in the middle of a record is still caught, however many blocks the range took."""
    from dsckpt import scan_engine

    monkeypatch.setattr(scan_engine, "BLOCK_NBYTES", block_nbytes)
    monkeypatch.setattr(scan_engine, "COMPARE_BLOCK_NUMEL", 3)
    ckpt = copy_fixture(next(f for f in FIXTURES if f.name == "ds0189_s2_bf16_w2"), tmp_path)
    flip_record_bit(ckpt)
    for nonfinite_only in (True, False):
        with pytest.raises(CorruptCheckpointError, match="fails its CRC32 check"):
            scan(ckpt, nonfinite_only=nonfinite_only)
