"""``dsckpt.zero_to_fp32`` against DeepSpeed 0.19.8's ``deepspeed.utils.zero_to_fp32`` (issue 28, item 3).

DeepSpeed's answers on every committed fixture are recorded once by ``tests/fixtures/record_zero_to_fp32.py``
into ``tests/fixtures/zero_to_fp32_record.json`` (per tensor: dtype, shape, sha256 prefix; or what it raised);
the default run compares against that record, and the ``deepspeed``-marked test recomputes a few fixtures live
and checks the record. Where DeepSpeed's function works, ours returns the same keys, in the same order, and
bit-identical tensors of the same dtypes, and the converter writes the same files (names, index text,
tensors); the one difference is on purpose: at ZeRO stage 1 DeepSpeed drops the frozen params, ours returns
them (``exclude_frozen_parameters=True`` gives exactly DeepSpeed's keys). Where DeepSpeed's raises, ours works
and equals ``dsckpt to-fp32``'s output.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save

from dsckpt import zero_to_fp32 as z
from dsckpt.api import to_fp32
from dsckpt.binding import AmbiguousBindingError
from dsckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, DsckptError, UnsupportedCheckpointError

REPO = Path(__file__).resolve().parent.parent
RECORD = json.loads((FIXTURES / "zero_to_fp32_record.json").read_text())
SHARD = RECORD["shard_size"]


def save_dirs() -> dict[str, Path]:
    sys.path.insert(0, str(FIXTURES))
    try:
        import record_zero_to_fp32
    finally:
        sys.path.remove(str(FIXTURES))
    return record_zero_to_fp32.save_dirs()


SAVE_DIRS = save_dirs()
ALL = list(SAVE_DIRS)
# Designed so that which stage-0 params own the optimizer's tensors cannot be told, and the exported values
# differ by choice (fixture_models.FIXTURES expect_ambiguous): dsckpt refuses rather than guess.
AMBIGUOUS_VALUES = {"s0_bf16_w1_adapter_ambiguous"}
# A pipeline run without ZeRO in fp32: its optimizer state names params by index only (dsckpt binds them by shape
# and order) and its layer files keep the tied module without its key, which no file states: dsckpt refuses to name
# it (docs/support-matrix.md; reshard --tied-key writes a copy that names it); DeepSpeed's raises too.
REFUSED = {"pp2_fp32_z0": "names the tied module.s. saved in layer_00-model_states.pt, whose TiedLayerSpec key no file"}


def ds(fx: str, call: str) -> dict:
    return RECORD["fixtures"][fx][call]


def digest(t: torch.Tensor) -> str:
    """As the recorder writes it: ``"<dtype> [<shape>] <sha256 prefix>"``."""
    c = t.detach().contiguous()
    raw = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    shape = "x".join(map(str, c.shape))
    return f"{str(c.dtype).removeprefix('torch.')} [{shape}] {hashlib.sha256(raw).hexdigest()[:16]}"


def tensors_of(rec: dict, full: dict | None = None) -> dict[str, str]:
    """A recorded call's ``name -> digest`` in key order (``tensors_as_in``: looked up in ``full``)."""
    if "tensors" in rec:
        return rec["tensors"]
    assert full is not None and rec["tensors_as_in"] == "get"
    return {k: full["tensors"][k] for k in rec["keys"]}


def tied_of(sd: dict) -> dict[str, str]:
    first: dict[int, str] = {}
    out = {}
    for k, v in sd.items():
        if id(v) in first:
            out[k] = first[id(v)]
        else:
            first[id(v)] = k
    return out


