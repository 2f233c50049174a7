"""The hostile corpus (issue 29): damaged copies of real fixtures, one damage per case, in six families --
hangs, memory, internal errors, silent wrong answers, output tricks, messages -- and a harness that runs
dsckpt commands on them and checks what a user gets.

Every case is derived at test time from a committed DeepSpeed fixture (``tests/fixtures/<name>/ckpt``) copied
into a temporary folder: a file replaced by a FIFO or a renamed copy, a pickle re-saved with one value changed
(``torch.save`` through :mod:`dsckpt.safe_save`'s pickler, so the DeepSpeed classes in it need no deepspeed),
or opcodes spliced into a ``data.pkl`` where no Python object can express the damage (nesting 100,000 deep,
``bytearray(10**10)``). Nothing binary is committed.

``run_case`` gives a case to each of its commands -- in a subprocess under a wall-clock limit and an
address-space limit (``RLIMIT_AS``) where the damage aims at time or memory, in-process otherwise (a
subprocess adds only start-up time there) -- and checks: the exit code, exactly one ``dsckpt: error:`` line
(no traceback) naming the damaged file, the peak RSS of the subprocess (``wait4``), nothing written outside
OUT, the inputs unchanged (sha256 before and after), and for exit 0 that the output equals the export of the
undamaged fixture.

Run it directly for a table of cases and outcomes::

    PYTHONPATH=. python tests/hostile.py
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"

#: Limits of a subprocess run: the issue's 60 s, and far less memory than any payload asks for (dsckpt's own
#: commands map ~0.5 GB and touch ~45 MB on these fixtures; a 1 GiB payload would show).
WALL_S = 60
ADDRESS_SPACE = 2 << 30
PEAK_RSS = 256 << 20

ZERO2 = "s2_bf16_w2_2groups"  # zip, bf16 module copy + fp32 master partitions on 2 ranks
ZERO3 = "s3_fp32_w2"  # zip, ZeRO-3: no module copy, identical optimizer pickles on both ranks
LEGACY = "s2_fp32_w2_legacy"  # legacy non-zip format (no CRCs, no record names)
HF = "hf_llama_z2_bf16_w2"  # a Trainer checkpoint-N folder: model-side files are copied beside the weights
STEP = "global_step3"


# --------------------------------------------------------------------------------------------
# Editing real files


class _StandInUnpickler(pickle.Unpickler):
    """torch.load's unpickler base for our fixtures: DeepSpeed classes become dsckpt's stand-ins (which
    :mod:`dsckpt.safe_save` pickles back under DeepSpeed's paths); deepspeed is never imported."""

    def find_class(self, module: str, name: str) -> Any:
        from dsckpt.stand_ins import stand_in_class

        cls = stand_in_class(module, name)
        return cls if cls is not None else super().find_class(module, name)


def edit_torch_file(path: Path, edit: Callable[[Any], Any]) -> Path:
    """Re-save ``path`` (same format, same record names) after ``edit(tree)`` (which may return a new tree)."""
    import types

    import torch

    from dsckpt import safe_save

    legacy = not zipfile.is_zipfile(path)
    module = types.SimpleNamespace(Unpickler=_StandInUnpickler, load=pickle.load, __name__="hostile_pickle")
    tree = torch.load(path, map_location="cpu", weights_only=False, pickle_module=module)
    new = edit(tree)
    torch.save(tree if new is None else new, path, pickle_module=safe_save.pickle_module,
               _use_new_zipfile_serialization=not legacy)
    return path


def rewrite_zip(path: Path, *, data_pkl: bytes | None = None, compressed_pkl: tuple[bytes, int] | None = None) -> Path:
    """Write ``path`` again with the same records, its ``data.pkl`` replaced by ``data_pkl`` (stored), or by a
    raw deflate stream ``compressed_pkl[0]`` whose header declares ``compressed_pkl[1]`` inflated bytes."""
    with zipfile.ZipFile(path) as zf:
        entries = [(i.filename, zf.read(i)) for i in zf.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as out:
        for name, data in entries:
            if name.endswith("/data.pkl") and compressed_pkl is not None:
                continue
            out.writestr(zipfile.ZipInfo(name), data_pkl if name.endswith("/data.pkl") and data_pkl is not None
                         else data)
    raw = buf.getvalue()
    if compressed_pkl is not None:
        name = next(n for n, _ in entries if n.endswith("/data.pkl"))
        raw = _append_deflated(raw, name, *compressed_pkl)
    path.write_bytes(raw)
    return path


def _append_deflated(archive: bytes, name: str, stream: bytes, declared: int) -> bytes:
    """``archive`` with one more record ``name`` holding the raw deflate ``stream`` (declared size ``declared``,
    CRC 0: dsckpt must refuse it before any CRC could be computed), central directory rewritten."""
    with zipfile.ZipFile(io.BytesIO(archive)) as zf:
        infos = zf.infolist()
        cd_start = zf.start_dir  # type: ignore[attr-defined]
    body = archive[:cd_start]
    fname = name.encode()
    offset = len(body)
    local = struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0, 0, len(stream), min(declared, 0xFFFFFFFF),
                        len(fname), 0) + fname
    body += local + stream
    central = b""
    for info in infos:
        n = info.filename.encode()
        central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0, info.CRC, info.compress_size,
                               info.file_size, len(n), 0, 0, 0, 0, 0, info.header_offset) + n
    central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0, 0, len(stream),
                           min(declared, 0xFFFFFFFF), len(fname), 0, 0, 0, 0, 0, offset) + fname
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(infos) + 1, len(infos) + 1, len(central), len(body), 0)
    return body + central + end


