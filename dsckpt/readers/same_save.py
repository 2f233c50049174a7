"""Are all files of a tag folder from one save? Facts every file of one save shares, compared.

DeepSpeed writes the same ``ds_config`` and ``ds_version`` into every model-states and optimizer file of
one save (0.19.8 engine.py:5017-5038, 5549-5564), the same global step, samples and world sizes into
every model-states file, and keeps the loss scaler, the optimizer's hyper-parameters and Adam's step
count identical on every rank. Files that disagree on any of these were mixed in from another run (or
another step of the same run). Reads a few one-element tensors (step counts); no other tensor data.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .. import limits
from ..stand_ins import DeepSpeedObject
from ..tensor_ref import TensorRef

__all__ = ["file_facts", "rank_identity_problems", "same_save_problems", "sampled_copy_disagreements"]


_MODEL_FACTS = ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size",
                "ds_version", "ds_config")
_OPTIM_FACTS = ("zero_stage", "partition_count", "loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad",
                "param_groups", "adam_step")


def _plain(value: Any, seen: set[int] | None = None) -> Any:
    """A comparable, JSON-able form of a parsed value (stand-ins by their state). A container the pickle shares
    between several places is rendered once; a further reference to it (looked up first, constant work) is the
    string ``<shared>``: JSON cannot share, and 10^6 references to one list of 10^6 would render 10^12 values."""
    seen = set() if seen is None else seen
    if isinstance(value, (DeepSpeedObject, Mapping, list, tuple)):
        if id(value) in seen:
            return "<shared>"
        seen.add(id(value))
    if isinstance(value, DeepSpeedObject):
        return {"class": f"{value.ds_module}.{value.ds_name}",
                **{k: _plain(v, seen) for k, v in sorted(value.__dict__.items())}}
    if isinstance(value, Mapping):
        return {str(k): _plain(v, seen) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, seen) for v in value]
    if isinstance(value, TensorRef):
        return float(value.item()) if value.numel == 1 else f"<tensor {list(value.shape)}>"
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def _optim_facts(tree: Mapping[str, Any]) -> dict[str, Any]:
    osd = tree.get("optimizer_state_dict")
    if not isinstance(osd, Mapping):
        return {}
    facts: dict[str, Any] = {k: _plain(osd[k]) for k in _OPTIM_FACTS[:-2] if k in osd}
    inner = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    if isinstance(inner, Mapping):
        groups = inner.get("param_groups") or []
        facts["param_groups"] = [_plain({k: v for k, v in g.items() if k != "params"})
                                 for g in groups if isinstance(g, Mapping)]
        steps = set()
        for st in (inner.get("state") or {}).values():
            if isinstance(st, Mapping) and "step" in st:
                steps.add(json.dumps(_plain(st["step"])))
        facts["adam_step"] = sorted(steps)
    for k in ("ds_version", "ds_config"):
        if k in tree:
            facts[k] = _plain(tree[k])
    return facts


def _model_facts(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _plain(tree[k]) for k in _MODEL_FACTS if k in tree}


def same_save_problems(named_facts: Iterable[tuple[str, dict[str, Any]]]) -> list[tuple[str, str]]:
    """``(fact, message)`` for every fact on which the files disagree, naming which file holds which
    value (for nested values such as ``ds_config``: the first entries that differ). Pure."""
    by_fact: dict[str, dict[str, tuple[Any, list[str]]]] = {}
    for name, facts in named_facts:
        for key, value in facts.items():
            shown = json.dumps(value, sort_keys=True, default=str)
            by_fact.setdefault(key, {}).setdefault(shown, (value, []))[1].append(name)
    problems = []
    for key, values in by_fact.items():
        if len(values) < 2:
            continue
        groups = list(values.values())
        paths = _differing_paths([v for v, _ in groups])
        if paths:
            parts = ["; ".join(f"{key}.{p} = {_short(_at(v, p))}" for p in paths[:3]) + f" in {', '.join(files)}"
                     for v, files in groups]
        else:
            parts = [f"{_short(v)} in {', '.join(files)}" for v, files in groups]
        problems.append((key, f"files disagree ({' | '.join(parts)}); they come from different saves — "
                              "restore the odd ones from the same save, or pick another tag with --tag"))
    return problems


_ABSENT = object()


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value} if prefix else {}


def _differing_paths(values: list[Any]) -> list[str]:
    """Dotted paths at which nested dicts differ (empty unless every value is a dict)."""
    if not all(isinstance(v, dict) for v in values):
        return []
    flats = [_flat(v) for v in values]
    keys = sorted(set().union(*flats))
    return [k for k in keys if len({json.dumps(f.get(k, "<absent>"), sort_keys=True, default=str)
                                     for f in flats}) > 1]


def _at(value: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def _short(value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def file_facts(files: Iterable[Path], trees: Mapping[Path, Any], tag_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """The facts of each file that every file of one save shares (``ds_config``/``ds_version`` are in
    model-states and optimizer files alike)."""
    out = []
    for path in files:
        tree = trees[path]
        if not isinstance(tree, Mapping):
            continue
        facts = _optim_facts(tree) if "optimizer_state_dict" in tree else _model_facts(tree)
        out.append((str(path.relative_to(tag_dir)), facts))
    return out


# --------------------------------------------------------------------------------------------
# Rank identity: copies of one rank's file standing in for another's


def _digest(path: Path, nbytes: int | None = None) -> str:
    """sha256 of the first ``nbytes`` bytes and the last ``nbytes`` (the whole file for None)."""
    import hashlib

    from ..limits import open_regular

    h = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as f:
        if nbytes is None:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        else:
            h.update(f.read(nbytes))
            f.seek(max(0, os.fstat(f.fileno()).st_size - nbytes))
            h.update(f.read(nbytes))
    return h.hexdigest()


def _holds_partition_bytes(records: tuple[tuple[str, int, int], ...]) -> bool:
    """Whether a zip-format rank file holds tensor data beyond scalars (a step count, a loss scale). Equal bytes
    prove a copy only then: a ZeRO-3 optimizer file whose partitions were all swapped to NVMe
    (``offloaded_tensors/rankNN``) holds empty flat tensors and one-element steps, the same on every rank, down to
    the ``.data/serialization_id`` (seen: DeepSpeed 0.19.8, ``offload_optimizer`` on nvme, 2 ranks)."""
    return any(size > 8 for name, _, size in records if name.startswith("data/"))


def rank_identity_problems(files: Iterable[Path], infos: Mapping[Path, Any]) -> list[str]:
    """Why some rank files are copies of others (empty: none are), each naming both files.

    * A zip-format file's records sit in a folder named after the file ``torch.save`` wrote
      (``zero_pp_rank_1_mp_rank_00_optim_states/data.pkl``): a file whose folder names *another* DeepSpeed
      rank file is a renamed copy of it (``cp`` after a failed save). Other folder names (``archive``, a tool's
      temporary name) say nothing and are accepted.
    * The optimizer files of the data-parallel ranks of one model-parallel rank each hold their own partition
      (:func:`~dsckpt.layout.partition_set`), so two of them never hold the same bytes: equal record lists (name,
      CRC-32, size: free, from the zip directory) or, for legacy files (no CRCs), equal sizes and sha256 are a copy.

    ``infos``: :class:`dsckpt.safe_load.FileInfo` per file."""
    from ..layout import is_rank_file_name, partition_set

    problems: list[str] = []
    renamed: set[Path] = set()
    by_records: dict[tuple[Any, ...], list[Path]] = {}
    legacy_by_size: dict[tuple[Any, int], list[Path]] = {}
    for path in files:
        info = infos.get(path)
        if info is None:
            continue
        name = info.archive_name
        if name is not None and name != path.stem and is_rank_file_name(name + ".pt"):
            renamed.add(path)
            problems.append(f"{path} is a renamed copy of {name}.pt: its records are named "
                            f"'{name}/...', after the file torch.save wrote; restore {path.name} from the same save "
                            "(a copy of another rank's file cannot stand in for it)")
        family = partition_set(path.name)
        if family is None:
            continue
        if info.records:
            if _holds_partition_bytes(info.records):
                by_records.setdefault((family, info.records), []).append(path)
        else:
            legacy_by_size.setdefault((family, path.stat().st_size), []).append(path)
    groups = [(g, "hold the same bytes (every record has the same name, size and CRC-32)")
              for g in by_records.values() if len(g) > 1]
    for same_size in legacy_by_size.values():
        if len(same_size) < 2:
            continue
        ends: dict[str, list[Path]] = {}
        for p in same_size:  # cheap first: the first and last MiB, then the whole file
            ends.setdefault(_digest(p, 1 << 20), []).append(p)
        for candidates in ends.values():
            full: dict[str, list[Path]] = {}
            for p in candidates if len(candidates) > 1 else ():
                full.setdefault(_digest(p), []).append(p)
            groups += [(g, "are byte-identical") for g in full.values() if len(g) > 1]
    for g, how in groups:
        if renamed.intersection(g):
            continue  # said already, more precisely
        problems.append(f"{', '.join(str(p) for p in g)} {how}, but each rank's file holds its own partition: "
                        "all but one are copies; restore them from "
                        "the same save, or pick another tag with --tag")
    return problems


# --------------------------------------------------------------------------------------------
# The fp32 master against the module copy, sampled


#: Elements compared at each end of every param (``sampled_copy_disagreements``).
COPY_SAMPLE_NUMEL = 8


def _read_elements(piece: Any, lo: int, hi: int, cache: Any, fds: dict[Path, int]) -> Any:
    """Elements ``[lo, hi)`` of ``piece`` as a numpy array of its stored dtype, or None where a fragment is not
    a contiguous stored tensor. Read with ``pread`` outside the CRC-32 accounting: a sample to compare, never
    exported (a record touched here is not read whole at the end, as a partly read one would be)."""
    import numpy as np

    from ..dtypes import DTYPES
    from ..model import contiguous_fragments

    dtype = DTYPES[piece.dtype]
    out = np.empty(hi - lo, dtype=dtype.numpy)
    got = 0
    for f in contiguous_fragments(piece):
        a, b = max(lo, f.dst_offset), min(hi, f.dst_offset + f.numel)
        if a >= b:
            continue
        ref = cache.tensor(f.file, f.key)
        if not isinstance(ref, TensorRef) or not ref.is_contiguous() or ref.dtype_name != piece.dtype:
            return None
        first = ref.storage_offset + f.src_offset + (a - f.dst_offset)
        if first < 0 or first + (b - a) > ref.storage.numel:
            return None  # the readers refuse this with a message of their own
        fd = fds.get(f.file)
        if fd is None:
            fd = fds[f.file] = limits.open_parsed(f.file)
        nbytes = (b - a) * dtype.itemsize
        raw = os.pread(fd, nbytes, ref.storage.file_offset + first * dtype.itemsize)
        if len(raw) != nbytes:
            return None
        out[a - lo: b - lo] = np.frombuffer(raw, dtype=dtype.numpy)
        got += b - a
    return out if got == hi - lo else None


def sampled_copy_disagreements(ckpt: Any, cache: Any, *,
                               sample: int = COPY_SAMPLE_NUMEL) -> list[tuple[str, tuple[Path, Path]]]:
    """Params whose fp32 master (optimizer files) and module copy (model-states file) disagree on the first and
    last ``sample`` elements: the master rounded to the copy's dtype must equal the copy wherever all three are
    finite (``verify`` compares every element; this is its cheap form, for the commands that export the master).
    Copies of different saves, or a rank's optimizer file replaced by another's, disagree almost everywhere,
    so a few elements at each end of each param tell. At most one ``(message, (master file, module file))`` per
    file pair."""
    import numpy as np

    from ..dtypes import from_float32, to_float32
    from ..model import Role, contiguous_fragments

    fds: dict[Path, int] = {}
    found: dict[tuple[Path, Path], str] = {}
    try:
        for e in ckpt.entries:
            if e.tied_to is not None:
                continue
            master = next((p for p in e.pieces if p.role is Role.MASTER and p.dtype == "float32"), None)
            module = next((p for p in e.pieces if p.role is Role.MODULE and p.replica == 0), None)
            if master is None or module is None or module.numel != master.numel or not module.numel or \
                    module.dtype not in ("float32", "bfloat16", "float16"):
                continue
            n = module.numel
            for lo, hi in {(0, min(n, sample)), (max(0, n - sample), n)}:
                m = _read_elements(master, lo, hi, cache, fds)
                c = _read_elements(module, lo, hi, cache, fds)
                if m is None or c is None:
                    continue
                if module.dtype == "float32":
                    r, lowp = m, c
                else:
                    r, lowp = to_float32(from_float32(m, module.dtype), module.dtype), to_float32(c, module.dtype)
                with np.errstate(invalid="ignore", over="ignore"):
                    bad = np.flatnonzero(np.isfinite(m) & np.isfinite(r) & np.isfinite(lowp) & (r != lowp))
                if bad.size:
                    i = int(bad[0])
                    at = lo + i
                    mf = next((f.file for f in contiguous_fragments(master)
                               if f.dst_offset <= at < f.dst_offset + f.numel), master.fragments[0].file)
                    key = (mf, module.fragments[0].file)
                    found.setdefault(key, (
                        f"'{e.name}': its fp32 master in {mf.name} and its {module.dtype} module copy in "
                        f"{module.fragments[0].file.name} disagree (element {at}: the master {float(m[i])!r} "
                        f"rounds to {float(r[i])!r}, the copy holds {float(lowp[i])!r}); the files come from "
                        "different saves or one was replaced by another rank's — run 'dsckpt verify' for the full "
                        "report, restore the files from one save or pick another tag with --tag"))
                    break
    finally:
        for fd in fds.values():
            os.close(fd)
    return [(msg, files) for files, msg in found.items()]