def stage1_frozen(fx: str) -> list[str]:
    """The frozen params DeepSpeed 0.19.8's zero_to_fp32 leaves out: stage-1 saves have no frozen_param_fragments."""
    path = FIXTURES / fx / "truth.json"
    if not path.exists():  # Lightning / Accelerate fixtures: stage 2 and 3
        return []
    meta = json.loads(path.read_text())
    if meta.get("stage") != 1:
        return []
    if "frozen" in meta:
        return list(meta["frozen"] or [])
    # the optimizer fixtures (generate_optim.py) record the trained params only: the frozen ones are the others
    trained, tied = set(meta.get("trainable") or ()), set(meta.get("tied") or ())
    return [n for n in meta.get("params") or () if n not in trained and n not in tied]


def excluded_tie_aliases(fx: str) -> set[str]:
    """Tied aliases whose source the save left out (a PEFT run's lm_head tied to its excluded embedding): ``dsckpt
    to-fp32`` exports them as saved, DeepSpeed's zero_to_fp32 (and so ours) leaves them out."""
    from dsckpt.checkpoint import open_checkpoint

    return {alias for alias, _ in open_checkpoint(SAVE_DIRS[fx]).logical.excluded_ties}


@pytest.fixture(scope="module")
def dsckpt_fp32(tmp_path_factory):
    """``dsckpt_fp32(fx)``: what ``dsckpt to-fp32`` writes for the fixture (every name, tied aliases included),
    in fp32; computed once per fixture."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(fx: str) -> dict[str, torch.Tensor]:
        if fx not in cache:
            out = tmp_path_factory.mktemp("to_fp32") / "model.safetensors"
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(os, "fsync", lambda fd: None)  # (see no_fsync)
                to_fp32(SAVE_DIRS[fx], out)
            cache[fx] = load_file(str(out))
        return cache[fx]

    return get


def as_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


# --------------------------------------------------------------------------------------------
# get_fp32_state_dict_from_zero_checkpoint


def test_record_covers_every_fixture():
    """A fixture added without re-running the recorder fails here (and is not silently left out)."""
    assert sorted(RECORD["fixtures"]) == ALL
    assert RECORD["deepspeed"] == "0.19.8"


def test_the_counts_in_the_docs_are_the_records():
    """docs/zero-to-fp32.md quotes on how many fixtures DeepSpeed's functions work; they are the record's counts
    (so a new fixture that changes them fails here until the page says so)."""
    import re

    page = " ".join((Path(__file__).resolve().parent.parent / "docs" / "zero-to-fp32.md").read_text().split())
    works = [fx for fx in ALL if "raises" not in ds(fx, "get")]
    raises = set(ALL) - set(works)
    # where DeepSpeed's raises, ours works on all but the fixture built to be ambiguous (tested below)
    assert AMBIGUOUS_VALUES < raises and set(REFUSED) < raises
    safetensors_works = [fx for fx in works if "raises" not in ds(fx, "convert_safetensors")]
    claims = re.search(r"works on (\d+) of the (\d+) fixtures.*?On (\d+) of the other (\d+), DeepSpeed's raises and "
                       r"dsckpt's works.*?`--safe_serialization` also fails on (\d+) of the (\d+)", page)
    assert claims, "docs/zero-to-fp32.md no longer quotes the counts this test checks"
    assert [int(x) for x in claims.groups()] == [
        len(works), len(ALL), len(raises - AMBIGUOUS_VALUES - set(REFUSED)), len(raises),
        len(works) - len(safetensors_works), len(works)]
    # the models DeepSpeed's safetensors output works on have no tied weights (safetensors refuses shared memory)
    assert all(fx.startswith(("lightning_", "peft/")) for fx in safetensors_works), safetensors_works


@pytest.mark.parametrize("fx", ALL)
def test_get_equals_deepspeed_or_works_where_it_raises(fx, dsckpt_fp32):
    ckpt = SAVE_DIRS[fx]
    if fx in AMBIGUOUS_VALUES:
        assert "raises" in ds(fx, "get")
        with pytest.raises(AmbiguousBindingError, match="depends on which params own stored optimizer tensors"):
            z.get_fp32_state_dict_from_zero_checkpoint(ckpt)
        return
    if fx in REFUSED:
        assert "raises" in ds(fx, "get")
        with pytest.raises(UnsupportedCheckpointError, match=REFUSED[fx]):
            z.get_fp32_state_dict_from_zero_checkpoint(ckpt)
        return
    sd = z.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert type(sd) is dict and all(isinstance(v, torch.Tensor) for v in sd.values())
    ours = {k: digest(v) for k, v in sd.items()}
    rec = ds(fx, "get")
    if "raises" not in rec:
        extra = stage1_frozen(fx)
        theirs = rec["tensors"]
        assert [k for k in ours if k not in extra] == list(theirs)
        assert [k for k in ours if k not in theirs] == extra  # DeepSpeed drops them; nothing else differs
        assert {k: ours[k] for k in theirs} == theirs
        assert tied_of(sd) == rec["tied"]
        # exclude_frozen_parameters: exactly DeepSpeed's keys and tensors, stage 1 included
        ex = z.get_fp32_state_dict_from_zero_checkpoint(ckpt, exclude_frozen_parameters=True)
        assert {k: digest(v) for k, v in ex.items()} == tensors_of(ds(fx, "get_exclude_frozen"), rec)
    # ours equals dsckpt to-fp32 (verified against each fixture's truth by test_to_fp32) wherever DeepSpeed's
    # raises, and for the params DeepSpeed drops
    reference = dsckpt_fp32(fx)
    assert set(sd) == set(reference) - excluded_tie_aliases(fx)
    for k, v in sd.items():
        # equal_nan: the lossfloor run's BN stats hold NaN, and NaN is equal to itself here (the same stored value)
        assert torch.equal(as_fp32(v), reference[k]) or torch.allclose(as_fp32(v), reference[k], 0, 0, True), k


@pytest.mark.parametrize("fx", [fx for fx in ALL if fx not in AMBIGUOUS_VALUES and fx not in REFUSED])
def test_lazy_mode_reads_nothing_until_asked_and_equals_deepspeed(fx, monkeypatch):
    from dsckpt import assemble

    reads: list[str] = []
    real = assemble.read_entry
    monkeypatch.setattr(assemble, "read_entry", lambda entry, *a, **k: reads.append(entry.name) or real(entry, *a, **k))
    lazy = z.get_fp32_state_dict_from_zero_checkpoint(SAVE_DIRS[fx], lazy_mode=True)
    assert reads == []
    assert all(isinstance(v, z.LazyTensor) for v in lazy.values())
    values = {}
    for k, v in lazy.items():
        t = v.contiguous()
        assert (tuple(t.shape), t.dtype) == (tuple(v.shape), v.dtype) and isinstance(v.shape, torch.Size)
        values[k] = t
    assert len(reads) == len(lazy)  # each .contiguous() reads (a tied alias is its source's LazyTensor)
    rec = ds(fx, "get_lazy")
    if "raises" not in rec:
        extra = stage1_frozen(fx)
        theirs = tensors_of(rec, ds(fx, "get"))
        assert {k: digest(t) for k, t in values.items() if k not in extra} == theirs
        assert list(theirs) == [k for k in values if k not in extra]
        assert tied_of(lazy) == rec["tied"]


def test_lazy_values_behave_like_gathered_tensors():
    lazy = z.get_fp32_state_dict_from_zero_checkpoint(FIXTURES / "s3_bf16_w3_subgroups" / "ckpt", lazy_mode=True)
    w = lazy["fc1.weight"]
    assert (w.shape, w.dtype, w.numel(), w.dim(), w.size(0), w.is_floating_point()) == (
        torch.Size([7, 6]), torch.float32, 42, 2, 7, True)
    assert torch.equal(w.to(torch.bfloat16), w.contiguous().to(torch.bfloat16))
    assert repr(w) == "LazyTensor('fc1.weight', shape=[7, 6], dtype=float32)"
    assert lazy["head.weight"] is lazy["embed.weight"]
    # DeepSpeed's to_torch_tensor on our lazy dict: shared values stay shared, as in DeepSpeed's
    sd = z.to_torch_tensor(lazy)
    assert sd["head.weight"] is sd["embed.weight"]
    empty = z.to_torch_tensor(lazy, return_empty_tensor=True, dtype="bf16")
    assert (empty["fc1.weight"].dtype, empty["bn.num_batches_tracked"].dtype) == (torch.bfloat16, torch.int64)


def test_tag_resolution_and_errors(tmp_path):
    fx = FIXTURES / "s1_fp32_w2_accelerate_tag" / "ckpt"  # latest = "pytorch_model"
    by_latest = z.get_fp32_state_dict_from_zero_checkpoint(fx)
    by_tag = z.get_fp32_state_dict_from_zero_checkpoint(fx, tag="pytorch_model")
    tag_dir = z.get_fp32_state_dict_from_zero_checkpoint(fx / "pytorch_model")  # DeepSpeed's needs `latest`
    assert all(torch.equal(by_latest[k], by_tag[k]) and torch.equal(by_tag[k], tag_dir[k]) for k in by_latest)
    with pytest.raises(CheckpointNotFoundError, match="tag 'global_step9' not found in .*available tags: "
                                                      "pytorch_model"):
        z.get_fp32_state_dict_from_zero_checkpoint(fx, tag="global_step9")
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        z.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "nothing")
    # every error is a DsckptError (DeepSpeed's are ValueError / FileNotFoundError)
    assert issubclass(CheckpointNotFoundError, DsckptError)


def test_a_flipped_bit_fails_the_read_and_leaves_no_output(tmp_path):
    import shutil
    import struct
    import zipfile

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "s3_bf16_w3_subgroups" / "ckpt", ckpt)
    path = ckpt / "global_step3" / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    from dsckpt import safe_load

    storage = safe_load.load(path)["optimizer_state_dict"]["fp32_flat_groups"][0].storage
    with zipfile.ZipFile(path) as zf:
        assert zf.getinfo(storage.record).file_size > 6
    with open(path, "r+b") as f:
        f.seek(storage.file_offset + 6)
        b = f.read(1)
        f.seek(storage.file_offset + 6)
        f.write(struct.pack("B", b[0] ^ 4))
    with pytest.raises(CorruptCheckpointError, match=f"record '{storage.record}' fails its CRC32 check"):
        z.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    lazy = z.get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)
    with pytest.raises(CorruptCheckpointError, match="fails its CRC32 check"):
        for v in lazy.values():  # the last distinct value's read completes the checks
            v.contiguous()
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CorruptCheckpointError, match="fails its CRC32 check"):
        z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, max_shard_size=SHARD)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]  # no shard, no index, no temporary folder
    with pytest.raises(CorruptCheckpointError, match="fails its CRC32 check"):
        z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "new" / "out", safe_serialization=True)
    assert list(tmp_path.glob("new/*")) == []  # the folder this call made is gone again


def test_a_code_running_pickle_is_refused_and_nothing_runs(tmp_path):
    """DeepSpeed's script unpickles with ``weights_only=False``: a model-states file can run code. Ours refuses."""
    import io
    import shutil
    import struct
    import zipfile

    from dsckpt.errors import UnsafeCheckpointError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "s2_fp32_w4" / "ckpt", ckpt)
    marker = tmp_path / "ran"
    cmd = f"touch {marker}".encode()
    evil = b"\x80\x02cos\nsystem\n(X" + struct.pack("<I", len(cmd)) + cmd + b"tR."
    path = ckpt / "global_step3" / "mp_rank_00_model_states.pt"
    with zipfile.ZipFile(path) as zf:
        entries = [(i.filename, evil if i.filename.endswith("/data.pkl") else zf.read(i)) for i in zf.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as out:
        for name, data in entries:
            out.writestr(name, data)
    path.write_bytes(buf.getvalue())
    with pytest.raises(UnsafeCheckpointError, match="os.system"):
        z.get_fp32_state_dict_from_zero_checkpoint(ckpt, lazy_mode=True)
    with pytest.raises(UnsafeCheckpointError, match="os.system"):
        z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------
# convert_zero_checkpoint_to_fp32_state_dict


def read_files(out: Path) -> dict[str, dict]:
    """Every file in ``out``: index text, or ``{"tensors": name -> digest, "tied": ..., "metadata": ...}``."""
    files: dict[str, dict] = {}
    for p in sorted(out.iterdir()):
        if p.name.endswith(".json"):
            files[p.name] = {"text": p.read_text()}
        elif p.suffix == ".safetensors":
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata()
            sd = load_file(str(p))
            # byte for byte what safetensors' save_file (DeepSpeed's writer) makes of these tensors
            assert p.read_bytes() == save(sd, metadata=meta), p
            files[p.name] = {"metadata": meta, "tensors": {k: digest(v) for k, v in sd.items()}, "tied": {}}
        else:
            sd = torch.load(p, map_location="cpu", weights_only=True)
            ptr: dict[tuple, str] = {}
            tied = {}
            for k, v in sd.items():
                key = (v.data_ptr(), tuple(v.shape), v.stride(), v.dtype)
                if key in ptr and v.numel():
                    tied[k] = ptr[key]
                else:
                    ptr.setdefault(key, k)
            files[p.name] = {"tensors": {k: digest(v) for k, v in sd.items()}, "tied": tied}
    return files


def without(files: dict[str, dict], names: list[str]) -> dict[str, dict]:
    """``files`` less the tensors ``names`` (and their index entries)."""
    if not names:
        return files
    out = {}
    for f, rec in files.items():
        if "text" in rec:
            index = json.loads(rec["text"])
            for n in names:
                size = int(digest_numel_nbytes(files, n))
                index["weight_map"].pop(n, None)
                index["metadata"]["total_size"] -= size
            out[f] = {"text": json.dumps(index, indent=2, sort_keys=True) + "\n"}
        else:
            out[f] = {**rec, "tensors": {k: v for k, v in rec["tensors"].items() if k not in names}}
    return out


def digest_numel_nbytes(files: dict[str, dict], name: str) -> int:
    for rec in files.values():
        d = rec.get("tensors", {}).get(name)
        if d is not None:
            dtype, shape, _ = d.split(" ")
            numel = 1
            for s in shape.strip("[]").split("x"):
                numel *= int(s) if s else 1
            return numel * torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    raise KeyError(name)


CONVERSIONS = {"convert_bin": {}, "convert_bin_sharded": {"max_shard_size": SHARD},
               "convert_safetensors": {"safe_serialization": True},
               "convert_safetensors_sharded": {"safe_serialization": True, "max_shard_size": SHARD}}


@pytest.fixture
def no_fsync(monkeypatch):
    """Outputs written without fsync: what they hold is the same, and on a machine shared by several test runs
    the fsyncs were most of the time these tests took."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


@pytest.mark.parametrize("fx", [fx for fx in ALL if fx not in AMBIGUOUS_VALUES and fx not in REFUSED])
def test_convert_writes_deepspeeds_files_or_works_where_it_raises(fx, tmp_path, dsckpt_fp32, no_fsync):
    ckpt = SAVE_DIRS[fx]
    deepspeed_works = "raises" not in ds(fx, "convert_bin")
    # where DeepSpeed's raises, sharding is shown by the fixtures where it works (and test_plan_output_...)
    calls = list(CONVERSIONS) if deepspeed_works else ["convert_bin", "convert_safetensors"]
    got = {}
    for call in calls:
        out = tmp_path / call
        assert z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, **CONVERSIONS[call]) is None
        got[call] = read_files(out)
    extra = stage1_frozen(fx)
    for call in calls:
        rec = ds(fx, call)
        if "raises" not in rec:  # the same file names, index text and tensors (as loaded), but DeepSpeed's drops
            if extra and "sharded" in call:  # the stage-1 frozen params ours keeps can move the shard boundaries:
                out = tmp_path / f"{call}-exclude-frozen"  # without them, exactly DeepSpeed's files
                z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, out, exclude_frozen_parameters=True,
                                                             **CONVERSIONS[call])
                assert read_files(out) == rec["files"]
            else:
                assert without(got[call], extra) == rec["files"]
    # where DeepSpeed's raises (every safetensors call: the tied alias shares memory): the same files as the
    # .bin, named .safetensors, each tensor a copy of its own, metadata {"format": "pt"} as DeepSpeed writes it
    for bin_call, st_call in (("convert_bin", "convert_safetensors"),
                              ("convert_bin_sharded", "convert_safetensors_sharded")):
        if st_call not in got:
            continue
        renamed = {}
        for name, rec in got[bin_call].items():
            new = name.replace("pytorch_model", "model").replace(".bin", ".safetensors")
            if "text" in rec:
                renamed[new] = {"text": rec["text"].replace("pytorch_model", "model").replace(".bin", ".safetensors")}
            else:
                renamed[new] = {"metadata": {"format": "pt"}, "tensors": rec["tensors"], "tied": {}}
        assert got[st_call] == renamed
    # and the tensors are dsckpt to-fp32's
    left_out = excluded_tie_aliases(fx)
    reference = {k: digest(v) for k, v in dsckpt_fp32(fx).items() if k not in left_out}
    written = {k: d for rec in got["convert_bin"].values() for k, d in rec.get("tensors", {}).items()}
    assert written == reference


def test_plan_output_follows_huggingface_hub_split():
    """huggingface_hub's split on the same keys and sizes (DeepSpeed's converter calls it) gives the same shards."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from dsckpt import open_checkpoint

    ckpt = open_checkpoint(FIXTURES / "hf_llama_z2_bf16_w2" / "ckpt")
    items = z.plan_state_dict(ckpt.logical)
    empty: dict[str, torch.Tensor] = {}
    for i in items:
        empty[i.name] = empty[i.alias_of] if i.alias_of else torch.empty(i.entry.shape, dtype=torch.float32)
    for limit in (300, 2000, 10_000, "20KB", 10**9):
        split = split_torch_state_dict_into_shards(empty, filename_pattern="pytorch_model{suffix}.bin",
                                                   max_shard_size=limit)
        plan = z.plan_output(items, "out", max_shard_size=limit)
        assert {f.filename: list(f.names) for f in plan.files} == split.filename_to_tensors, limit
        if split.is_sharded:
            assert json.loads(plan.index_text) == {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        else:
            assert plan.index_text is None
    assert [f.filename for f in z.plan_output(items, "out", max_shard_size=None).files] == ["pytorch_model.bin"]


@settings(derandomize=True, max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["float32", "bfloat16", "int64"]),
                          st.lists(st.integers(0, 9), max_size=2), st.integers(-1, 6)), min_size=1, max_size=12),
       st.integers(1, 400))
