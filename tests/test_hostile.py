"""Issue 29: hostile and damaged inputs -- no hang, no memory blow-up, no internal error, never a silent wrong
answer. The corpus (tests/hostile.py) is built from real fixtures at test time; each case's commands run in a
subprocess under a time and address-space limit where the damage aims at time or memory, in-process otherwise.
Then the budgets themselves (dsckpt.limits), one at a time, with no files."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
from hostile import Case, billion_laughs, cases, clean_export, run_case

from dsckpt import limits, parsed_tree, tensor_ref
from dsckpt.errors import CorruptCheckpointError, UsageError, shorten, shorten_runs
from dsckpt.limits import LimitExceededError, ReadLimits

CASES = cases()


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("clean")
    return {f: clean_export(f, work) for f in sorted({c.fixture for c in CASES})}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_case_is_refused_cleanly_or_read_correctly(case: Case, tmp_path: Path, exports: dict[str, Path]):
    assert run_case(case, tmp_path, exports) == []


def test_the_corpus_covers_every_family():
    assert {c.family for c in CASES} == {"hang", "memory", "internal", "silent", "output", "message"}
    assert len({c.id for c in CASES}) == len(CASES)


# --------------------------------------------------------------------------------------------
# The budgets, one at a time


def _with_limits(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(limits.LIMITS_ENV, text)


@pytest.mark.parametrize("text, field, value", [
    ("max_depth=500", "max_depth", 500),
    ("max_pickle_nbytes=2GiB", "max_pickle_nbytes", 2 << 30),
    (" max_objects = 1e8 , max_int_bits=8192", "max_objects", 10 ** 8),
    ("max_inflated_nbytes=64k", "max_inflated_nbytes", 64 << 10),
])
def test_limits_are_raised_through_the_environment(monkeypatch, text, field, value):
    _with_limits(monkeypatch, text)
    assert getattr(limits.current(), field) == value
    assert limits.current().max_str_nbytes == ReadLimits().max_str_nbytes  # the others keep their defaults


@pytest.mark.parametrize("text", ["depth=5", "max_depth", "max_depth=lots", "max_depth=5Q"])
def test_a_setting_that_names_no_limit_is_a_usage_error(monkeypatch, text):
    _with_limits(monkeypatch, text)
    with pytest.raises(UsageError, match="DSCKPT_LIMITS: cannot use"):
        limits.current()


def _tree_error(monkeypatch, text: str, obj) -> str:
    _with_limits(monkeypatch, text)
    with pytest.raises(LimitExceededError) as e:
        parsed_tree.check_tree(obj, "f.pt")
    return str(e.value)


def test_each_tree_budget_is_named_with_how_to_raise_it(monkeypatch):
    nested: list = []
    for _ in range(10):
        nested = [nested]
    assert "max_depth=5; " in _tree_error(monkeypatch, "max_depth=5", nested)
    assert "DSCKPT_LIMITS=max_depth=20" in _tree_error(monkeypatch, "max_depth=5", nested)
    assert "max_objects=50" in _tree_error(monkeypatch, "max_objects=50", list(range(100)))
    assert "max_int_bits=64" in _tree_error(monkeypatch, "max_int_bits=64", {"step": 1 << 64})
    assert "max_str_nbytes=10" in _tree_error(monkeypatch, "max_str_nbytes=10", {"name": "x" * 11})
    assert "max_references=1000" in _tree_error(monkeypatch, "max_references=1000", billion_laughs(levels=4))


def test_budgets_at_their_edge_pass(monkeypatch):
    # the deepest chain: the dict, then 11 lists (the innermost empty); 10^4 references to one string, plus their lists
    _with_limits(monkeypatch, "max_depth=12,max_int_bits=65,max_str_nbytes=11,max_references=20000")
    nested: list = []
    for _ in range(10):
        nested = [nested]
    parsed_tree.check_tree({"a": nested, "step": 1 << 64, "name": "x" * 11, "laughs": billion_laughs(levels=4)}, "f")


def test_shared_references_are_walked_once_and_listed_under_each_path():
    """A container the memo shares is visited once; its tensors still show under every path (tied weights)."""
    storage = tensor_ref.StorageRef(Path("f.pt"), "0", "float32", 4, 0, "cpu")
    t = tensor_ref.TensorRef(storage, 0, (4,), (1,))
    shared = {"w": t}
    found = parsed_tree.walk_tensors({"a": shared, "b": [shared, shared]})
    assert [p for p, _ in found] == [("a", "w"), ("b", 0, "w"), ("b", 1, "w")]
    laughs = billion_laughs(levels=9)  # 10^9 paths to one string: no tensor, walked in microseconds
    assert parsed_tree.walk_tensors(laughs) == []


def test_a_container_holding_itself_is_refused():
    loop: list = []
    loop.append(loop)
    with pytest.raises(CorruptCheckpointError, match="contains itself"):
        parsed_tree.check_tree({"x": loop}, "f.pt")


def test_bytearray_of_a_size_is_refused_before_allocating(tmp_path):
    """bytearray is allow-listed (protocol < 5 pickles one as bytearray(str, 'latin-1')); bytearray(int) would zero
    as many bytes as the pickle asks."""
    from dsckpt.safe_load import _ALLOWED

    make = _ALLOWED[("builtins", "bytearray")]
    assert make("ab", "latin-1") == bytearray(b"ab")
    with pytest.raises(pickle.UnpicklingError, match="bytearray built from int"):
        make(10 ** 12)


@pytest.mark.parametrize("kind", ["fifo", "folder", "dangling"])
def test_only_regular_files_are_opened(tmp_path, kind):
    p = tmp_path / "x.pt"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "folder":
        p.mkdir()
    else:
        p.symlink_to(tmp_path / "nowhere")
    with pytest.raises(CorruptCheckpointError, match={"fifo": "FIFO", "folder": "a folder",
                                                      "dangling": "dangling symlink"}[kind]):
        limits.open_regular(p)


def test_long_values_are_shortened_in_messages():
    assert shorten("x" * 20) == "x" * 20
    assert shorten("x" * 1000) == "x" * 60 + "... (1000 chars)"
    assert shorten("a\rb") == "a\\rb"
    line = shorten_runs("name " + "n" * 10_000 + " is bad")
    assert line.startswith("name nnn") and line.endswith("... (10000 chars) is bad") and len(line) < 500


@pytest.mark.parametrize("version, ok", [("0.19.8", True), ("0.10.3+git.12ab", True), ("1.0rc1", True),
                                         ("v1.2.post3.dev4", True), ("19", True), (19, False), ("", False),
                                         ("0.19.8; rm -rf", False), (None, False)])
def test_ds_version_must_parse_as_packaging_does(version, ok):
    from packaging.version import InvalidVersion, parse

    from dsckpt.verify import is_pep440

    try:
        parse(version)  # type: ignore[arg-type]
        parsed = True
    except (InvalidVersion, TypeError):
        parsed = False
    assert is_pep440(version) is ok is parsed


@pytest.mark.parametrize("swap", ["fifo", "other-file"])
def test_a_file_swapped_after_it_was_parsed_is_not_read(tmp_path, swap):
    """Tensor reads open the file again: fstat of that descriptor must show the regular file that was parsed (same
    device and inode). A FIFO swapped in does not block; another file (a copy) is not read as this one."""
    import shutil
    import time

    from conftest import FIXTURES

    from dsckpt import safe_load

    src = FIXTURES / "s2_bf16_w2_2groups" / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt"
    path = tmp_path / src.name
    shutil.copyfile(src, path)
    _, ref = parsed_tree.walk_tensors(safe_load.load(path))[0]
    ref.read_numpy()  # the file that was parsed: read
    path.rename(tmp_path / "moved.pt")
    if swap == "fifo":
        os.mkfifo(path)
    else:
        shutil.copyfile(tmp_path / "moved.pt", path)
    start = time.monotonic()
    with pytest.raises(CorruptCheckpointError, match="a FIFO" if swap == "fifo" else "another file than the one parsed"):
        ref.read_numpy()
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("fixture, name", [
    ("s2_bf16_w2_2groups", "mp_rank_00_model_states.pt"),
    ("s2_bf16_w2_2groups", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("s3_fp32_w2", "zero_pp_rank_0_mp_rank_00_model_states.pt"),
    ("hf_llama_z2_bf16_w2", "mp_rank_00_model_states.pt"),
])
def test_the_pre_scan_estimate_is_above_what_parsing_takes(fixture, name):
    """max_parsed_nbytes bounds memory only if the opcode estimate is never below what the unpickler builds."""
    import tracemalloc
    import zipfile

    from conftest import FIXTURES

    from dsckpt import safe_load
    from dsckpt.pickle_scan import prescan

    path = FIXTURES / fixture / "ckpt" / "global_step3" / name
    with zipfile.ZipFile(path) as zf:
        data = zf.read(next(n for n in zf.namelist() if n.endswith("data.pkl")))
    estimate, stopped = prescan(data, path)
    assert stopped
    safe_load.load(path)  # imports and caches warm
    tracemalloc.start()
    try:
        tree = safe_load.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert tree and peak <= estimate <= 3 * peak


def test_the_pre_scan_refuses_before_parsing(monkeypatch):
    from dsckpt.pickle_scan import prescan

    _with_limits(monkeypatch, "max_parsed_nbytes=1MiB")
    with pytest.raises(LimitExceededError, match="max_parsed_nbytes=1048576"):
        prescan(b"\x80\x02](" + b"]" * 100_000 + b"e.", "f.pt")
    with pytest.raises(LimitExceededError, match="memo index of 2147483647"):
        prescan(b"\x80\x02]r\xff\xff\xff\x7f.", "f.pt")
    assert prescan(b"\x80\x02](" + b"]" * 1000 + b"e.", "f.pt")[1]  # within the budget
