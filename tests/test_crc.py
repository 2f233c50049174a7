"""CRC-32 checks of zip records (issue 8, bit rot): one flipped bit in a record that a command reads
makes it fail with exit 3 naming the file and the record, and leaves no output behind."""

from __future__ import annotations

import os
import shutil
import struct
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import FIXTURES, fixtures_where
from hypothesis import given, settings
from hypothesis import strategies as st

from dsckpt import parsed_tree, safe_load, tensor_ref
from dsckpt.cli import main
from dsckpt.crc import CRC32_IMPL, RecordCheck, check_file_records, crc32, crc32_combine
from dsckpt.errors import CorruptCheckpointError

# --------------------------------------------------------------------------------------------
# Helpers


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name / "ckpt", dst)
    return dst


def _tag_dir(ckpt: Path) -> Path:
    return ckpt / (ckpt / "latest").read_text().strip()


def _record_data_offset(path: Path, record: str) -> tuple[int, int]:
    """``(absolute offset of the record's first data byte, record length)``."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(record)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def _flip(path: Path, offset: int, bit: int = 2) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def _storage_of(path: Path, key: tuple) -> tensor_ref.StorageRef:
    tree = safe_load.load(path)
    obj = tree
    for k in key:
        obj = obj[k]
    assert isinstance(obj, tensor_ref.TensorRef)
    return obj.storage


def _flip_in_tensor(path: Path, key: tuple, byte: int = 0) -> str:
    """Flip one bit of byte ``byte`` of the storage under ``key``; returns the record's name."""
    storage = _storage_of(path, key)
    assert storage.record is not None
    _flip(path, storage.file_offset + byte)
    return storage.record


def _run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def _assert_crc_error(res, path: Path, record: str) -> None:
    assert res.exit_code == 3, res.output
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("dsckpt: error: ")
    assert str(path) in lines[0]
    assert f"record '{record}' fails its CRC32 check" in lines[0]
    assert "restore it from a backup" in lines[0]
    assert "Traceback" not in res.stderr


OSD = "optimizer_state_dict"
ZERO2 = "s2_bf16_w2_2groups"  # bf16 ZeRO-2, 2 ranks, two param groups
FP32_PARTITION = (OSD, "single_partition_of_fp32_groups", 0)


def _unsampled_master_element(ckpt: Path, path: Path) -> int:
    """An element of ``path``'s fp32 group-0 partition that ``to-fp32``'s sampled master/module-copy comparison
    (the first and last 8 elements of each param, dsckpt.readers.same_save) does not read: a flip there is caught
    only by a CRC-32."""
    from dsckpt.readers import read_checkpoint
    from dsckpt.readers.same_save import COPY_SAMPLE_NUMEL

    for e in read_checkpoint(ckpt).entries:
        master = next((p for p in e.pieces if p.role.value == "master"), None)
        for f in master.fragments if master is not None else ():
            i = max(f.dst_offset, COPY_SAMPLE_NUMEL)  # an element of this fragment inside the param, not sampled
            if f.file == path and f.key == FP32_PARTITION and i < min(f.dst_offset + f.numel, master.numel - COPY_SAMPLE_NUMEL):
                return f.src_offset + (i - f.dst_offset)
    raise AssertionError(f"no unsampled master element in {path}")


# --------------------------------------------------------------------------------------------
# crc32_combine and RecordCheck


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.binary(max_size=300))
def test_crc32_combine_equals_crc_of_concatenation(a, b):
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(st.binary(max_size=5000), st.integers(0, 2**32 - 1), st.integers(0, 64))
def test_crc32_gives_zlibs_values_from_any_start_value_and_buffer_offset(data, value, skip):
    # the isal CRC (where installed) must agree with zlib's bit for bit, given bytes, memoryviews of
    # numpy buffers at odd offsets, and a running value, as RecordCheck and the writers use it
    view = memoryview(np.frombuffer(bytes(skip) + data, dtype=np.uint8)).cast("B")[skip:]
    assert crc32(data) == zlib.crc32(data)
    assert crc32(view, value) == zlib.crc32(data, value)