def test_plan_output_splits_as_huggingface_hub_for_any_sizes(tensors, limit):
    """Random dtypes, shapes (empty ones included), tied aliases (an alias of key ``j`` when ``j`` >= 0 names
    an earlier non-alias key) and limits: the same shards, names and index as huggingface_hub's split."""
    from huggingface_hub import split_torch_state_dict_into_shards

    from dsckpt.model import Kind, TensorEntry

    items: list[z.StateDictItem] = []
    empty: dict[str, torch.Tensor] = {}
    for i, (dtype, shape, tie) in enumerate(tensors):
        name = f"t{i}"
        sources = [it for it in items if it.alias_of is None]
        if 0 <= tie < len(sources):
            src = sources[tie]
            items.append(z.StateDictItem(name, src.entry, src.dtype, alias_of=src.name))
            empty[name] = empty[src.name]
            continue
        entry = TensorEntry(name, tuple(shape), Kind.PARAM, True, ())
        items.append(z.StateDictItem(name, entry, dtype))
        want = torch.float32 if dtype != "int64" else torch.int64  # as DeepSpeed's to_torch_tensor(dtype=fp32)
        empty[name] = torch.empty(tuple(shape), dtype=want)
    split = split_torch_state_dict_into_shards(empty, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=limit)
    plan = z.plan_output(items, "out", max_shard_size=limit, safe_serialization=True)
    assert {f.filename: list(f.names) for f in plan.files} == split.filename_to_tensors
    if split.is_sharded:
        assert json.loads(plan.index_text) == {"metadata": split.metadata, "weight_map": split.tensor_to_filename}