def zeros_deflated(nbytes: int) -> bytes:
    """A raw deflate stream that inflates to ``nbytes`` zero bytes (a multiple of 16 MiB), ~1,000x smaller:
    one fully flushed 16 MiB block repeated (each repeat starts afresh), then an empty final block."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = c.compress(b"\0" * (16 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    return block * (nbytes // (16 << 20)) + b"\x03\x00"


def splice(path: Path, payload: bytes) -> Path:
    """Put the pickle opcodes ``payload`` (which push exactly one object) into ``path``'s ``data.pkl`` as the
    value of a new top-level client-state key ``"hostile"``: the file is re-saved with a marker string there,
    whose opcodes are then replaced."""
    marker = "HOSTILE-MARKER-0123456789"

    def add(tree: Any) -> None:
        tree["hostile"] = marker

    edit_torch_file(path, add)
    with zipfile.ZipFile(path) as zf:
        name = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
        pkl = zf.read(name)
    raw = marker.encode()
    opcode = b"X" + struct.pack("<I", len(raw)) + raw
    assert pkl.count(opcode) == 1, "the marker is pickled once, as BINUNICODE"
    return rewrite_zip(path, data_pkl=pkl.replace(opcode, payload))


def deep_lists(depth: int) -> bytes:
    """Opcodes for ``[[[...]]]`` ``depth`` deep: ``depth`` EMPTY_LISTs, each APPENDed into the one below."""
    return b"]" * depth + b"a" * (depth - 1)


def deep_dicts(depth: int) -> bytes:
    key = b"X\x01\x00\x00\x00k"
    return (b"}" + key) * depth + b"}" + b"s" * depth


def billion_laughs(levels: int = 9, width: int = 10) -> Any:
    """A list holding one list ``width`` times, ``levels`` deep: ``width**levels`` references, a few KB pickled."""
    x: Any = "lol"
    for _ in range(levels):
        x = [x] * width
    return x


# Memo indices of spliced payloads: above any the fixtures' pickles use (< 1,000), low enough that the unpickler's
# memo table (an array up to twice the highest index) stays small.
_MEMO = 10_000


def _get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)  # LONG_BINGET


def _put(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)  # LONG_BINPUT


def shared_chain(widths: tuple[int, ...], kind: str = "list") -> bytes:
    """Opcodes for a container holding ``widths[0]`` references to one container holding ``widths[1]`` references
    to ... one ``[1.0]``: ``prod(widths)`` paths, a few bytes per reference pickled. ``kind``: list, tuple or dict
    (int keys, the shared container each value)."""
    out = b"]G" + struct.pack(">d", 1.0) + b"a" + _put(_MEMO) + b"0"
    for level, width in enumerate(reversed(widths)):
        ref = _get(_MEMO + level)
        if kind == "list":
            body = b"](" + ref * width + b"e"
        elif kind == "tuple":
            body = b"(" + ref * width + b"t"
        else:
            body = b"}(" + b"".join(b"J" + struct.pack("<i", k) + ref for k in range(width)) + b"u"
        out += body + (_put(_MEMO + level + 1) + b"0" if level < len(widths) - 1 else b"")
    return out


def shared_state_builds(objects: int, state_items: int) -> bytes:
    """Opcodes for a list of ``objects`` DeepSpeed ``LossScaler`` stand-ins, each given (BUILD) the one memoised
    state dict of ``state_items`` entries: each BUILD copies it, ``objects * state_items`` entries in all."""
    g, m = _get, _MEMO
    head = (b"ccopyreg\n_reconstructor\n" + _put(m) + b"0"
            + b"cdeepspeed.runtime.fp16.loss_scaler\nLossScaler\n" + _put(m + 1) + b"0"
            + b"cbuiltins\nobject\n" + _put(m + 2) + b"0"
            + b"}(" + b"".join(b"X" + struct.pack("<I", 8) + b"k%07d" % k + b"K\x01" for k in range(state_items))
            + b"u" + _put(m + 3) + b"0")
    one = g(m) + g(m + 1) + g(m + 2) + b"N\x87R" + g(m + 3) + b"b"
    return head + b"](" + one * objects + b"e"


def _stand_in_with(value: Any) -> Any:
    from dsckpt.stand_ins import stand_in_class

    cls = stand_in_class("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
    assert cls is not None
    obj = cls.__new__(cls)
    obj.__dict__.update(cur_scale=1.0, shared=value)
    return obj


def _tensor_attribute(value: Any) -> Callable[[Any], None]:
    """The first module tensor given a Python attribute holding ``value`` (torch pickles a tensor's ``__dict__``)."""
    def edit(tree: Any) -> None:
        name = next(iter(tree["module"]))
        tree["module"][name].hostile = value

    return edit


def _legitimately_shared(tree: Any) -> None:
    """Client state that shares for real: one dict and one tensor referenced from many places (the pickler's memo),
    a list of 2,000 references to one list of 1,000 floats (2 million paths, within every budget)."""
    import torch

    cfg = {"lr": 0.1, "betas": [0.9, 0.99]}
    t = torch.arange(6.0)
    tree["shared_cfg"] = [cfg] * 1000
    tree["shared_tensor"] = {"a": t, "b": [t] * 1000}
    tree["shared_floats"] = [[0.5] * 1000] * 2000


def _tag(ckpt: Path) -> Path:
    return ckpt / STEP


def _optim(ckpt: Path, rank: int, fixture: str) -> Path:
    prefix = "bf16_" if fixture == ZERO2 else ""
    return _tag(ckpt) / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _model_states(ckpt: Path, fixture: str) -> Path:
    if fixture == ZERO3:
        return _tag(ckpt) / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    return _tag(ckpt) / "mp_rank_00_model_states.pt"


# --------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Run:
    """One command given to a case: argv after ``dsckpt`` (``{ckpt}``, ``{out}`` filled in), what it must
    end with, and the phrases its error line must hold."""

    argv: tuple[str, ...]
    code: int
    phrases: tuple[str, ...] = ()
    #: for exit 0: the output that must equal the undamaged fixture's export (relative to the case folder)
    same_as_clean: bool = False


@dataclass(frozen=True)
class Case:
    id: str
    family: str  # hang, memory, internal, silent, output, message
    fixture: str
    damage: str  # what was done, in words (the docs' table)
    build: Callable[[Path], Path] = field(compare=False)  # (copy of the fixture's ckpt) -> the damaged file
    runs: tuple[Run, ...] = ()
    #: run in a subprocess under WALL_S / ADDRESS_SPACE (the damage aims at time or memory)
    limited: bool = False
    env: tuple[tuple[str, str], ...] = ()
    #: build the damaged copy once and give it to every run (each its own OUT): the crafted file is large, or the
    #: runs many
    once: bool = False


TO_FP32 = ("to-fp32", "-q", "{ckpt}", "{out}/model.safetensors")
RESHARD = ("reshard", "-q", "-n", "1", "{ckpt}", "{out}/resharded")
VERIFY = ("verify", "{ckpt}")
INFO = ("info", "{ckpt}")
DIFF = ("diff", "{ckpt}", "{ckpt}")
SCAN = ("scan", "-q", "{ckpt}")
REPAIR = ("repair", "-q", "--whole-tensor", "--from", "master", "{ckpt}", "{out}/repaired")


def _refused(*argvs: tuple[str, ...], phrases: tuple[str, ...]) -> tuple[Run, ...]:
    return tuple(Run(a, 3, phrases) for a in argvs)


def _fifo(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


def _replace_with(path: Path, text: bytes) -> Path:
    path.write_bytes(text)
    return path


def _dev_zero_tokenizer(ckpt: Path) -> Path:
    victim = ckpt / "tokenizer.json"
    victim.unlink()
    victim.symlink_to("/dev/zero")
    return victim


def _set(key: str, value: Any) -> Callable[[Any], None]:
    def edit(tree: Any) -> None:
        tree[key] = value

    return edit


def _edit_param_shapes(fn: Callable[[Any], Any]) -> Callable[[Any], None]:
    def edit(tree: Any) -> None:
        tree["param_shapes"][0] = fn(tree["param_shapes"][0])

    return edit


def _first_renamed(new_key: Any) -> Callable[[Any], Any]:
    def rename(group: Any) -> Any:
        items = list(group.items())
        return type(group)([(new_key, items[0][1]), *items[1:]])

    return rename


def _first_shape(shape: Any) -> Callable[[Any], Any]:
    def reshape(group: Any) -> Any:
        items = list(group.items())
        return type(group)([(items[0][0], shape), *items[1:]])

    return reshape


def _scale_masters(tree: Any) -> None:
    """A same-step save that trained on (other data): every fp32 master of this rank changed, facts the same."""
    for t in tree["optimizer_state_dict"]["single_partition_of_fp32_groups"]:
        t.data.mul_(1.5).add_(0.25)


def _central_directory_before_start(path: Path) -> Path:
    """The zip directory's offset moved 1 MiB past where it is (in the zip64 end record torch writes, or the plain
    one): zipfile shifts every record's offset by the difference, to before the start of the file."""
    data = bytearray(path.read_bytes())
    at = data.rfind(b"PK\x06\x06")
    if at >= 0:
        (offset,) = struct.unpack_from("<Q", data, at + 48)
        struct.pack_into("<Q", data, at + 48, offset + (1 << 20))
    else:
        end = data.rindex(b"PK\x05\x06")
        (offset,) = struct.unpack_from("<I", data, end + 16)
        struct.pack_into("<I", data, end + 16, offset + (1 << 20))
    path.write_bytes(bytes(data))
    return path


def _ds_version_everywhere(value: Any) -> Callable[[Path], Path]:
    def build(ckpt: Path) -> Path:
        def edit(tree: Any) -> None:
            for holder in (tree, tree.get("optimizer_state_dict")):
                if isinstance(holder, dict) and "ds_version" in holder:
                    holder["ds_version"] = value

        for f in sorted(_tag(ckpt).glob("*.pt")):
            edit_torch_file(f, edit)
        return _model_states(ckpt, ZERO2)

    return build


def _in_every_file(edit: Callable[[Any], Any]) -> Callable[[Path], Path]:
    def build(ckpt: Path) -> Path:
        for f in sorted(_tag(ckpt).glob("*.pt")):
            edit_torch_file(f, edit)
        return _model_states(ckpt, ZERO2)

    return build


def _ds_version_in_optimizer_state(value: Any) -> Callable[[Path], Path]:
    def build(ckpt: Path) -> Path:
        def edit(tree: Any) -> None:
            tree["optimizer_state_dict"]["ds_version"] = value

        return edit_torch_file(_optim(ckpt, 0, ZERO3), edit)

    return build


def _dcp_folder(c: Path) -> Path:
    """A real DCP folder written by ``torch.distributed.checkpoint`` (one process) beside the copied checkpoint:
    ``{"model": ZeRO-3 fixture's params and buffers, "optim": {"state": {fc1.weight: exp_avg}}}``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    truth = load_file(str(FIXTURES / ZERO3 / "truth.safetensors"))
    model = {k.split("/", 1)[1]: t for k, t in truth.items() if k.split("/", 1)[0] in ("param", "buffer")}
    state = {"fc1.weight": {"exp_avg": truth["exp_avg/fc1.weight"], "step": torch.tensor(3.0)}}
    dcp.save({"model": model, "optim": {"state": state}}, storage_writer=dcp.FileSystemWriter(c / "dcp"),
             no_dist=True)
    return c / "dcp"


def _edit_dcp_metadata(edit: Callable[[Any, Path], Path | None]) -> Callable[[Path], Path]:
    """Write the DCP folder, then change its ``.metadata`` (the test's own pickle: trusted) with ``edit(md,
    folder)``; the damaged file is what ``edit`` returns, else ``.metadata``."""
    def build(c: Path) -> Path:
        folder = _dcp_folder(c)
        md_path = folder / ".metadata"
        md = pickle.loads(md_path.read_bytes())  # the test's own file, written a line above by torch
        victim = edit(md, folder)
        md_path.write_bytes(pickle.dumps(md))
        return victim or md_path
    return build


def _storage_of(md: Any, fqn: str) -> Any:
    return next(info for idx, info in md.storage_data.items() if idx.fqn == fqn)


def _offset_past_end(md: Any, folder: Path) -> None:
    info = _storage_of(md, "model.fc1.weight")
    info.offset = (folder / info.relative_path).stat().st_size + 100


def _size_lie(md: Any, folder: Path) -> None:
    import torch

    md.state_dict_metadata["model.fc1.weight"].size = torch.Size([7, 7])


def _length_overlap(md: Any, folder: Path) -> None:
    _storage_of(md, "model.fc1.weight").length += 64


def _swapped_items(md: Any, folder: Path) -> Path:
    a, b = _storage_of(md, "model.fc1.weight"), _storage_of(md, "model.embed.weight")
    a.offset, a.length, b.offset, b.length = b.offset, b.length, a.offset, a.length
    return folder / a.relative_path


def _forbidden_global_metadata(c: Path) -> Path:
    folder = _dcp_folder(c)
    (folder / ".metadata").write_bytes(b"cos\nsystem\n(S'echo owned'\ntR.")
    return folder / ".metadata"


def _truncated_distcp(c: Path) -> Path:
    folder = _dcp_folder(c)
    victim = next(folder.glob("*.distcp"))
    os.truncate(victim, victim.stat().st_size // 2)
    return folder / ".metadata"  # the .metadata now points past the end of the file: it is what is named


DCP_INFO = ("info", "{ckpt}/dcp")
DCP_SCAN = ("scan", "-q", "{ckpt}/dcp")
DCP_VERIFY = ("verify", "{ckpt}/dcp")
DCP_DIFF = ("diff", "{ckpt}", "{ckpt}/dcp")
DCP_TO_FP32 = ("to-fp32", "-q", "{ckpt}/dcp", "{out}/model.safetensors")


def cases() -> list[Case]:
    """The corpus: one damage per case."""
    out: list[Case] = []

    def add(id: str, family: str, fixture: str, damage: str, build: Callable[[Path], Path],
            runs: tuple[Run, ...], **kw: Any) -> None:
        out.append(Case(id, family, fixture, damage, build, runs, **kw))

    # ---- hangs
    add("fifo-rank-file", "hang", ZERO2, "a FIFO (named pipe) in place of rank 1's optimizer file",
        lambda c: _fifo(_optim(c, 1, ZERO2)), _refused(TO_FP32, INFO, phrases=("FIFO", "not a regular file")),
        limited=True)
    add("fifo-latest", "hang", ZERO2, "a FIFO in place of 'latest'", lambda c: _fifo(c / "latest"),
        _refused(INFO, phrases=("FIFO",)), limited=True)
    add("billion-laughs", "hang", ZERO2, "client state holding a list that holds one list 10 times, 9 levels deep "
        "(10^9 references, 2 KB pickled)",
        lambda c: edit_torch_file(_model_states(c, ZERO2), _set("laughs", billion_laughs())),
        _refused(TO_FP32, INFO, phrases=("max_references", "DSCKPT_LIMITS")), limited=True)
    add("device-as-tokenizer", "hang", HF, "tokenizer.json of a Trainer folder a symlink to /dev/zero (copied "
        "with the weights)", _dev_zero_tokenizer,
        _refused(("to-fp32", "-q", "{ckpt}", "{out}/hf"), RESHARD, phrases=("character device", "tokenizer.json")), limited=True)
    # ---- memory
    add("deflated-pickle-bomb", "memory", ZERO2, "data.pkl deflated, inflating to 1 GiB, the zip header "
        "declaring 1 GiB", lambda c: rewrite_zip(_model_states(c, ZERO2), compressed_pkl=(zeros_deflated(1 << 30),
                                                                                          1 << 30)),
        _refused(TO_FP32, phrases=("compressed", "max_inflated_nbytes")), limited=True)
    add("deflated-pickle-bomb-lying", "memory", ZERO2, "data.pkl deflated, inflating to 1 GiB, the zip header "
        "declaring 900 bytes", lambda c: rewrite_zip(_model_states(c, ZERO2), compressed_pkl=(zeros_deflated(1 << 30),
                                                                                             900)),
        _refused(TO_FP32, phrases=("CRC32",)), limited=True)  # inflated only as far as the header says
    add("bytearray-bomb", "memory", ZERO2, "client state calling bytearray(10**10) (REDUCE on an allow-listed "
        "global)", lambda c: splice(_model_states(c, ZERO2), b"cbuiltins\nbytearray\n\x8a\x05\x00\xe4\x0bT\x02\x85R"),
        _refused(INFO, phrases=("bytearray built from int",)), limited=True)
    # ---- internal errors (exit 70 before)
    add("deep-lists", "internal", ZERO2, "client state: lists nested 100,000 deep",
        lambda c: splice(_model_states(c, ZERO2), deep_lists(100_000)),
        _refused(TO_FP32, INFO, phrases=("max_depth",)), limited=True)
    add("deep-dicts", "internal", ZERO2, "client state: dicts nested 100,000 deep",
        lambda c: splice(_model_states(c, ZERO2), deep_dicts(100_000)),
        _refused(("info", "--json", "{ckpt}"), phrases=("max_depth",)))
    add("huge-int", "internal", ZERO2, "a 30,000-digit integer in a counter (global_samples)",
        lambda c: edit_torch_file(_model_states(c, ZERO2), _set("global_samples", 10 ** 30000)),
        _refused(("info", "--json", "{ckpt}"), TO_FP32, phrases=("max_int_bits",)))
    add("int-key-in-param-shapes", "internal", ZERO2, "a non-string key in param_shapes",
        lambda c: edit_torch_file(_model_states(c, ZERO2), _edit_param_shapes(_first_renamed(7))),
        _refused(TO_FP32, ("info", "--json", "{ckpt}"), RESHARD, DIFF, phrases=("param_shapes", "not by a name")))
    add("negative-shape", "internal", ZERO3, "a negative dimension in param_shapes (reshard's 'overlapping copy "
        "ranges' before)", lambda c: edit_torch_file(_model_states(c, ZERO3), _edit_param_shapes(_first_shape([-3, 22]))),
        _refused(RESHARD, TO_FP32, phrases=("param_shapes", "[-3, 22]")))
    add("shape-not-a-shape", "internal", ZERO2, "a string where a shape belongs in param_shapes",
        lambda c: edit_torch_file(_model_states(c, ZERO2), _edit_param_shapes(_first_shape("11x6"))),
        _refused(TO_FP32, RESHARD, phrases=("not a shape",)))
    # ---- silent wrong answers (exit 0 before)
    add("zero-size-shape", "silent", ZERO2, "a zero-size shape in param_shapes, the module copy full size",
        lambda c: edit_torch_file(_model_states(c, ZERO2), _edit_param_shapes(_first_shape([0]))),
        _refused(TO_FP32, RESHARD, VERIFY, phrases=("module copy", "[0]")))
    add("renamed-copy-zero2", "silent", ZERO2, "rank 1's optimizer file replaced by a renamed copy of rank 0's",
        lambda c: shutil.copyfile(_optim(c, 0, ZERO2), _optim(c, 1, ZERO2)) and _optim(c, 1, ZERO2),
        _refused(TO_FP32, RESHARD, VERIFY, phrases=("renamed copy of bf16_zero_pp_rank_0",)))
    add("renamed-copy-zero3", "silent", ZERO3, "rank 1's optimizer file replaced by a renamed copy of rank 0's "
        "(verify said 'files from one save')",
        lambda c: shutil.copyfile(_optim(c, 0, ZERO3), _optim(c, 1, ZERO3)) and _optim(c, 1, ZERO3),
        _refused(TO_FP32, RESHARD, VERIFY, phrases=("renamed copy of zero_pp_rank_0",)))
    add("copy-legacy", "silent", LEGACY, "rank 1's optimizer file replaced by a copy of rank 0's (legacy format: "
        "no record names)", lambda c: shutil.copyfile(_optim(c, 0, LEGACY), _optim(c, 1, LEGACY)) and _optim(c, 1, LEGACY),
        _refused(TO_FP32, RESHARD, phrases=("byte-identical",)))
    add("same-step-other-save", "silent", ZERO2, "rank 1's optimizer file from another save of the same step "
        "(same config, version, counters; other master values)",
        lambda c: edit_torch_file(_optim(c, 1, ZERO2), _scale_masters),
        _refused(TO_FP32, RESHARD, phrases=("disagree", "different saves")))
    # ---- output tricks
    add("force-onto-symlink-to-folder", "output", ZERO2, "reshard --force onto an OUT that is a symlink to a folder "
        "elsewhere", lambda c: c, (Run(("reshard", "-q", "--force", "-n", "1", "{ckpt}", "{out}/link"), 0),))
    add("force-onto-symlink-to-file", "output", ZERO2, "to-fp32 --force onto an OUT that is a symlink to a file "
        "elsewhere", lambda c: c, (Run(("to-fp32", "-q", "--force", "{ckpt}", "{out}/model.safetensors"), 0,
                                       same_as_clean=True),))
    add("reshard-onto-dangling-symlink", "output", ZERO2, "reshard onto an OUT that is a dangling symlink, without "
        "--force", lambda c: c, (Run(("reshard", "-q", "-n", "1", "{ckpt}", "{out}/dangling"), 2,
                                     ("dangling", "already exists")),))
    add("reshard-force-onto-dangling-symlink", "output", ZERO2, "reshard --force onto an OUT that is a dangling "
        "symlink", lambda c: c, (Run(("reshard", "-q", "--force", "-n", "1", "{ckpt}", "{out}/dangling"), 0),))
    # ---- messages
    add("zip-directory-outside-file", "message", ZERO2, "a zip whose central directory points outside the file",
        lambda c: _central_directory_before_start(_model_states(c, ZERO2)),
        _refused(INFO, TO_FP32, phrases=("mp_rank_00_model_states.pt", "outside the file")))
    add("huge-latest", "message", ZERO2, "a 10 MB 'latest' file",
        lambda c: _replace_with(c / "latest", b"global_step3" + b"x" * 10_000_000),
        _refused(INFO, phrases=("does not hold a tag folder name", "chars)")))
    add("ds-version-not-a-string", "message", ZERO2, "ds_version an int (19) in every file, as DeepSpeed's loader "
        "cannot parse", _ds_version_everywhere(19), (Run(VERIFY, 1, ("not a version DeepSpeed can parse",)),
                                                   Run(TO_FP32, 0, same_as_clean=True),
                                                   *_refused(RESHARD, REPAIR, phrases=(
                                                       "ds_version = 19 (int)", "not a version DeepSpeed can parse",
                                                       "nothing was written"))))
    add("ds-version-in-optimizer-state", "message", ZERO3, "the optimizer state's own ds_version '0.19.8; rm -rf' in "
        "rank 0's file (the top-level one intact)", _ds_version_in_optimizer_state("0.19.8; rm -rf"),
        (Run(VERIFY, 1, ("optimizer_state_dict.ds_version",)),
         *_refused(("reshard", "-q", "-n", "4", "{ckpt}", "{out}/resharded"), REPAIR,
                   phrases=("optimizer_state_dict.ds_version", "not a version DeepSpeed can parse"))))
    add("long-name", "message", ZERO2, "a 1 MB param name in param_shapes",
        lambda c: edit_torch_file(_model_states(c, ZERO2), _edit_param_shapes(_first_renamed("n" * 1_000_000))),
        _refused(TO_FP32, phrases=("chars)",)))
    # ---- shared references (issue 34): each container once, constant work per further reference to it
    every = (INFO, VERIFY, SCAN, TO_FP32, RESHARD)
    ms = _model_states
    add("shared-lists-3x1e6", "hang", ZERO2, "client state: a list of 10^6 references to one list of 10^6 references "
        "to one list of 10^6 references to [1.0] (10^18 paths, 15 MB pickled)",
        lambda c: splice(ms(c, ZERO2), shared_chain((10 ** 6, 10 ** 6, 10 ** 6))),
        _refused(*every, phrases=("max_references", "DSCKPT_LIMITS=max_references=")), limited=True, once=True)
    add("shared-dicts-2e7", "hang", ZERO2, "client state: a dict of 10^4 int keys, each value one dict of 10^3 int "
        "keys to one [1.0] (2x10^7 references)", lambda c: splice(ms(c, ZERO2), shared_chain((10 ** 4, 10 ** 3), "dict")),
        _refused(INFO, TO_FP32, phrases=("max_references",)), limited=True, once=True)
    add("shared-tuples-1e7x10", "hang", ZERO2, "client state: a tuple of 10^7 references to one tuple of 10 references "
        "to one [1.0]", lambda c: splice(ms(c, ZERO2), shared_chain((10 ** 7, 10), "tuple")),
        _refused(INFO, SCAN, phrases=("max_parsed_nbytes",)), limited=True, once=True)
    add("shared-in-stand-in", "hang", ZERO2, "client state: a DeepSpeed LossScaler (stand-in) whose attribute holds a "
        "list holding one list 10 times, 9 levels deep",
        lambda c: edit_torch_file(ms(c, ZERO2), _set("scaler", _stand_in_with(billion_laughs()))),
        _refused(INFO, RESHARD, phrases=("max_references",)), limited=True, once=True)
    add("shared-state-builds", "memory", ZERO2, "client state: 10^5 LossScaler stand-ins each given (BUILD) one "
        "state dict of 10^4 entries (10^9 entries copied)",
        lambda c: splice(ms(c, ZERO2), shared_state_builds(10 ** 5, 10 ** 4)),
        _refused(INFO, TO_FP32, phrases=("max_parsed_nbytes",)), limited=True, once=True)
    add("shared-in-tensor-attribute", "hang", ZERO2, "a module tensor with a Python attribute holding a list holding "
        "one list 10 times, 9 levels deep", lambda c: edit_torch_file(ms(c, ZERO2), _tensor_attribute(billion_laughs())),
        _refused(INFO, TO_FP32, phrases=("max_references",)), limited=True, once=True)
    # 2x10^4 references under a limit of 10^4 (the default's 10^6 needs a 10 MB pickle that takes a minute to write
    # through dsckpt's pure-Python pickler): the same walk, the same refusal
    add("one-tensor-2e4-times", "memory", ZERO2, "client state: a list of 2x10^4 references to one tensor, "
        "max_tensor_references=10000", lambda c: edit_torch_file(
            ms(c, ZERO2), lambda t: _set("tensors", [t["module"][next(iter(t["module"]))]] * 20_000)(t)),
        _refused(SCAN, TO_FP32, phrases=("max_tensor_references=10000",)), limited=True, once=True,
        env=(("DSCKPT_LIMITS", "max_tensor_references=10000"),))
    add("legitimately-shared", "hang", ZERO2, "client state sharing for real: a dict and a tensor referenced 1,000 "
        "times, a list of 2,000 references to one list of 1,000 floats",
        lambda c: edit_torch_file(ms(c, ZERO2), _legitimately_shared),
        (Run(INFO, 0), Run(VERIFY, 0), Run(SCAN, 0), Run(TO_FP32, 0, same_as_clean=True), Run(RESHARD, 0)),
        limited=True, once=True)
    add("shared-in-ds-config", "hang", ZERO2, "ds_config of every file holding a list of 2,000 references to one list "
        "of 1,000 floats (2 million paths, within every budget; compared across files)",
        _in_every_file(lambda t: t["ds_config"].__setitem__("hostile", [[0.5] * 1000] * 2000) if "ds_config" in t
                       else None), (Run(INFO, 0), Run(VERIFY, 0), Run(TO_FP32, 0, same_as_clean=True)), limited=True,
        once=True)
    # ---- what a pickle builds, bounded before it is built (the opcode pre-scan)
    add("empty-lists-flood", "memory", ZERO2, "client state: 4x10^6 empty lists (one opcode each: 4 MB pickled, "
        "~350 MB built)", lambda c: splice(ms(c, ZERO2), b"](" + b"]" * 4_000_000 + b"e"),
        _refused(INFO, phrases=("max_parsed_nbytes",)), limited=True)
    add("memo-index-bomb", "memory", ZERO2, "a LONG_BINPUT to memo index 2^31-1 (the unpickler's memo table: 32 GB)",
        lambda c: splice(ms(c, ZERO2), b"]" + _put(2 ** 31 - 1)),
        _refused(INFO, phrases=("memo index", "max_parsed_nbytes")), limited=True)
    add("set-of-shared-list", "memory", ZERO2, "client state: set() called 10^4 times on one list of 10^5 items "
        "(10^9 items copied)", lambda c: splice(ms(c, ZERO2), b"cbuiltins\nset\n" + _put(_MEMO) + b"0](" + b"K\x01" * 100_000
                                                   + b"e" + _put(_MEMO + 1) + b"0](" + (_get(_MEMO) + _get(_MEMO + 1)
                                                                                        + b"\x85R") * 10_000 + b"e"),
        _refused(INFO, phrases=("max_parsed_nbytes",)), limited=True)
    # ---- a PyTorch distributed checkpoint (DCP folder) as input (issue 33): .metadata is a pickle
    add("dcp-forbidden-global", "internal", ZERO3, "a DCP .metadata that pickles os.system",
        _forbidden_global_metadata, _refused(DCP_INFO, DCP_SCAN, DCP_TO_FP32, phrases=("os.system", "allow-list")))
    add("dcp-offset-past-end", "message", ZERO3, "a DCP .metadata placing a tensor past the end of its .distcp "
        "file", _edit_dcp_metadata(_offset_past_end),
        _refused(DCP_INFO, DCP_VERIFY, DCP_DIFF, DCP_TO_FP32, phrases=("model.fc1.weight", "__0_0.distcp")))
    add("dcp-truncated-distcp", "message", ZERO3, "a DCP folder whose .distcp file lost its second half",
        _truncated_distcp, _refused(DCP_INFO, DCP_SCAN, phrases=(".distcp", "bytes")))
    add("dcp-size-lie", "silent", ZERO3, "a DCP .metadata giving a tensor a size its chunks do not fill",
        _edit_dcp_metadata(_size_lie), _refused(DCP_INFO, DCP_TO_FP32, phrases=("model.fc1.weight", "[7, 7]")))
    add("dcp-overlapping-items", "silent", ZERO3, "a DCP .metadata whose byte ranges overlap",
        _edit_dcp_metadata(_length_overlap), _refused(DCP_SCAN, DCP_TO_FP32, phrases=("overlap",)))
    add("dcp-swapped-items", "silent", ZERO3, "a DCP .metadata pointing two tensors at each other's bytes",
        _edit_dcp_metadata(_swapped_items),
        _refused(DCP_VERIFY, DCP_DIFF, DCP_TO_FP32, phrases=("holds float32 [", "and .metadata says")))
    add("bad-limits-setting", "message", ZERO2, "DSCKPT_LIMITS naming no limit", lambda c: c,
        (Run(INFO, 2, ("DSCKPT_LIMITS", "max_depth")),), env=(("DSCKPT_LIMITS", "depth=5"),))
    return out


def setup_out(case: Case, root: Path) -> Path:
    """The OUT folder of a case (with what its output trick needs: a symlink to elsewhere, a dangling one)."""
    out = root / "out"
    out.mkdir()
    if case.id == "force-onto-symlink-to-folder":
        (root / "elsewhere").mkdir()
        (root / "elsewhere" / "keep.txt").write_text("keep")
        (out / "link").symlink_to(root / "elsewhere", target_is_directory=True)
    elif case.id == "force-onto-symlink-to-file":
        (root / "elsewhere.safetensors").write_text("keep")
        (out / "model.safetensors").symlink_to(root / "elsewhere.safetensors")
    elif "dangling" in case.id:
        (out / "dangling").symlink_to(root / "nowhere")
    return out


# --------------------------------------------------------------------------------------------
# Running


@dataclass(frozen=True)
class Result:
    code: int
    stdout: str
    stderr: str
    wall_s: float
    peak_rss: int | None  # bytes; None in-process


def _limits() -> None:  # preexec_fn: the child's address space
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def run_subprocess(argv: list[str], env: dict[str, str]) -> Result:
    """``python -m dsckpt argv`` under WALL_S and ADDRESS_SPACE, its peak RSS measured by GNU time (``%M``): Linux
    carries the RSS high-water mark across fork+exec, so ``wait4`` in this (large) process would report at least
    this process's RSS (bench/README.md). Killed with its process group past WALL_S."""
    with tempfile.TemporaryDirectory() as tmp:
        rss_file = Path(tmp) / "rss"
        timed = ["/usr/bin/time", "-f", "%M", "-o", str(rss_file)] if os.path.exists("/usr/bin/time") else []
        with open(Path(tmp) / "out", "w+b") as out, open(Path(tmp) / "err", "w+b") as err:
            start = time.monotonic()
            proc = subprocess.Popen([*timed, sys.executable, "-m", "dsckpt", *argv], stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL, env=env, preexec_fn=_limits,  # setrlimit only
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=WALL_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
            wall = time.monotonic() - start
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        peak = None
        if timed and rss_file.exists():
            last = rss_file.read_text().strip().splitlines()[-1:]  # after "Command exited with non-zero status N"
            peak = int(last[0]) * 1024 if last and last[0].isdigit() else None
        return Result(code, stdout, stderr, wall, peak)


def run_in_process(argv: list[str], env: dict[str, str]) -> Result:
    from click.testing import CliRunner

    from dsckpt.cli import main

    start = time.monotonic()
    res = CliRunner().invoke(main, argv, env=env, catch_exceptions=True)
    code = res.exit_code
    err = res.stderr
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        import traceback

        code, err = 99, err + "".join(traceback.format_exception(res.exception))
    return Result(code, res.stdout, err, time.monotonic() - start, None)


def snapshot(root: Path, skip: Path) -> dict[str, str]:
    """sha256 (or link target, or 'dir'/'fifo') of everything under ``root`` except ``skip``'s subtree."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        if d == skip or skip in d.parents:
            dirnames[:] = []
            continue
        for name in [*dirnames, *filenames]:
            p = d / name
            if p == skip:
                continue
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "special"
    return out


def _safetensors_equal(a: Path, b: Path) -> bool:
    from safetensors.numpy import load_file

    x, y = load_file(str(a)), load_file(str(b))
    return set(x) == set(y) and all(x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
                                    and x[k].tobytes() == y[k].tobytes() for k in x)


def check_run(case: Case, run: Run, res: Result, *, victim: Path, before: dict[str, str], after: dict[str, str],
              out: Path, clean_export: Path | None) -> list[str]:
    """Every way this run fails the issue's promises (empty: it keeps them)."""
    problems = []
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    if res.code != run.code:
        problems.append(f"exit {res.code}, expected {run.code}: {res.stderr[-1500:]}")
    if "Traceback" in res.stderr:
        problems.append("a traceback on stderr")
    if run.code in (2, 3):
        if len(lines) != 1 or not lines[0].startswith("dsckpt: error: "):
            problems.append(f"not exactly one error line: {lines[:3]!r}")
        elif len(lines[0]) > 2000:
            problems.append(f"an error line of {len(lines[0])} characters")
        else:
            missing = [p for p in run.phrases if p not in lines[0]]
            if missing:
                problems.append(f"error line lacks {missing}: {lines[0]}")
            if victim.is_file() and victim.name not in lines[0] and run.code == 3 and case.family != "output":
                problems.append(f"error line does not name {victim.name}: {lines[0]}")
    elif any(ln.startswith("dsckpt: error") for ln in lines):
        problems.append(f"exit {res.code} with an error line: {lines}")
    if case.limited:
        if res.wall_s > WALL_S:
            problems.append(f"ran {res.wall_s:.0f} s")
        if res.peak_rss is None and os.path.exists("/usr/bin/time"):
            problems.append("no peak RSS measured")
        elif res.peak_rss is not None and res.peak_rss > PEAK_RSS:
            problems.append(f"peak RSS {res.peak_rss >> 20} MiB > {PEAK_RSS >> 20} MiB")
    if before != after:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        problems.append(f"changed outside OUT (inputs included): {changed[:5]}")
    if res.code == 0 and run.same_as_clean:
        got = Path(run.argv[-1].replace("{out}", str(out)))
        if clean_export is None or not got.is_file() or not _safetensors_equal(got, clean_export):
            problems.append(f"output {got} differs from the undamaged export")
    return problems


def run_case(case: Case, work: Path, clean_exports: dict[str, Path]) -> list[str]:
    """Build ``case`` under ``work`` and give it to each of its commands; the problems found, prefixed."""
    found = []
    shared: tuple[Path, Path] | None = None
    for i, run in enumerate(case.runs):
        if case.once and shared is not None:
            root, victim = shared
            out = root / "out"
            shutil.rmtree(out)
            out.mkdir()
        else:
            root = work / f"{case.id}-{i}"
            root.mkdir(parents=True)
            shutil.copytree(FIXTURES / case.fixture / "ckpt", root / "ckpt", symlinks=True)
            victim = case.build(root / "ckpt")
            out = setup_out(case, root)
            shared = (root, victim)
        ckpt = root / "ckpt"
        argv = [a.replace("{ckpt}", str(ckpt)).replace("{out}", str(out)) for a in run.argv]
        env = {**os.environ, "PYTHONPATH": str(ROOT), **dict(case.env)}
        before = snapshot(root, out)
        res = (run_subprocess if case.limited else run_in_process)(argv, env if case.limited else dict(case.env))
        after = snapshot(root, out)
        if case.id.startswith("force-onto-symlink"):  # the link replaced, what it pointed to untouched (snapshot)
            target = out / ("link" if case.id.endswith("folder") else "model.safetensors")
            if target.is_symlink() or not target.exists():
                found.append(f"{case.id}: OUT is still a symlink, or missing")
            leftovers = sorted(p.name for p in out.iterdir() if p != target)
            if leftovers:
                found.append(f"{case.id}: left {leftovers} beside OUT")
        found += [f"{case.id} {' '.join(run.argv[:1])}: {p}" for p in
                  check_run(case, run, res, victim=victim, before=before, after=after, out=out,
                            clean_export=clean_exports.get(case.fixture))]
        if not case.once:
            shutil.rmtree(root, ignore_errors=True)
    if shared is not None:
        shutil.rmtree(shared[0], ignore_errors=True)
    return found


def clean_export(fixture: str, work: Path) -> Path:
    """``to-fp32`` of the undamaged fixture: what an exit-0 run on a damaged copy must equal."""
    dst = work / f"clean-{fixture}.safetensors"
    res = run_in_process(["to-fp32", "-q", str(FIXTURES / fixture / "ckpt"), str(dst)], {})
    assert res.code == 0, res.stderr
    return dst


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="dsckpt-hostile-"))
    try:
        exports = {f: clean_export(f, work) for f in {c.fixture for c in cases()}}
        for case in cases():
            start = time.monotonic()
            problems = run_case(case, work, exports)
            codes = ", ".join(f"{r.argv[0]}:{r.code}" for r in case.runs)
            print(f"{case.family:9} {case.id:36} {codes:40} {time.monotonic() - start:5.1f} s "
                  f"{'ok' if not problems else problems}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "tests"))
    main()
