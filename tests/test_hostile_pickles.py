"""Code-running pickles, placed where DeepSpeed files live (model states, optimizer, pipeline layer),
as a repair ``--from`` source and as a scan target, in the zip and the legacy format: every command
refuses (exit 3, one line) and a marker file proves nothing ran."""

from __future__ import annotations

import io
import pickle
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from commands import COMMANDS
from conftest import FIXTURES

from dsckpt.cli import main


def _g(mod: str, name: str) -> bytes:
    return b"c" + mod.encode() + b"\n" + name.encode() + b"\n"


def _s(x: str) -> bytes:
    raw = x.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _call(fn: bytes, *args: bytes) -> bytes:
    return fn + b"(" + b"".join(args) + b"tR"


def payloads(marker: Path) -> dict[str, bytes]:
    """Opcode-level pickles that each try to create ``marker``."""
    sh, py = f"touch {marker}", f"open({str(marker)!r}, 'w').close()"
    return {
        "os.system": _call(_g("os", "system"), _s(sh)),
        "posix.system": _call(_g("posix", "system"), _s(sh)),
        "builtins.eval": _call(_g("builtins", "eval"), _s(py)),
        "builtins.exec": _call(_g("builtins", "exec"), _s(py)),
        "__builtin__.eval": _call(_g("__builtin__", "eval"), _s(py)),
        "subprocess.check_call": _call(_g("subprocess", "check_call"), b"(" + _s("touch") + _s(str(marker)) + b"l"),
        "subprocess.Popen-NEWOBJ": _g("subprocess", "Popen") + b"((" + _s("touch") + _s(str(marker)) + b"ltt\x81",
        "getattr-chain": _call(_call(_g("builtins", "getattr"), _call(_g("builtins", "__import__"), _s("os")),
                                     _s("system")), _s(sh)),
        "getattr-on-allowed": _call(_call(_g("builtins", "getattr"), _g("collections", "OrderedDict"),
                                          _s("__class__")), _s("x")),
        "INST": b"(" + _s(sh) + b"ios\nsystem\n",
        "OBJ": b"(" + _g("os", "system") + _s(sh) + b"o",
        "BUILD-on-storage-marker": _g("torch", "FloatStorage") + b"}" + _s("dtype") + _s("int8") + b"sb",
        "BUILD-on-allowed-function": _g("torch._utils", "_rebuild_tensor_v2") + b"N}" + _s("__defaults__")
        + b")s\x86b",
        "setstate-dunder-on-stand-in": _call(_g("copyreg", "_reconstructor"),
                                             _g("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                                             _g("builtins", "object"), b"N") + b"}" + _s("__reduce_ex__")
        + _g("torch", "Size") + b"sb",
        # Lightning's AttributeDict is allow-listed as a dict stand-in: no state may be set on it or on its class
        "BUILD-on-AttributeDict": _g("lightning.fabric.utilities.data", "AttributeDict") + b")\x81}"
        + _s("__class__") + _g("torch", "Size") + b"sb",
        "BUILD-on-AttributeDict-class": _g("lightning.fabric.utilities.data", "AttributeDict") + b"}"
        + _s("__getattr__") + _g("torch", "Size") + b"sb",
        "deepspeed-engine": _call(_g("deepspeed.runtime.engine", "DeepSpeedEngine")),
        "deepspeed-init": _call(_g("deepspeed", "init_distributed")),
        "deepspeed-lookalike": _call(_g("deepspeed.runtime.fp16.loss_scaler", "os")),
    }


def _pickle(payload: bytes) -> bytes:
    """``{"module": <payload>, "optimizer": None}`` as a protocol-2 pickle."""
    return b"\x80\x02}(" + _s("module") + payload + _s("optimizer") + b"Nu."


def _as_zip(template: Path, pkl: bytes, dst: Path) -> None:
    with zipfile.ZipFile(template) as zf:
        entries = [(i, b"" if i.filename.endswith("data.pkl") else zf.read(i)) for i in zf.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as out:
        for info, data in entries:
            out.writestr(info, pkl if info.filename.endswith("data.pkl") else data)
    dst.write_bytes(buf.getvalue())


def _as_legacy(pkl: bytes, dst: Path) -> None:
    head = (pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2) + pickle.dumps(1001, protocol=2)
            + pickle.dumps({"protocol_version": 1001, "little_endian": True, "type_sizes": {}}, protocol=2))
    dst.write_bytes(head + pkl + pickle.dumps([], protocol=2))


def _plant(fmt: str, payload: bytes, dst: Path) -> None:
    template = FIXTURES / "s2_bf16_w2_2groups" / "ckpt" / "global_step3" / "mp_rank_00_model_states.pt"
    if fmt == "zip":
        _as_zip(template, _pickle(payload), dst)
    else:
        _as_legacy(_pickle(payload), dst)


PLACEMENTS = {  # fixture, file inside its tag folder
    "model-states": ("s2_bf16_w2_2groups", "mp_rank_00_model_states.pt"),
    "optimizer": ("s2_bf16_w2_2groups", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    "pipeline-layer": ("pp2_fp32", "layer_01-model_states.pt"),
}
NAMES = list(payloads(Path("/m")))


@pytest.mark.parametrize("fmt", ["zip", "legacy"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("place", [*PLACEMENTS, "repair-source", "scan-target"])
def test_hostile_pickle_is_refused_by_every_command_and_never_runs(tmp_path, place, name, fmt):
    marker = tmp_path / "PWNED"
    payload = payloads(marker)[name]
    runs: list[tuple[str, list[str]]] = []
    if place in PLACEMENTS:
        fixture, victim = PLACEMENTS[place]
        fx = tmp_path / fixture
        shutil.copytree(FIXTURES / fixture, fx)
        _plant(fmt, payload, fx / "ckpt" / "global_step3" / victim)
        for cmd in COMMANDS:
            if "deepspeed" in cmd.accepts:
                out = tmp_path / f"out-{cmd.name}"
                out.mkdir()
                runs.append((cmd.name, cmd.argv(fx, fx / "ckpt", out)))
        expect = victim
    else:
        hostile = tmp_path / "hostile.pt"
        _plant(fmt, payload, hostile)
        expect = hostile.name
        if place == "scan-target":
            runs.append(("scan", ["scan", str(hostile)]))
        else:
            ckpt = FIXTURES / "s2_fp16_w1_bnoverflow" / "ckpt"
            runs.append(("repair", ["repair", str(ckpt), str(tmp_path / "fixed"), "--from", str(hostile)]))
    for cmd_name, argv in runs:
        res = CliRunner().invoke(main, argv)
        assert res.exit_code == 3, (cmd_name, res.output)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("dsckpt: error: "), (cmd_name, res.stderr)
        assert expect in lines[0], (cmd_name, lines[0])
        assert "refusing" in lines[0] or "cannot be parsed" in lines[0], (cmd_name, lines[0])
        assert not marker.exists(), f"{name} ran under {cmd_name}"
    assert not marker.exists()
    from dsckpt import safe_load

    assert safe_load._ALLOWED[("torch", "FloatStorage")].dtype == "float32"
