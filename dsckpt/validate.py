"""One validation layer for what the readers take from a parsed file: names, shapes, key types.

:class:`dsckpt.readers.common.FileCache` runs :func:`validate_tree` on every file it parses, so every
command (``info``, ``to-fp32``, ``reshard``, ``repair``, ``diff``, ``scan``, ``verify``) reads only trees
whose metadata has the types and values DeepSpeed writes. What is checked (DeepSpeed 0.19.8 writes
these in ``engine._save_checkpoint`` / ``_save_zero_checkpoint``):

* ``param_shapes``: a list of mappings from a ``str`` name to a shape; ``frozen_param_shapes``: one
  such mapping. A shape is a sequence of ints in ``[0, 2**63)`` whose product fits 2**63 (torch's
  sizes are int64).
* ``buffer_names``: a list of ``str``; ``shared_params``: ``str`` to ``str``; ``module`` (and a layer
  file's state dict): ``str`` keys.
* A shape in ``param_shapes``/``frozen_param_shapes`` agrees with the module copy saved beside it, where
  there is one (ZeRO-1/2 and TP ranks save each param's 16-bit copy whole; ZeRO-3 saves empty
  placeholders, which say nothing): a zero-size shape against a full module copy is damage, not an
  empty param.

A failure is :class:`~dsckpt.errors.CorruptCheckpointError` naming the file and the key path. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import CorruptCheckpointError, shorten
from .tensor_ref import TensorRef

__all__ = ["is_pep440", "refuse_unloadable_fields", "shape_of", "unloadable_fields", "validate_tree"]

_INT64 = 1 << 63


def _where(path: Path, key: tuple[Any, ...]) -> str:
    return f"{path}: " + "".join(f"[{shorten(k, 60)!s}]" if not isinstance(k, str) else f"[{k!r}]" for k in key)


def _bad(path: Path, key: tuple[Any, ...], what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{_where(path, key)} {what}; the file is damaged — restore it from the same save "
                                  "or pick another tag with --tag")


def shape_of(value: Any, path: Path, key: tuple[Any, ...]) -> tuple[int, ...]:
    """``value`` as a shape (a sequence of non-negative int64 dims whose product fits int64), or raise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise _bad(path, key, f"is {shorten(value)} ({type(value).__name__}), not a shape")
    dims = tuple(value)
    numel = 1
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < _INT64:
            raise _bad(path, key, f"is the shape {shorten(list(dims))}: a dimension must be a whole number in "
                                  "[0, 2**63)")
        numel *= d
    if numel >= _INT64:
        raise _bad(path, key, f"is the shape {shorten(list(dims))} of {numel} elements, more than torch can hold")
    return dims