def test_crc32_is_isal_where_installed_and_zlib_on_request():
    import importlib.util
    import subprocess
    import sys

    expected = "isal" if importlib.util.find_spec("isal") else "zlib"
    assert CRC32_IMPL == expected
    big = bytes(range(256)) * (9 << 12)  # 9 MiB, past any small-buffer path
    assert crc32(big) == zlib.crc32(big) == 0x3CC78A40
    got = subprocess.run([sys.executable, "-c", "from dsckpt.crc import CRC32_IMPL, crc32; print(CRC32_IMPL)"],
                         env={**os.environ, "DSCKPT_CRC": "zlib"}, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "zlib"


@pytest.mark.parametrize("len2", [1, 3, 64, 4095, 65536 + 7, 8 << 20])
def test_crc32_combine_long_second_part(len2):
    a, b = b"dsckpt", bytes(range(256)) * (len2 // 256) + bytes(len2 % 256)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len2) == zlib.crc32(a + b)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
       st.integers(1, 2**40), st.integers(1, 2**40))
def test_crc32_combine_is_associative_for_lengths_beyond_32_bits(c1, c2, c3, n2, n3):
    # crc(A+B+C) either way round; lengths past 2**32 use the x^(2^k) table's wrap-around.
    assert (crc32_combine(crc32_combine(c1, c2, n2), c3, n3)
            == crc32_combine(c1, crc32_combine(c2, c3, n3), n2 + n3))


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.data())
def test_record_check_reads_in_any_order_with_rereads(data):
    payload = data.draw(st.binary(min_size=1, max_size=200))
    n = len(payload)
    reads = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(1, n)), max_size=30))
    check = RecordCheck(Path("f.pt"), "archive/data/0", zlib.crc32(payload), n, 0)
    for start, length in reads:
        end = min(n, start + length)
        check.update(start, payload[start:end])
    covered = check.covered_nbytes()
    gaps = check.gaps()
    assert covered + sum(hi - lo for lo, hi in gaps) == n
    if not check.done:
        for lo, hi in gaps:
            check.update(lo, payload[lo:hi])
    assert check.done and check.ok and check.gaps() == []


@settings(derandomize=True, max_examples=100, deadline=None)
@given(st.data())
def test_record_check_catches_a_flipped_bit_whatever_the_read_order(data):
    payload = data.draw(st.binary(min_size=1, max_size=200))
    n = len(payload)
    pos = data.draw(st.integers(0, n - 1))
    bad = bytearray(payload)
    bad[pos] ^= 1 << data.draw(st.integers(0, 7))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=10)) if n > 1 else []))
    pieces = list(zip([0, *cuts], [*cuts, n]))
    order = data.draw(st.permutations(pieces))
    check = RecordCheck(Path("f.pt"), "archive/data/3", zlib.crc32(payload), n, 0)
    with pytest.raises(CorruptCheckpointError, match=r"f\.pt: record 'archive/data/3' fails its CRC32 check"):
        for lo, hi in order:
            check.update(lo, bytes(bad[lo:hi]))
    assert check.done and not check.ok


def test_finish_reads_only_the_gaps_and_names_every_damaged_record(tmp_path):
    ckpt = _copy(ZERO2, tmp_path)
    path = _tag_dir(ckpt) / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    tree = safe_load.load(path)
    p0 = tree[OSD]["single_partition_of_fp32_groups"][0]
    p1 = tree[OSD]["single_partition_of_fp32_groups"][1]
    p0.read_numpy(10, 20)
    assert p0.storage.check is not None and p0.storage.check.touched and not p0.storage.check.done
    assert parsed_tree.finish_checks(tree) == 1  # p1's record was never read: left alone
    assert p0.storage.check.done and p0.storage.check.ok
    assert p1.storage.check is not None and not p1.storage.check.touched

    # Both records damaged, both partly read: one error naming both.
    _flip(path, p0.storage.file_offset + 4 * 60)
    _flip(path, p1.storage.file_offset + 4 * 13)
    tree = safe_load.load(path)
    for i in (0, 1):
        tree[OSD]["single_partition_of_fp32_groups"][i].read_numpy(0, 2)
    with pytest.raises(CorruptCheckpointError) as err:
        parsed_tree.finish_checks(tree)
    assert str(err.value).count("fails its CRC32 check") == 2
    assert "data/6'" in str(err.value) and "data/7'" in str(err.value)