def test_convert_writes_into_an_existing_folder_beside_other_files(tmp_path, caplog):
    """As DeepSpeed's: OUTPUT_DIR may exist (e.g. the save dir itself); files of the same names are replaced."""
    save = tmp_path / "save"
    import shutil

    shutil.copytree(FIXTURES / "s2_fp32_w4" / "ckpt", save)
    (save / "pytorch_model.bin").write_bytes(b"an older export")
    before = {p: p.read_bytes() for p in (save / "global_step3").iterdir()}
    z.convert_zero_checkpoint_to_fp32_state_dict(save, save)
    assert caplog.messages == [f"replaced the existing '{save / 'pytorch_model.bin'}'"]
    sd = torch.load(save / "pytorch_model.bin", weights_only=True)
    assert sd["head.weight"].data_ptr() == sd["embed.weight"].data_ptr()  # tied: one storage, as torch.save
    assert {p: p.read_bytes() for p in (save / "global_step3").iterdir()} == before
    assert sorted(p.name for p in save.iterdir()) == ["global_step3", "latest", "pytorch_model.bin", "zero_to_fp32.py",
                                                      "zero_to_torch.py"]


def test_convert_dtype_and_bad_sizes(tmp_path):
    ckpt = FIXTURES / "s3_bf16_w3_subgroups" / "ckpt"
    z.convert_zero_checkpoint_to_state_dict(ckpt, tmp_path / "bf16", dtype=torch.bfloat16, safe_serialization=True)
    sd = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    fp32 = z.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    assert sd["bn.num_batches_tracked"].dtype == torch.int64
    assert all(torch.equal(sd[k], v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in fp32.items())
    from dsckpt.errors import UsageError

    with pytest.raises(UsageError, match="cannot read size '5 gigs'"):
        z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "x", max_shard_size="5 gigs")
    with pytest.raises(UsageError, match="unknown dtype 'int8'"):
        z.convert_zero_checkpoint_to_state_dict(ckpt, tmp_path / "x", dtype="int8")
    assert not (tmp_path / "x").exists()