def _names(value: Any, path: Path, key: tuple[Any, ...], what: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise _bad(path, key, f"is {type(value).__name__}, not a mapping of {what}")
    for k in value:
        if not isinstance(k, str):
            raise _bad(path, (*key, k), f"is keyed by {type(k).__name__} {shorten(k)}, not by a name (str)")
    return value


def _check_shapes(shapes: Mapping[str, Any], module: Any, path: Path, key: tuple[Any, ...]) -> None:
    for name, value in _names(shapes, path, key, "param names to shapes").items():
        dims = shape_of(value, path, (*key, name))
        copy = module.get(name) if isinstance(module, Mapping) else None
        if isinstance(copy, TensorRef) and copy.numel and tuple(copy.shape) != dims:
            raise _bad(path, (*key, name), f"says shape {list(dims)}, but the module copy saved beside it has shape "
                                           f"{list(copy.shape)}")


def validate_tree(path: Path, tree: Any) -> None:
    """Check the metadata of one parsed file (see the module docstring); raise on the first problem."""
    if not isinstance(tree, Mapping):
        return
    module = tree.get("module")
    if module is not None:
        _names(module, path, ("module",), "names to tensors")
    if "param_shapes" in tree and tree["param_shapes"] is not None:
        groups = tree["param_shapes"]
        if isinstance(groups, Mapping):  # DeepSpeed < 0.3.x: one group, no list
            groups = [groups]
        if not isinstance(groups, list):
            raise _bad(path, ("param_shapes",), f"is {type(groups).__name__}, not a list of param groups")
        for g, shapes in enumerate(groups):
            _check_shapes(shapes, module, path, ("param_shapes", g))
    if tree.get("frozen_param_shapes") is not None:
        _check_shapes(tree["frozen_param_shapes"], module, path, ("frozen_param_shapes",))
    if tree.get("buffer_names") is not None:
        names = tree["buffer_names"]
        if not isinstance(names, (list, tuple)):
            raise _bad(path, ("buffer_names",), f"is {type(names).__name__}, not a list of names")
        for i, n in enumerate(names):
            if not isinstance(n, str):
                raise _bad(path, ("buffer_names", i), f"is {type(n).__name__} {shorten(n)}, not a name (str)")
    if tree.get("shared_params") is not None:
        for name, target in _names(tree["shared_params"], path, ("shared_params",), "names to names").items():
            if not isinstance(target, str):
                raise _bad(path, ("shared_params", name), f"is {type(target).__name__}, not a name (str)")


# --------------------------------------------------------------------------------------------
# Fields DeepSpeed's loader parses

# PEP 440's version grammar (its appendix B regex, which packaging.version.VERSION_PATTERN is): DeepSpeed's
# loader calls packaging.version.parse(ds_version) on the optimizer state (0.19.8 stage_1_and_2.py:3677-3679,
# bf16_optimizer.py:672-674; an empty one fails its assert). Written out here rather than importing packaging:
# one regex, no run-time dependency, the same answer as packaging >= 22 (which refuses what is not PEP 440).
_PEP440 = re.compile(r"""
    v?
    (?:(?:[0-9]+)!)?                                # epoch
    (?:[0-9]+(?:\.[0-9]+)*)                         # release
    (?:[-_.]?(?:alpha|a|beta|b|preview|pre|c|rc)[-_.]?(?:[0-9]+)?)?
    (?:(?:-[0-9]+)|(?:[-_.]?(?:post|rev|r)[-_.]?(?:[0-9]+)?))?
    (?:[-_.]?dev[-_.]?(?:[0-9]+)?)?
    (?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?             # local version
""", re.VERBOSE | re.IGNORECASE)


def is_pep440(value: object) -> bool:
    """True for a string ``packaging.version.parse`` accepts (surrounding whitespace allowed, as there)."""
    return isinstance(value, str) and _PEP440.fullmatch(value.strip()) is not None


def unloadable_fields(tree: Any) -> list[tuple[str, Any]]:
    """``(field, value)`` for every field of a DeepSpeed file's tree that DeepSpeed's loader rejects: a
    ``ds_version`` (top level, and the optimizer state's own) that is not a PEP 440 version string. Pure."""
    if not isinstance(tree, Mapping):
        return []
    osd = tree.get("optimizer_state_dict")
    return [(field, holder["ds_version"])
            for field, holder in (("ds_version", tree), ("optimizer_state_dict.ds_version", osd))
            if isinstance(holder, Mapping) and "ds_version" in holder and not is_pep440(holder["ds_version"])]


def refuse_unloadable_fields(jobs: Sequence[tuple[Path, Any]], *, source: object) -> None:
    """The one check of every command that writes DeepSpeed files (``reshard``, ``repair``): refuse, before
    anything is written, a ``(path, tree)`` whose tree carries a field DeepSpeed's loader rejects
    (:func:`unloadable_fields`) -- carried over from ``source``, it would make the output unloadable."""
    found: dict[tuple[str, str], list[str]] = {}  # (field, value shown) -> the files carrying it
    for path, tree in jobs:
        for field, value in unloadable_fields(tree):
            found.setdefault((field, f"{shorten(value)} ({type(value).__name__})"), []).append(path.name)
    if found:
        (field, shown), names = next(iter(found.items()))
        more = sum(len(v) for v in found.values()) - len(names)
        raise CorruptCheckpointError(
            f"{', '.join(names)}: the output would carry {field} = {shown} from {source}"
            + (f" ({more} more such field(s) in other files)" if more else "")
            + ", which is not a version DeepSpeed can parse (packaging.version.parse: PEP 440), so DeepSpeed's "
            "load_checkpoint would fail on it; nothing was written. Restore the source files from the same save "
            "(DeepSpeed writes its version string, e.g. '0.19.8')")