def test_no_crc_env_turns_read_time_checks_off(tmp_path, monkeypatch):
    ckpt = _copy(ZERO2, tmp_path)
    path = _tag_dir(ckpt) / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _flip_in_tensor(path, FP32_PARTITION)
    with pytest.raises(CorruptCheckpointError, match="fails its CRC32 check"):
        safe_load.load(path)[OSD]["single_partition_of_fp32_groups"][0].read_numpy()
    monkeypatch.setenv("DSCKPT_NO_CRC", "1")
    storage = _storage_of(path, FP32_PARTITION)
    assert storage.check is None and storage.crc32 is not None
    safe_load.load(path)[OSD]["single_partition_of_fp32_groups"][0].read_numpy()


# --------------------------------------------------------------------------------------------
# Commands on a flipped bit in an optimizer file's fp32 partition


@pytest.mark.parametrize("out_name", ["o.safetensors", "shards", "o.pt"], ids=["safetensors", "sharded", "torch"])
@pytest.mark.parametrize("workers", ["0", "4"])
def test_to_fp32_fails_on_a_flipped_bit_in_the_fp32_master(tmp_path, out_name, workers):
    ckpt = _copy(ZERO2, tmp_path)
    path = _tag_dir(ckpt) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    record = _flip_in_tensor(path, FP32_PARTITION, byte=4 * 30 + 2)
    out = tmp_path / "out" / out_name
    out.parent.mkdir()
    extra = ["--max-shard-size", "300B"] if out_name == "shards" else []
    res = _run("to-fp32", ckpt, out, "-q", "--workers", workers, *extra)
    _assert_crc_error(res, path, record)
    assert list(out.parent.iterdir()) == []  # no output, no temporary left


def test_to_fp32_without_crc_checks_writes_the_wrong_value(tmp_path, monkeypatch):
    """What the checks are for: the same flip, checks off, exits 0 with a changed tensor."""
    ckpt = _copy(ZERO2, tmp_path)
    clean = tmp_path / "clean.safetensors"
    assert _run("to-fp32", ckpt, clean, "-q").exit_code == 0
    victim = _tag_dir(ckpt) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _flip_in_tensor(victim, FP32_PARTITION, byte=4 * _unsampled_master_element(ckpt, victim) + 2)
    monkeypatch.setenv("DSCKPT_NO_CRC", "1")
    bad = tmp_path / "bad.safetensors"
    assert _run("to-fp32", ckpt, bad, "-q").exit_code == 0
    assert clean.read_bytes() != bad.read_bytes()


def test_scan_fails_on_a_flipped_bit_in_the_fp32_master(tmp_path):
    ckpt = _copy(ZERO2, tmp_path)
    path = _tag_dir(ckpt) / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    record = _flip_in_tensor(path, FP32_PARTITION, byte=5)
    _assert_crc_error(_run("scan", ckpt, "-q"), path, record)
    _assert_crc_error(_run("scan", ckpt, "--nonfinite", "--json"), path, record)


@pytest.mark.parametrize("verify", ["quick", "none"])
def test_reshard_fails_on_a_flipped_bit_and_leaves_no_output(tmp_path, verify):
    ckpt = _copy(ZERO2, tmp_path)
    path = _tag_dir(ckpt) / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    record = _flip_in_tensor(path, (OSD, "base_optimizer_state", "state", 0, "exp_avg_sq"), byte=9)
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    res = _run("reshard", ckpt, out_parent / "r", "-n", "4", "-q", "--verify", verify)
    _assert_crc_error(res, path, record)
    assert list(out_parent.iterdir()) == []


