"""The fuzzed corpus (tests/fuzz.py) given to every command: success with correct data or one clear
error line -- never a traceback, exit 70, hang or unbounded memory. And the bugs it found, one test each.

``DSCKPT_FUZZ_SCALE=10 pytest tests/test_fuzz.py`` runs a larger corpus. The default tier runs scale 1 (about 1,200
cases, under a minute on the 2-core machine); ``.ci/run`` runs scale 4 (about 2,500 cases) as a step of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import FIXTURES
from fuzz import WRONG_ALLOWED

from dsckpt.cli import main
from dsckpt.errors import CorruptCheckpointError

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCALE = 1  # ~1,200 cases; CI also runs 4 (.ci/run)
MEMORY_GB = 6  # RLIMIT_AS headroom of the fuzz process above torch: a 1e12-element allocation fails, not swaps


def test_fuzzed_corpus_is_refused_cleanly_or_read_correctly():
    scale = os.environ.get("DSCKPT_FUZZ_SCALE", str(DEFAULT_SCALE))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "fuzz.py"), "--json", "--scale", scale,
                          "--memory-gb", str(MEMORY_GB)], capture_output=True, text=True, timeout=900, check=False,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("failures", "wrong")}, indent=1))
    assert summary["cases"] >= 500 + 500 * float(scale)  # ~1,200 cases at scale 1, 2,549 at 4
    assert summary["failures"] == [], json.dumps(summary["failures"][:10], indent=1)
    caught_categories = [o for o in summary["wrong"] if o["category"] not in WRONG_ALLOWED]
    assert caught_categories == [], json.dumps(caught_categories[:10], indent=1)
    for category in ("truncate", "zero-length", "flip:pickle", "folder-for-file", "absurd-size",
                     "zip-remove-entry", "mixed-saves", "safetensors:offsets-overlap", "index:not-json",
                     "hostile:hang", "hostile:memory", "hostile:internal", "hostile:silent", "hostile:message"):
        assert summary["by_category"][category].get("refused"), category


# --------------------------------------------------------------------------------------------
# Bugs the corpus found


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def _one_line(res, code: int, *phrases: str) -> None:
    assert res.exit_code == code, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsckpt: error: "), res.stderr
    for p in phrases:
        assert p in lines[0], lines[0]


def _copy(tmp_path: Path, name: str) -> Path:
    shutil.copytree(FIXTURES / name / "ckpt", tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize("content", [b"global_step3\x00x", b"../../etc", b"\xff\xfe", b"/abs"])
def test_latest_that_is_not_a_tag_name_is_corrupt_not_exit_70(tmp_path, content):
    ckpt = _copy(tmp_path, "s2_bf16_w2_2groups")
    (ckpt / "latest").write_bytes(content)
    _one_line(_run("info", str(ckpt)), 3, "latest", "does not hold a tag folder name", "--tag")


def test_zip_record_stored_twice_is_refused(tmp_path):
    ckpt = _copy(tmp_path, "s2_bf16_w2_2groups")
    victim = ckpt / "global_step3" / "mp_rank_00_model_states.pt"
    with zipfile.ZipFile(victim) as zf:
        entries = [(i, zf.read(i)) for i in zf.infolist()]
    with pytest.warns(UserWarning), zipfile.ZipFile(victim, "w") as zf:
        for info, data in entries:
            zf.writestr(info, data)
        zf.writestr(entries[-2][0].filename, entries[-2][1][::-1])
    _one_line(_run("to-fp32", str(ckpt), str(tmp_path / "o.safetensors")), 3, victim.name, "more than once")


def test_mixed_rank_files_from_two_saves_are_refused(tmp_path):
    ckpt = _copy(tmp_path, "s3_fp32_w2")
    name = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(FIXTURES / "s3_fp16_w2_cpuforced" / "ckpt" / "global_step3" / name, ckpt / "global_step3" / name)
    _one_line(_run("to-fp32", str(ckpt), str(tmp_path / "o.safetensors")), 3, name, "different saves")


def test_absurd_tensor_shape_is_refused_before_any_allocation(tmp_path):
    from dataclasses import replace

    from dsckpt import parsed_tree, safe_load

    path = FIXTURES / "s2_bf16_w2_2groups" / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt"
    _, ref = parsed_tree.walk_tensors(safe_load.load(path))[0]
    huge = replace(ref, shape=(10**12,), stride=(1,))
    for read in (huge.read_numpy, huge.read, huge.load):
        with pytest.raises(CorruptCheckpointError, match="runs past the end of its storage"):
            read()


def _safetensors(tmp_path: Path) -> tuple[Path, dict, bytes]:
    path = tmp_path / "m.safetensors"
    assert _run("to-fp32", "-q", str(FIXTURES / "s2_fp32_w2_legacy" / "ckpt"), str(path)).exit_code == 0
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return path, json.loads(data[8:8 + n]), data[8 + n:]


def _write(path: Path, header: str, body: bytes) -> None:
    raw = header.encode() + b" " * (-len(header) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


@pytest.mark.parametrize("edit", ["negative-offsets", "overlap", "duplicate-name", "metadata-list"])
def test_malformed_safetensors_headers_are_refused(tmp_path, edit):
    path, header, body = _safetensors(tmp_path)
    names = [k for k in header if k != "__metadata__"]
    a, b = header[names[0]], header[names[1]]
    if edit == "negative-offsets":  # would read the header's own bytes as tensor data
        a["data_offsets"] = [x - 8 for x in a["data_offsets"]]
    elif edit == "overlap":
        b["data_offsets"] = a["data_offsets"]
        b["shape"], b["dtype"] = a["shape"], a["dtype"]
    elif edit == "metadata-list":
        header["__metadata__"] = [1]
    text = json.dumps(header)
    if edit == "duplicate-name":
        text = text[:-1] + f', {json.dumps(names[0])}: {json.dumps(b)}}}'
    _write(path, text, body)
    _one_line(_run("scan", str(path)), 3, "m.safetensors", "not a readable .safetensors file")


@pytest.mark.parametrize("weight_map", [[1, 2], {"x": 5}, {"x": "/etc/passwd"}, {"x": "../m.safetensors"}])
def test_broken_safetensors_index_is_refused(tmp_path, weight_map):
    out = tmp_path / "shards"
    assert _run("to-fp32", "-q", "--max-shard-size", "300B", str(FIXTURES / "s0_fp32_w1" / "ckpt"),
                str(out)).exit_code == 0
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _one_line(_run("scan", str(out)), 3, "model.safetensors.index.json", "unreadable index")


def test_zip_directory_with_an_impossible_version_is_corrupt_not_exit_70(tmp_path):
    """A flipped 'version needed to extract' byte made zipfile raise NotImplementedError (exit 70)."""
    ckpt = _copy(tmp_path, "s2_bf16_w2_2groups")
    victim = ckpt / "global_step3" / "mp_rank_00_model_states.pt"
    data = bytearray(victim.read_bytes())
    central = data.index(b"PK\x01\x02")
    data[central + 6:central + 8] = struct.pack("<H", 134)  # version 13.4
    victim.write_bytes(bytes(data))
    _one_line(_run("to-fp32", str(ckpt), str(tmp_path / "o.safetensors")), 3, victim.name, "zip file version")


def _edit_optimizer_file(ckpt: Path, rank: int, edit) -> Path:
    """Rewrite one rank's optimizer file (with torch's own unpickler: this is our fixture) after
    ``edit(optimizer_state_dict)``, keeping its serialization format."""
    import torch

    path = ckpt / "global_step3" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    legacy = not zipfile.is_zipfile(path)
    sd = torch.load(path, map_location="cpu", weights_only=False)
    edit(sd["optimizer_state_dict"])
    torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
    return path


@pytest.mark.parametrize("fixture", ["s2_fp32_w2_legacy", "s2_fp32_w3_align"])
def test_damaged_zero12_optimizer_structure_is_corrupt_not_exit_70(tmp_path, fixture):
    """Flips in legacy pickles (no CRC there) turned a key or an int into something else: KeyError
    and ValueError escaped as exit 70."""
    pytest.importorskip("deepspeed")  # torch.load of the fixture needs DeepSpeed's classes
    ckpt = _copy(tmp_path, fixture)
    victim = _edit_optimizer_file(ckpt, 1, lambda osd: osd.pop("single_partition_of_fp32_groups"))
    _one_line(_run("to-fp32", str(ckpt), str(tmp_path / "a.safetensors")), 3, victim.name,
              "single_partition_of_fp32_groups")
    ckpt = _copy(tmp_path / "b", fixture)

    def bad_padding(osd):
        osd["param_alignment_paddings"][0][0] = "x"

    victim = _edit_optimizer_file(ckpt, 0, bad_padding)
    _one_line(_run("verify", str(ckpt)), 3, victim.name, "param_alignment_paddings")


def test_param_name_missing_from_the_module_is_corrupt_not_a_renamed_tensor(tmp_path):
    """A flip inside a name in a legacy model-states pickle ('bn.weight' -> 'bn.we:ght') exported the
    master under the damaged name and the module copy as a frozen 'bn.weight', exit 0."""
    pytest.importorskip("deepspeed")
    import torch

    ckpt = _copy(tmp_path, "s2_fp32_w2_legacy")
    path = ckpt / "global_step3" / "mp_rank_00_model_states.pt"
    sd = torch.load(path, map_location="cpu", weights_only=False)
    group = sd["param_shapes"][0]
    first = next(iter(group))
    sd["param_shapes"][0] = type(group)((("x" + k[1:] if k == first else k), v) for k, v in group.items())
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    _one_line(_run("to-fp32", str(ckpt), str(tmp_path / "o.safetensors")), 3, path.name, "x" + first[1:],
              "no tensor of that name")


def _edit_model_states(ckpt: Path, edit) -> Path:
    import torch

    path = ckpt / "global_step3" / "mp_rank_00_model_states.pt"
    legacy = not zipfile.is_zipfile(path)
    sd = torch.load(path, map_location="cpu", weights_only=False)
    edit(sd)
    torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
    return path


def _rename_key(d, old: str, new: str):
    return type(d)((new if k == old else k, v) for k, v in d.items())


@pytest.mark.parametrize("where", ["module-buffer", "buffer_names", "module-param"])
def test_a_damaged_name_in_the_module_state_dict_is_corrupt(tmp_path, where):
    """Scale-12 fuzz: a flipped byte in a name of the legacy module state dict ('bn.running_var' ->
    'bn.runOing_var') made a frozen param of the buffer, exit 0 with a wrong name list."""
    pytest.importorskip("deepspeed")
    ckpt = _copy(tmp_path, "s2_fp32_w2_legacy")

    def edit(sd):
        if where == "module-buffer":
            sd["module"] = _rename_key(sd["module"], "bn.running_var", "bn.runOing_var")
        elif where == "buffer_names":
            sd["buffer_names"] = ["bn]num_batches_tracked" if b == "bn.num_batches_tracked" else b
                                  for b in sd["buffer_names"]]
        else:
            sd["module"] = _rename_key(sd["module"], "fc1.weight", "fc1.we:ght")

    path = _edit_model_states(ckpt, edit)
    _one_line(_run("to-fp32", str(ckpt), str(tmp_path / "o.safetensors")), 3, path.name, "the file is damaged")


def test_legacy_optimizer_file_without_base_state_is_corrupt(tmp_path):
    pytest.importorskip("deepspeed")
    ckpt = _copy(tmp_path, "s2_fp32_w2_legacy")
    victim = _edit_optimizer_file(ckpt, 0, lambda osd: osd.pop("base_optimizer_state"))
    _one_line(_run("scan", str(ckpt)), 3, victim.name, "base_optimizer_state")


def test_pickle_length_past_the_end_of_a_legacy_file_is_refused_before_allocating(tmp_path):
    """Scale-12 fuzz: a flipped length byte made the unpickler allocate far more than the file holds
    (MemoryError, exit 70)."""
    ckpt = _copy(tmp_path, "s2_fp32_w2_legacy")
    victim = ckpt / "global_step3" / "mp_rank_00_model_states.pt"
    data = bytearray(victim.read_bytes())
    at = data.index(b"X\x06\x00\x00\x00module")  # BINUNICODE 'module' (protocol 2) in the main pickle
    data[at + 1:at + 5] = struct.pack("<I", 0xFFFFFFF0)  # a 4 GiB string in a file of a few KB
    victim.write_bytes(bytes(data))
    _one_line(_run("info", str(ckpt)), 3, victim.name, "asks for 4294967280 bytes", "past the end of the file")


def test_control_characters_in_an_error_are_escaped_onto_one_line(tmp_path):
    """Scale-12 fuzz: a carriage return inside a damaged config key split the error line."""
    pytest.importorskip("deepspeed")
    ckpt = _copy(tmp_path, "s2_fp32_w2_legacy")
    path = ckpt / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    import torch

    sd = torch.load(path, map_location="cpu", weights_only=False)
    sd["ds_config"] = {("bad\rkey" if k == "train_micro_batch_size_per_gpu" else k): v
                       for k, v in sd["ds_config"].items()}
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    res = _run("info", str(ckpt))
    _one_line(res, 3, "bad\\rkey")
    assert "\r" not in res.stderr


@pytest.mark.parametrize("opcode", [b"B", b"\x8e", b"\x96"])  # BINBYTES, BINBYTES8, BYTEARRAY8
def test_byte_lengths_past_the_end_of_a_legacy_file_are_refused_before_allocating(tmp_path, opcode):
    """Scale-12 fuzz under a 6 GB address-space limit: BYTEARRAY8 with a damaged length made the
    unpickler allocate 18 GB first (exit 70, 'out of memory')."""
    import resource

    ckpt = _copy(tmp_path, "s2_fp32_w2_legacy")
    victim = ckpt / "global_step3" / "mp_rank_00_model_states.pt"
    data = bytearray(victim.read_bytes())
    at = data.index(b"X\x06\x00\x00\x00module")
    size = struct.pack("<I", 0xFFFFFFF0) if opcode == b"B" else struct.pack("<Q", 1 << 40)
    data[at:at + 11] = (opcode + size + b"\x00" * 10)[:11]
    victim.write_bytes(bytes(data))
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (min(3 << 30, hard) if hard > 0 else 3 << 30, hard))
    try:
        res = _run("info", str(ckpt))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    _one_line(res, 3, victim.name, "past the end of the file")