# --------------------------------------------------------------------------------------------
# load_state_dict_from_zero_checkpoint


@pytest.mark.parametrize("fx", ["s1_bf16_w3", "s3_bf16_w3_subgroups", "s0_fp16_w1_fused"])
def test_load_state_dict_from_zero_checkpoint(fx):
    sys.path.insert(0, str(FIXTURES))
    try:
        from fixture_models import TinyNet
    finally:
        sys.path.remove(str(FIXTURES))
    torch.manual_seed(0)
    model = TinyNet()
    got = z.load_state_dict_from_zero_checkpoint(model, SAVE_DIRS[fx])
    assert got is model and next(model.parameters()).device.type == "cpu"
    truth = load_file(str(FIXTURES / fx / "truth.safetensors"))
    for name, value in model.state_dict().items():
        kind = "buffer" if name.startswith("bn.running") or name.endswith("num_batches_tracked") else "param"
        assert torch.equal(value, truth[f"{kind}/{name}"].to(value.dtype)), name  # frozen ones too, stage 1 included


# --------------------------------------------------------------------------------------------
# python -m dsckpt.zero_to_fp32


def run_main(capsys, *argv: object) -> tuple[int, str, str]:
    code = z.main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_command_writes_what_the_function_writes(tmp_path, capsys):
    ckpt = FIXTURES / "hf_gpt2_z3_bf16_w2" / "ckpt"
    code, out, err = run_main(capsys, ckpt, tmp_path / "cli", "--safe_serialization", "--max_shard_size", "20KB",
                              "-t", "global_step3", "--exclude_frozen_parameters", "-d")
    assert code == 0, err
    z.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "api", safe_serialization=True,
                                                 max_shard_size="20KB", tag="global_step3",
                                                 exclude_frozen_parameters=True)
    assert read_files(tmp_path / "cli") == read_files(tmp_path / "api")
    names = sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert names[-1] == "model.safetensors.index.json" and len(names) > 2
    assert out == (f"wrote {', '.join(names[:-1] + names[-1:])} to {tmp_path / 'cli'}: 28 params and 0 buffers in "
                   f"float32 from {ckpt / 'global_step3'}\n")