def test_reshard_fails_on_a_flip_in_a_record_it_copies_whole(tmp_path):
    ckpt = _copy(ZERO2, tmp_path)
    path = _tag_dir(ckpt) / "mp_rank_00_model_states.pt"
    record = _flip_in_tensor(path, ("module", "bn.running_var"), byte=3)
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    # --verify none: only the copy itself reads the record (the source check rides on its CRC pass)
    _assert_crc_error(_run("reshard", ckpt, out_parent / "r", "-n", "1", "-q", "--verify", "none"), path, record)
    assert list(out_parent.iterdir()) == []


def test_repair_fails_on_a_flipped_bit(tmp_path):
    ckpt = _copy(ZERO2, tmp_path)
    path = _tag_dir(ckpt) / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    record = _flip_in_tensor(path, FP32_PARTITION, byte=1)
    res = _run("repair", ckpt, tmp_path / "fixed", "--policy", "reset-bn-stats", "-q")
    _assert_crc_error(res, path, record)
    assert not (tmp_path / "fixed").exists()


# --------------------------------------------------------------------------------------------
# Records read partly, or not at all


def _padding_byte(path: Path, key: tuple) -> tuple[str, int]:
    """A byte of the storage under ``key`` that no tensor of the file views (flat-buffer padding)."""
    tree = safe_load.load(path)
    storage = _storage_of(path, key)
    viewed = set()
    for _, ref in parsed_tree.walk_tensors(tree):
        if ref.storage.record == storage.record:
            viewed.update(range(ref.storage_offset * storage.itemsize,
                                (ref.storage_offset + ref.numel) * storage.itemsize))
    free = [b for b in range(storage.record_nbytes or 0) if b not in viewed]
    assert free, f"{storage.record} has no padding"
    return storage.record or "", storage.file_offset + free[-1]


def test_16bit_flat_buffer_not_read_by_to_fp32_is_checked_by_scan(tmp_path):
    """A flip in the model file's 16-bit flat buffer (its padding, so no value changes): to-fp32 reads
    only the fp32 master and is unaffected, byte for byte; scan reads the 16-bit copies (partly: not
    the padding) and must still fail, from the bytes it finishes the record with."""
    ckpt = _copy(ZERO2, tmp_path)
    before = tmp_path / "before.safetensors"
    assert _run("to-fp32", ckpt, before, "-q").exit_code == 0
    path = _tag_dir(ckpt) / "mp_rank_00_model_states.pt"
    record, offset = _padding_byte(path, ("module", "embed.weight"))
    _flip(path, offset)
    after = tmp_path / "after.safetensors"
    res = _run("to-fp32", ckpt, after, "-q")
    assert res.exit_code == 0, res.output
    assert after.read_bytes() == before.read_bytes()
    _assert_crc_error(_run("scan", ckpt, "-q"), path, record)


def test_to_fp32_checks_the_padding_of_a_partition_it_reads_partly(tmp_path):
    """BF16_Optimizer keeps its fp32 partitions padded: to-fp32 reads them without the padding and
    must finish the record before writing."""
    name = "s1_bf16_w2_bf16opt"
    ckpt = _copy(name, tmp_path)
    path = _tag_dir(ckpt) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    storage = _storage_of(path, FP32_PARTITION)
    assert storage.record_nbytes is not None
    _flip(path, storage.file_offset + storage.record_nbytes - 1)  # last padding element
    out = tmp_path / "out"
    out.mkdir()
    _assert_crc_error(_run("to-fp32", ckpt, out / "o.safetensors", "-q"), path, storage.record or "")
    assert list(out.iterdir()) == []


