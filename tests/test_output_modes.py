"""Issue 43: every file and folder a command publishes gets the modes the umask gives (``0666 & ~umask``,
``0777 & ~umask``; a file copied unchanged from the input: the input's mode ``& ~umask``, as ``cp``), set before
the rename, never inherited from an output ``--force`` replaces; temporaries are private while written.

Each command runs under umask 022 and 027 (in this process: ``dsckpt.atomic`` reads the umask from
``/proc/self/status`` each time, and a pytest worker runs one test at a time; one case runs the console script in a
child with ``sh -c 'umask 027; ...'`` and one the ``--distributed`` launch, each a process of its own). Input files
are given mode 0754, so that a copy (0754 / 0750) differs from a fresh file (0644 / 0640).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import FIXTURES

from dsckpt import atomic
from dsckpt.cli import main

ROOT = Path(__file__).resolve().parents[1]
INPUT_MODE = 0o754
UMASKS = [0o022, 0o027]
PEFT = FIXTURES / "peft" / "peft_llama_lora_z2_bf16_w2"
LIGHTNING = FIXTURES / "lightning_z2_fp32_w2" / "lightning_logs" / "version_0" / "checkpoints" / "epoch=0-step=3.ckpt"


@pytest.fixture(params=UMASKS, ids=["umask022", "umask027"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _input(src: Path, dest: Path) -> Path:
    """A copy of the input folder ``src`` at ``dest`` whose every file has :data:`INPUT_MODE`."""
    shutil.copytree(src, dest)
    for p in dest.rglob("*"):
        if p.is_file() and not p.is_symlink():
            p.chmod(INPUT_MODE)
    return dest


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.lstat().st_mode)


def _source_of(rel: str, out_file: Path, inputs: list[Path]) -> Path:
    """The input file that ``out_file`` copies: ``rel`` under one of ``inputs``, byte for byte."""
    for root in inputs:
        src = root / rel
        if src.is_file() and src.read_bytes() == out_file.read_bytes():
            return src
    raise AssertionError(f"{rel} is not a copy of {rel} in any of {inputs}")


def assert_published_modes(out: Path, mask: int, copies: Collection[str] = frozenset(),
                           inputs: Sequence[Path] = ()) -> None:
    """Every folder under (and at) ``out`` is ``0777 & ~mask``; every file ``0666 & ~mask``, but the files named in
    ``copies`` (relative to ``out``; each a copy of the file of that name under one of ``inputs``) the mode of
    their input ``& ~mask``. Nothing else is left beside ``out`` (no temporary, no lock file)."""
    assert out.exists(), out
    wrong = []
    paths = [out] + (sorted(out.rglob("*")) if out.is_dir() else [])
    assert set(copies) <= {str(p.relative_to(out)) for p in paths}, "a copy is missing"
    for p in paths:
        rel = str(p.relative_to(out)) if p != out else "."
        if p.is_dir():
            want = 0o777 & ~mask
        elif rel in copies:
            want = _mode(_source_of(rel, p, list(inputs))) & ~mask
        else:
            want = 0o666 & ~mask
        if _mode(p) != want:
            wrong.append(f"{rel}: {oct(_mode(p))}, want {oct(want)}")
    assert not wrong, wrong
    assert [q.name for q in out.parent.iterdir() if q.name.startswith(f".{out.name}.")] == []


def _ok(*argv: object) -> str:
    r = CliRunner().invoke(main, [str(a) for a in argv])
    assert r.exit_code == 0, r.output
    return r.stdout


# --------------------------------------------------------------------------------------------
# Every command, under two umasks. Each case: (argv builder given (input copy, out), input folder, out name,
# the relative names of the files expected to be copies of the input).

S2 = FIXTURES / "s2_bf16_w2_2groups" / "ckpt"
BN = FIXTURES / "s2_fp16_w1_bnoverflow" / "ckpt"  # a real fp16 overflow (repair's input)
HF = FIXTURES / "hf_llama_z2_bf16_w2" / "ckpt"
SCRIPTS = {"zero_to_fp32.py", "zero_to_torch.py"}
TOKENIZER = {"chat_template.jinja", "tokenizer.json", "tokenizer_config.json"}
REPAIR = None  # every file but the rewritten ones

Case = tuple[Callable[[Path, Path], list[object]], Path, str, set[str] | None]
CASES: dict[str, Case] = {
    "to-fp32-file": (lambda i, o: ["to-fp32", "-q", i, o], S2, "m.safetensors", set()),
    "to-fp32-shards": (lambda i, o: ["to-fp32", "-q", i, o, "--max-shard-size", "2KB"], S2, "shards", set()),
    "to-fp32-pt": (lambda i, o: ["to-fp32", "-q", i, o], S2, "m.pt", set()),
    "to-fp32-ckpt": (lambda i, o: ["to-fp32", "-q", i, o], LIGHTNING, "m.ckpt", set()),
    # config.json is rewritten (its dtype), the other model-side files copied
    "to-fp32-hf-folder": (lambda i, o: ["to-fp32", "-q", i, o], HF, "hf", TOKENIZER | {"generation_config.json"}),
    "to-fp32-peft-adapter": (lambda i, o: ["to-fp32", "-q", i, o], PEFT / "ckpt", "adapter",
                             TOKENIZER | {"adapter_config.json"}),
    "to-fp32-peft-merge": (lambda i, o: ["to-fp32", "-q", i, o, "--merge", "--base", PEFT / "base"], PEFT / "ckpt",
                           "merged", TOKENIZER | {"generation_config.json"}),
    "reshard": (lambda i, o: ["reshard", "-q", i, o, "-n", "1"], S2, "r1", SCRIPTS),
    "reshard-universal": (lambda i, o: ["reshard", "-q", "--universal", i, o], S2, "u", set()),
    "reshard-from-universal": (lambda i, o: ["reshard", "-q", i, o, "-n", "1"],
                               FIXTURES / "universal" / "s2_bf16_w2_2groups" / "ckpt", "fromu", set()),
    "to-dcp": (lambda i, o: ["to-dcp", "-q", i, o], S2, "dcp", set()),
    "to-dcp-trainer": (lambda i, o: ["to-dcp", "-q", i, o], HF, "trainer",
                       TOKENIZER | {"config.json", "generation_config.json", "model.safetensors", "rng_state_0.pth",
                                    "rng_state_1.pth", "trainer_state.json", "training_args.bin"}),
    "to-dcp-accelerate": (lambda i, o: ["to-dcp", "-q", i, o], FIXTURES / "accelerate_s2_bf16_w2" / "state", "acc",
                          {"custom_checkpoint_0.pkl", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"}),
    "repair": (lambda i, o: ["repair", "-q", i, o, "--policy", "reset-bn-stats"], BN, "fixed", REPAIR),
}


def _repair_copies(inp: Path, out: Path) -> set[str]:
    """The files repair copied: those it did not rewrite (the rewritten ones differ from the input)."""
    files = {str(p.relative_to(inp)) for p in inp.rglob("*") if p.is_file()}
    copies = {f for f in files if (out / f).read_bytes() == (inp / f).read_bytes()}
    assert SCRIPTS | {"latest"} <= copies < files  # something was rewritten, the rest copied
    return copies


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_every_published_file_and_folder_has_the_umask_modes(tmp_path: Path, umask: int, case: str) -> None:
    argv, src, name, copies = CASES[case]
    inp = _input(src, tmp_path / "in" / src.name)
    out = tmp_path / "out" / name
    _ok(*argv(inp, out))
    assert_published_modes(out, umask, _repair_copies(inp, out) if copies is None else copies, [inp, PEFT / "base"])


def test_repair_safetensors_file(tmp_path: Path, umask: int) -> None:
    fixed = tmp_path / "in.safetensors"
    _ok("to-fp32", "-q", BN, fixed)  # the real overflow, exported (inf in bn.running_var)
    fixed.chmod(INPUT_MODE)
    _ok("repair", "-q", fixed, tmp_path / "out.safetensors", "--policy", "reset-bn-stats")
    assert_published_modes(tmp_path / "out.safetensors", umask)


@pytest.mark.parametrize("safe", [False, True], ids=["bin", "safetensors"])
def test_drop_in_zero_to_fp32_files(tmp_path: Path, umask: int, safe: bool) -> None:
    """The drop-in ``zero_to_fp32`` writes files into OUTPUT_DIR (created if missing; a folder of the user's is
    kept as it is): the folder it creates and every file, with the index, get the umask modes."""
    from dsckpt.zero_to_fp32 import convert_zero_checkpoint_to_state_dict

    out = tmp_path / "new" / "out"
    convert_zero_checkpoint_to_state_dict(S2, out, max_shard_size=500, safe_serialization=safe)
    assert len(list(out.iterdir())) > 2  # shards and their index
    assert_published_modes(out, umask)
    assert _mode(out.parent) == 0o777 & ~umask


@pytest.mark.parametrize("case", ["to-fp32-file", "to-fp32-shards", "reshard", "to-dcp"])
def test_force_does_not_inherit_the_old_outputs_modes(tmp_path: Path, umask: int, case: str) -> None:
    argv, src, name, copies = CASES[case]
    out = tmp_path / name
    _ok(*argv(src, out))
    for p in [out, *out.rglob("*")] if out.is_dir() else [out]:  # an old output with other modes
        p.chmod(0o700 if p.is_dir() else 0o604)
    _ok(*argv(src, out), "--force")
    assert_published_modes(out, umask, copies or set(), [src])


def test_console_script_in_a_child_with_umask_027(tmp_path: Path) -> None:
    """The real process: ``sh -c 'umask 027; dsckpt ...'`` (the umask read from /proc at start-up and per file)."""
    dsckpt = Path(sys.executable).parent / "dsckpt"
    out = tmp_path / "r1"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(["sh", "-c", f"umask 027; exec '{dsckpt}' reshard -q '{S2}' '{out}' -n 1"], check=True, env=env,
                   timeout=300)
    assert_published_modes(out, 0o027, SCRIPTS, [S2])


def test_distributed_every_rank_writes_with_the_umask_modes(tmp_path: Path) -> None:
    """One ``torchrun`` launch of 2 ranks under umask 027: a single file both ranks write ranges of, a sharded folder,
    a reshard and a DCP folder whose files both ranks write, and a repair whose copies both ranks make."""
    import json

    from ds_launch import free_port

    s2_fp32 = FIXTURES / "s2_fp32_w4" / "ckpt"
    bn = _input(BN, tmp_path / "bn")
    out = tmp_path / "out"
    out.mkdir()
    jobs = [["to-fp32", "-q", str(s2_fp32), str(out / "m.safetensors")],
            ["to-fp32", "-q", str(s2_fp32), str(out / "shards"), "--max-shard-size", "1KB"],
            ["reshard", "-q", str(s2_fp32), str(out / "r3"), "-n", "3"],
            ["to-dcp", "-q", str(s2_fp32), str(out / "dcp")],
            ["repair", "-q", str(bn), str(out / "fixed"), "--policy", "reset-bn-stats"]]
    results = tmp_path / "results"
    results.mkdir()
    (results / "jobs.json").write_text(json.dumps([[*job, "--distributed"] for job in jobs]))
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--no-python", sys.executable, str(ROOT / "tests" / "dist_driver.py"), str(results / "jobs.json"),
           str(results)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DSCKPT_DIST_ALIGN_NBYTES": "64"}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, umask=0o027)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads((results / f"codes.{k}.json").read_text()) for k in range(2)] == [[0] * len(jobs)] * 2
    assert len(list((out / "shards").glob("*.safetensors"))) >= 2  # one per rank at least
    for name in ("m.safetensors", "shards", "dcp"):
        assert_published_modes(out / name, 0o027)
    assert_published_modes(out / "r3", 0o027, SCRIPTS, [s2_fp32])
    assert_published_modes(out / "fixed", 0o027, _repair_copies(bn, out / "fixed"), [bn])


# --------------------------------------------------------------------------------------------
# A second user reads (or not) what the modes say


def _can_read_as(uid: int, gid: int, path: Path) -> bool:
    r = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "cat", str(path)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    return r.returncode == 0


def _can_switch_user() -> bool:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    try:
        r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "true"],
                           capture_output=True, timeout=60)
    except OSError:
        return False
    return r.returncode == 0


@pytest.mark.skipif(not _can_switch_user(), reason="needs root and setpriv to read as a second user")
def test_a_second_user_in_the_group_reads_the_output(umask: int) -> None:
    """As another uid: in the output's group, the files are readable under 022 and 027; outside it, only under
    022. (pytest's tmp_path is private to root, so the output goes in a folder of its own in /tmp.)"""
    base = Path(tempfile.mkdtemp(prefix="dsckpt-modes-", dir="/tmp"))
    try:
        base.chmod(0o755)
        out = base / "r1"
        _ok("reshard", "-q", S2, out, "-n", "1")
        files = sorted(p for p in out.rglob("*") if p.is_file())
        assert any(f.parent != out for f in files)  # read through a published subfolder too
        group = out.stat().st_gid
        other_gid = 65534 if group != 65534 else 65533
        for f in files:
            assert _can_read_as(65534, group, f), f
            assert _can_read_as(65534, other_gid, f) == (umask == 0o022), f
    finally:
        shutil.rmtree(base)


# --------------------------------------------------------------------------------------------
# The atomic writers themselves


def test_atomic_file_temporary_is_private_until_complete_then_published_before_the_rename(
        tmp_path: Path, umask: int, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, int] = {}
    real_replace = os.replace

    def replace(src: str, dst: str) -> None:
        seen["at rename"] = _mode(Path(src))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    target = tmp_path / "x.bin"
    with atomic.atomic_file(target, check=lambda tmp: seen.setdefault("at check", _mode(tmp))) as f:
        seen["while written"] = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
        f.write(b"abc")
    assert seen == {"while written": 0o600, "at check": 0o600, "at rename": 0o666 & ~umask}
    assert _mode(target) == 0o666 & ~umask


def test_atomic_dir_is_private_while_written_and_published_before_the_rename(
        tmp_path: Path, umask: int, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, int] = {}
    real_replace = os.replace

    def replace(src: str, dst: str) -> None:
        if Path(dst) == tmp_path / "d":
            seen["at rename"] = _mode(Path(src))
        real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with atomic.atomic_dir(tmp_path / "d") as tmp:
        seen["while written"] = _mode(tmp)
        (tmp / "sub").mkdir()
        with atomic.atomic_file(tmp / "sub" / "f") as f:
            f.write(b"x")
    assert seen == {"while written": 0o700, "at rename": 0o777 & ~umask}
    assert_published_modes(tmp_path / "d", umask)


def test_copy_file_and_copy_tree_give_the_source_mode_minus_the_umask(tmp_path: Path, umask: int) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub").chmod(0o700)
    for name, mode in (("a", 0o777), ("b", 0o600), ("sub/c", 0o4755)):
        (src / name).write_bytes(name.encode())
        (src / name).chmod(mode)
    out = tmp_path / "out"
    out.mkdir()
    assert _mode(atomic.copy_file(src / "a", out / "a")) == 0o777 & ~umask
    assert _mode(atomic.copy_file(src / "b", out / "b", keep_times=False)) == 0o600
    atomic.copy_tree(src / "sub", out / "sub")
    assert (_mode(out / "sub"), _mode(out / "sub" / "c")) == (0o777 & ~umask, 0o755 & ~umask)  # no setuid


def test_umask_is_read_without_changing_it(umask: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # (umask before monkeypatch: os.umask is put back before the umask fixture restores the worker's umask)
    assert atomic.current_umask() == umask
    calls = []
    monkeypatch.setattr(atomic.os, "umask", lambda m: calls.append(m) or umask)
    assert atomic.current_umask() == umask and calls == []  # /proc/self/status: no set-and-restore
    monkeypatch.setattr(atomic, "_proc_umask", lambda: None)  # no /proc: the umask read once at import
    assert atomic.current_umask() == atomic._STARTUP_UMASK and calls == []
