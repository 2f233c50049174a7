"""Walking what :mod:`dsckpt.safe_load` parsed: the budget check over a whole tree (:func:`check_tree`, each
container visited once), the tensors in it (:func:`walk_tensors`), a copy with each leaf mapped
(:func:`map_structure`, :func:`materialize` into real torch objects) and the completion of partly read records'
CRC-32 checks (:func:`finish_checks`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import crc, limits
from .errors import CorruptCheckpointError
from .stand_ins import DeepSpeedObject, TorchSize, to_torch_value
from .tensor_ref import TensorRef, byte_view, read_bytes

if TYPE_CHECKING:
    import torch

__all__ = ["check_tree", "finish_checks", "map_structure", "materialize", "walk_tensors"]

# --------------------------------------------------------------------------------------------
# Walking loaded trees


def check_tree(obj: Any, where: object) -> None:
    """Refuse a parsed tree that goes past a :class:`dsckpt.limits.ReadLimits` budget: nesting depth (the
    longest chain of containers), distinct objects, references counted through every shared container
    (what a walk that forgot where it had been would visit), tensors counted the same way (what
    :func:`walk_tensors` lists), a container holding itself, integers of more than ``max_int_bits`` bits,
    strings and bytes of more than ``max_str_nbytes``.

    One iterative pass that visits each container once and does constant work for every further reference
    to it (a "billion laughs" memo costs its size on disk, not 10^9 visits); raises
    :class:`~dsckpt.limits.LimitExceededError` naming ``where`` and the limit."""
    lim = limits.current()
    # id -> (height, references, tensor references) of every container finished; one on the current path: None
    done: dict[int, tuple[int, int, int] | None] = {}
    objects = 0
    # [container, its children, index of the next child, height so far, references so far, tensors so far]
    stack: list[list[Any]] = []

    def leaf(x: Any) -> None:
        if isinstance(x, int) and x.bit_length() > lim.max_int_bits:  # bools are 1 bit
            raise limits.exceeded(where, f"an integer of {x.bit_length()} bits", None, "max_int_bits")
        if isinstance(x, (str, bytes, bytearray)) and len(x) > lim.max_str_nbytes:
            raise limits.exceeded(where, f"a {type(x).__name__} of {len(x)} characters/bytes", None,
                                  "max_str_nbytes")

    def enter(x: Any) -> tuple[int, int, int] | None:
        """(height, references, tensors) of ``x`` if known now (a leaf, a finished container); None once pushed."""
        nonlocal objects
        # The memo first: a container reached again costs one lookup, never a copy of its children (a list
        # holding 10^6 references to one list of 10^6 items would otherwise copy 10^12 of them).
        key = id(x)
        if key in done:
            known = done[key]
            if known is None:
                raise CorruptCheckpointError(f"{where}: a {type(x).__name__} in the pickle contains itself; no "
                                             "DeepSpeed checkpoint does, the file is corrupt or hostile")
            return known
        children = _children(x)
        objects += 1  # a container once, a leaf (a number, a string: often shared, cheap to count) each time
        if objects > lim.max_objects:
            raise limits.exceeded(where, f"more than {lim.max_objects} objects in one pickle", None,
                                  "max_objects")
        tensors = int(isinstance(x, TensorRef))
        if children is None:
            leaf(x)
            return (0, 1, tensors)
        if len(stack) >= lim.max_depth:
            raise limits.exceeded(where, f"containers nested more than {lim.max_depth} deep", None,
                                  "max_depth")
        done[key] = None
        stack.append([x, children, 0, 0, 1, tensors])
        return None

    def finished(height: int, refs: int, tensors: int) -> None:
        if refs > lim.max_references:
            raise limits.exceeded(where, f"{refs} objects reached through shared references", None, "max_references")
        if tensors > lim.max_tensor_references:
            raise limits.exceeded(where, f"{tensors} tensors reached through shared references", None,
                                  "max_tensor_references")

    if enter(obj) is not None:
        return
    while stack:
        top = stack[-1]
        children, i = top[1], top[2]
        if i < len(children):
            top[2] = i + 1
            got = enter(children[i])
            if got is not None:
                top[3] = max(top[3], got[0])
                top[4] += got[1]
                top[5] += got[2]
            continue
        stack.pop()
        height, refs, tensors = top[3] + 1, top[4], top[5]
        finished(height, refs, tensors)
        done[id(top[0])] = (height, refs, tensors)
        if stack:
            parent = stack[-1]
            parent[3] = max(parent[3], height)
            parent[4] += refs
            parent[5] += tensors
        elif height > lim.max_depth:
            raise limits.exceeded(where, f"containers nested {height} deep", None, "max_depth")


def _children(x: Any) -> list[Any] | None:
    """The objects ``x`` holds (keys included), or None for a leaf."""
    if isinstance(x, dict):
        return [*x.keys(), *x.values()]
    if isinstance(x, (list, tuple, set, frozenset)):
        return list(x)
    if isinstance(x, DeepSpeedObject):
        return [*x.__dict__.keys(), *x.__dict__.values()]
    if isinstance(x, TensorRef):
        return [*x.attrs.keys(), *x.attrs.values()] if x.attrs else None
    if isinstance(x, np.ndarray) and x.dtype == object:
        return list(x.ravel())
    return None


def map_structure(fn: Callable[[Any], Any], obj: Any) -> Any:
    """Apply ``fn`` to every leaf of nested dicts/lists/tuples and stand-in attributes. A container shared by
    several parents (the pickle memo) is mapped once and stays shared."""
    memo: dict[int, Any] = {}

    def go(obj: Any) -> Any:
        key = id(obj)
        if key in memo:
            return memo[key]
        if isinstance(obj, OrderedDict):
            out: Any = OrderedDict((k, go(v)) for k, v in obj.items())
        elif isinstance(obj, dict):
            out = {k: go(v) for k, v in obj.items()}
        elif isinstance(obj, list):
            out = [go(v) for v in obj]
        elif isinstance(obj, tuple) and not isinstance(obj, TorchSize):
            mapped = [go(v) for v in obj]
            out = type(obj)(*mapped) if hasattr(obj, "_fields") else tuple(mapped)
        elif isinstance(obj, DeepSpeedObject):
            for k, v in list(obj.__dict__.items()):
                obj.__dict__[k] = go(v)
            out = obj
        else:
            return fn(obj)
        memo[key] = out
        return out

    return go(obj)


def walk_tensors(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], TensorRef]]:
    """Every :class:`TensorRef` in a loaded tree with its key path, in a stable order. A container reached
    through several paths (the pickle memo shares it) is walked once; its tensors are listed under each
    path (the tree's reference budget, :func:`check_tree`, bounds how many that can be)."""
    memo: dict[int, list[tuple[tuple[Any, ...], TensorRef]]] = {}

    def visit(x: Any) -> list[tuple[tuple[Any, ...], TensorRef]]:
        if isinstance(x, TensorRef):
            return [((), x)]
        key = id(x)
        found = memo.get(key)
        if found is not None:
            return found
        if isinstance(x, dict):
            items: Any = x.items()
        elif isinstance(x, (list, tuple)) and not isinstance(x, TorchSize):
            items = enumerate(x)
        elif isinstance(x, DeepSpeedObject):
            items = x.__dict__.items()
        else:
            return []
        out = [((k, *p), ref) for k, v in items for p, ref in visit(v)]
        memo[key] = out
        return out

    return [((*prefix, *p), ref) for p, ref in visit(obj)]


def materialize(obj: Any) -> Any:
    """What ``torch.load`` would return: every :class:`TensorRef` read into a real CPU tensor and every
    torch stand-in (:class:`TorchSize` ...) turned into the torch object. Imports torch."""
    import torch

    cache: dict[tuple[Path, str], torch.Tensor] = {}

    def read(x: Any) -> Any:
        if not isinstance(x, TensorRef):
            return to_torch_value(x)
        skey = (x.storage.path, x.storage.key)
        if skey not in cache:
            whole = torch.empty(x.storage.numel, dtype=x.dtype)
            read_bytes(x.storage, 0, x.storage.numel, byte_view(whole.view(torch.uint8).numpy()))
            cache[skey] = whole
        storage = cache[skey]
        # Views of one storage stay views of one storage (tied weights, flat buffers).
        t = storage.as_strided(x.shape, x.stride, x.storage_offset) if x.numel else torch.empty(
            x.shape, dtype=x.dtype)
        if x.attrs:
            for k, v in x.attrs.items():
                setattr(t, k, v)
        return t

    return map_structure(read, obj)


def finish_checks(obj: Any) -> int:
    """Complete the CRC-32 checks of every zip record that tensors of the loaded tree ``obj`` were
    read from (bytes not yet read are read now; records never read are left alone).

    Raises :class:`CorruptCheckpointError` naming every damaged record. Returns the number of
    records verified."""
    return crc.finish(ref.storage.check for _, ref in walk_tensors(obj))