def test_stage3_flat_group_flip_fails_to_fp32_and_reshard(tmp_path):
    ckpt = _copy("s3_bf16_w3_subgroups", tmp_path)
    path = _tag_dir(ckpt) / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    record = _flip_in_tensor(path, (OSD, "fp32_flat_groups", 0), byte=6)
    out = tmp_path / "out"
    out.mkdir()
    _assert_crc_error(_run("to-fp32", ckpt, out / "o.safetensors", "-q", "--workers", "4"), path, record)
    _assert_crc_error(_run("reshard", ckpt, out / "r", "-n", "2", "-q"), path, record)
    assert list(out.iterdir()) == []


# --------------------------------------------------------------------------------------------
# The zip metadata itself


def _central_directory_entry(path: Path, record: str) -> int:
    """Offset of ``record``'s central directory entry."""
    with zipfile.ZipFile(path) as zf:
        pos = zf.start_dir  # type: ignore[attr-defined]
    raw = path.read_bytes()
    while raw[pos:pos + 4] == b"PK\x01\x02":
        name_len, extra_len, comment_len = struct.unpack("<HHH", raw[pos + 28:pos + 34])
        if raw[pos + 46:pos + 46 + name_len].decode() == record:
            return pos
        pos += 46 + name_len + extra_len + comment_len
    raise AssertionError(f"{record} not in the central directory")


def test_flip_in_the_central_directory_crc_field_fails(tmp_path):
    ckpt = _copy(ZERO2, tmp_path)
    path = _tag_dir(ckpt) / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    record = _storage_of(path, FP32_PARTITION).record or ""
    _flip(path, _central_directory_entry(path, record) + 16, bit=0)  # CRC-32 field
    _assert_crc_error(_run("to-fp32", ckpt, tmp_path / "o.safetensors", "-q"), path, record)
    assert not (tmp_path / "o.safetensors").exists()


def test_flip_in_the_pickle_record_fails_every_command(tmp_path):
    ckpt = _copy(ZERO2, tmp_path)
    path = _tag_dir(ckpt) / "mp_rank_00_model_states.pt"
    offset, nbytes = _record_data_offset(path, "mp_rank_00_model_states/data.pkl")
    _flip(path, offset + nbytes - 3)  # inside the pickle's last opcodes' argument bytes
    for args in (["info"], ["scan", "-q"], ["to-fp32", "-q"]):
        extra = [tmp_path / "o.safetensors"] if args[0] == "to-fp32" else []
        res = _run(args[0], ckpt, *extra, *args[1:])
        assert res.exit_code == 3, res.output
        assert "mp_rank_00_model_states/data.pkl" in res.stderr or "cannot be parsed" in res.stderr


# --------------------------------------------------------------------------------------------
# Legacy files and the whole-file check


def test_legacy_files_have_no_crc_and_info_says_so(tmp_path):
    ckpt = _copy("s2_fp32_w2_legacy", tmp_path)
    path = _tag_dir(ckpt) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    storage = _storage_of(path, FP32_PARTITION)
    assert storage.crc32 is None and storage.check is None and storage.record is None
    report = check_file_records(path)
    assert report.has_crc is False and report.ok and report.records == 0
    res = _run("info", ckpt)
    assert res.exit_code == 0
    assert "note         no CRC (legacy format): bit rot cannot be detected in " in res.stdout
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt" in res.stdout
    # The documented limit: a flipped bit in a legacy file goes through unnoticed, unless it lands among the few
    # elements of each param that to-fp32 compares with the module copy (docs/safety.md).
    before = tmp_path / "before.safetensors"
    assert _run("to-fp32", ckpt, before, "-q").exit_code == 0
    _flip(path, storage.file_offset + 4 * _unsampled_master_element(ckpt, path) + 2)
    after = tmp_path / "after.safetensors"
    assert _run("to-fp32", ckpt, after, "-q").exit_code == 0
    assert after.read_bytes() != before.read_bytes()