def test_command_errors_are_one_line_with_dsckpts_exit_codes(tmp_path, capsys):
    code, out, err = run_main(capsys, tmp_path / "nothing", tmp_path / "out")
    assert (code, out) == (3, "")
    assert err == f"zero_to_fp32: error: '{tmp_path / 'nothing'}' does not exist\n"
    code, out, err = run_main(capsys, FIXTURES / "s1_fp32_w2" / "ckpt", tmp_path / "out", "--max_shard_size", "lots")
    assert (code, out) == (2, "")
    assert err == "zero_to_fp32: error: cannot read size 'lots'; write it like 5GB, 500MB or 2GiB\n"
    code, out, err = run_main(capsys, FIXTURES / "s0_bf16_w1_adapter_ambiguous" / "ckpt", tmp_path / "out")
    assert code == 3 and err.startswith("zero_to_fp32: error: ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    with pytest.raises(SystemExit) as e:
        z.main([str(tmp_path)])  # OUTPUT_DIR missing: argparse's usage error
    assert e.value.code == 2


def test_module_runs_without_deepspeed_or_torch_at_import():
    code = ("import sys, dsckpt.zero_to_fp32; "
            "print('deepspeed' in sys.modules, 'torch' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert r.stdout == "False False\n"
    r = subprocess.run([sys.executable, "-m", "dsckpt.zero_to_fp32", "--help"], capture_output=True, text=True,
                       env=env, check=True)
    assert r.stdout.startswith("usage: python -m dsckpt.zero_to_fp32 [-h] [--max_shard_size MAX_SHARD_SIZE]")
    assert "--safe_serialization" in r.stdout and "--exclude_frozen_parameters" in r.stdout


# --------------------------------------------------------------------------------------------
# The record, recomputed live


LIVE = ["ds0103_s1_bf16_w2", "s2_bf16_w2_roundrobin", "s3_bf16_w3_subgroups", "s0_fp32_w1"]


@pytest.mark.live
@pytest.mark.deepspeed
def test_record_matches_deepspeed_live(tmp_path):
    """DeepSpeed 0.19.8's functions, run now on a few fixtures (a 0.10.3 stage-1 save, round-robin ZeRO-2,
    stage 3 with sub-groups, and a stage-0 save it refuses), give what the committed record says."""
    out = tmp_path / "live.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    subprocess.run([sys.executable, str(FIXTURES / "record_zero_to_fp32.py"), "--out", str(out), *LIVE],
                   check=True, env=env, capture_output=True, text=True)
    live = json.loads(out.read_text())
    assert {k: live[k] for k in ("deepspeed", "shard_size")} == {k: RECORD[k] for k in ("deepspeed", "shard_size")}
    assert live["fixtures"] == {fx: RECORD["fixtures"][fx] for fx in LIVE}