def test_a_flip_in_a_sampled_legacy_master_element_is_caught_by_the_module_copy(tmp_path):
    """Legacy files carry no CRC; the master's first elements of each param are compared with the module copy."""
    ckpt = _copy("s2_fp32_w2_legacy", tmp_path)
    path = _tag_dir(ckpt) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    _flip(path, _storage_of(path, FP32_PARTITION).file_offset + 4 * 0 + 2)
    res = _run("to-fp32", ckpt, tmp_path / "o.safetensors", "-q")
    assert res.exit_code == 3 and "disagree" in res.stderr and path.name in res.stderr, res.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_zip_fixture_info_has_no_crc_note():
    res = _run("info", FIXTURES / ZERO2 / "ckpt")
    assert res.exit_code == 0
    assert "no CRC" not in res.stdout


@pytest.mark.parametrize("name", [ZERO2, "s3_bf16_w3_subgroups", "s0_fp32_w1"])
def test_check_file_records_passes_clean_files_and_names_the_damaged_record(tmp_path, name):
    ckpt = _copy(name, tmp_path)
    files = sorted(_tag_dir(ckpt).glob("*.pt"))
    for f in files:
        report = check_file_records(f)
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
        assert report.has_crc and report.ok, report.problems
        assert report.records == len(infos)
        assert report.nbytes_checked == sum(i.file_size for i in infos)
    victim = files[-1]
    with zipfile.ZipFile(victim) as zf:
        record = max(zf.infolist(), key=lambda i: i.file_size).filename
    offset, nbytes = _record_data_offset(victim, record)
    _flip(victim, offset + nbytes // 2)
    report = check_file_records(victim)
    assert [p.record for p in report.problems] == [record]
    assert "fails its CRC32 check" in report.problems[0].message


def test_reshard_output_records_carry_correct_crcs(tmp_path):
    out = tmp_path / "r"
    assert _run("reshard", FIXTURES / ZERO2 / "ckpt", out, "-n", "3", "-q").exit_code == 0
    files = sorted(_tag_dir(out).glob("*.pt"))
    assert files
    for f in files:
        report = check_file_records(f)
        assert report.has_crc and report.ok and report.records > 0, report.problems


def test_untouched_fixtures_convert_with_every_record_read_verified(tmp_path):
    """Every record a clean to-fp32 touches ends verified (none left half-checked)."""
    from dsckpt.checkpoint import open_checkpoint
    from dsckpt.convert import plan_to_fp32, run_to_fp32

    for fx in fixtures_where(stage=lambda s: s in (1, 2, 3)):
        c = open_checkpoint(fx.ckpt)
        run_to_fp32(plan_to_fp32(c.logical, tmp_path / f"{fx.name}.safetensors"), c.cache, workers=2)
        checks = [ref.storage.check for tree in c.cache._trees.values()
                  for _, ref in parsed_tree.walk_tensors(tree) if ref.storage.check is not None]
        touched = [ch for ch in checks if ch.touched]
        assert touched or fx.name.endswith("_legacy"), fx.name
        assert all(ch.done and ch.ok for ch in touched), fx.name


def test_crc_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, dsckpt.crc, dsckpt.safe_load; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)



def test_library_iteration_finishes_the_checks(tmp_path):
    """``Checkpoint.iter_tensors`` reads the bf16opt partitions without their padding; a flip there
    surfaces when the iteration ends, not never."""
    from dsckpt.checkpoint import open_checkpoint

    ckpt = _copy("s1_bf16_w2_bf16opt", tmp_path)
    path = _tag_dir(ckpt) / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    storage = _storage_of(path, FP32_PARTITION)
    assert storage.record_nbytes is not None
    _flip(path, storage.file_offset + storage.record_nbytes - 1)
    c = open_checkpoint(ckpt)
    with pytest.raises(CorruptCheckpointError, match="fails its CRC32 check"):
        for _ in c.iter_tensors():
            pass
    c = open_checkpoint(ckpt)
    c.tensor(c.names()[-1])
    with pytest.raises(CorruptCheckpointError, match="fails its CRC32 check"):
        for name in c.names():
            c.tensor(name)
        c.finish_checks()
