"""Bind, then prove: which param owns each optimizer-side tensor that the files store without a name.

At ZeRO stage 0 DeepSpeed keeps the fp32 masters (``FP16_UnfusedOptimizer.fp32_groups``) and the torch
optimizer state (fp32 training) as lists in the order the params were handed to the optimizer, with no
names (DEEPSPEED-NOTES 1.6). A param missing from those lists (frozen, not passed) shifts every later
position, so matching by order and shape alone can bind a tensor to the wrong name (issue 8).

This module is pure: readers describe each nameless tensor as a :class:`Slot` and give, per slot, the set
of params it may belong to (:func:`order_candidates` for the evidence "same shape, each group in module
order"; value evidence — a 16-bit copy equals the master rounded — is gathered by the reader). Then
:func:`resolve` finds every binding consistent with those sets: a slot is *proven* when it has the same
param in all of them, otherwise the names involved are *ambiguous* and reported as an
:class:`Ambiguity`. Nothing is ever picked among equals.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import UnsupportedCheckpointError

__all__ = [
    "Ambiguity",
    "AmbiguousBindingError",
    "Binding",
    "Slot",
    "ambiguity_from",
    "order_candidates",
    "resolve",
]


@dataclass(frozen=True)
class Slot:
    """One nameless optimizer-side tensor: position ``index`` of param group ``group``. ``shape`` is
    None when the file does not show it (a param passed to the optimizer that never got state)."""

    group: int
    index: int
    shape: tuple[int, ...] | None
    label: str  # where it is, for messages, e.g. "optimizer.fp32_groups[0][3]"


@dataclass(frozen=True)
class Ambiguity:
    """Params whose binding the files do not determine, and why.

    ``candidates`` pairs each undetermined stored tensor (its label) with the params it fits.
    ``values_agree`` is True when every choice gives every name the same fp32 value (the masters involved
    are exactly representable in the 16-bit dtype, or there are no separate masters): exported values
    then do not depend on the choice, while trainable/frozen flags and optimizer moments do.
    """

    names: tuple[str, ...]
    what: str
    evidence: str
    candidates: tuple[tuple[str, tuple[str, ...]], ...]
    values_agree: bool

    def describe(self) -> str:
        fits = "; ".join(f"{label} fits {' or '.join(names)}" for label, names in self.candidates)
        return (f"cannot tell which params own {len(self.candidates)} stored {self.what} tensor(s) "
                f"(consistent by {self.evidence}): {fits}")

    def to_dict(self) -> dict[str, object]:
        return {"names": list(self.names), "what": self.what, "evidence": self.evidence,
                "candidates": {label: list(names) for label, names in self.candidates},
                "values_agree": self.values_agree}


class AmbiguousBindingError(UnsupportedCheckpointError):
    """A command's output depends on a binding the checkpoint does not determine (exit 3)."""


@dataclass(frozen=True)
class Binding:
    """The outcome of :func:`resolve`: ``slot_to_param[i]`` for every proven slot (indices into the
    slot and param sequences), and the slots no single param could be proven for."""

    slot_to_param: dict[int, int]
    undetermined: tuple[int, ...]
    consistent: bool  # False: no binding fits at all (the slots cannot all be placed)


def order_candidates(slots: Sequence[Slot], param_shapes: Sequence[tuple[int, ...]]) -> list[set[int]]:
    """For each slot, the params it can be under the assumption that each param group lists its params
    in module order (true for ``model.parameters()``, for ``[p for p in model.parameters() if ...]`` and
    for Hugging Face Trainer's decay / no-decay groups) with the same shape (a slot of unknown shape fits
    any param).

    Exact per group: param ``j`` is a candidate for the group's ``i``-th slot iff the slots before it fit
    into params before ``j`` and the slots after it fit into params after ``j``. Groups are handled
    independently; :func:`resolve` then keeps them disjoint.
    """
    out: list[set[int]] = [set() for _ in slots]
    by_group: dict[int, list[int]] = {}
    for k, s in enumerate(slots):
        by_group.setdefault(s.group, []).append(k)
    n = len(param_shapes)

    def fits(slot: Slot, j: int) -> bool:
        return slot.shape is None or tuple(slot.shape) == tuple(param_shapes[j])

    for members in by_group.values():
        members = sorted(members, key=lambda k: slots[k].index)
        m = len(members)
        # left[i]: smallest param position the i-th slot can take in a left-greedy embedding
        left = [n] * m
        j = 0
        for i, k in enumerate(members):
            while j < n and not fits(slots[k], j):
                j += 1
            if j >= n:
                break
            left[i] = j
            j += 1
        if m and left[m - 1] >= n:
            continue  # the group does not fit at all: no candidates
        right = [-1] * m
        j = n - 1
        for i in range(m - 1, -1, -1):
            k = members[i]
            while j >= 0 and not fits(slots[k], j):
                j -= 1
            right[i] = j
            j -= 1
        for i, k in enumerate(members):
            lo = left[i - 1] + 1 if i > 0 else 0
            hi = right[i + 1] - 1 if i + 1 < m else n - 1
            out[k] = {j for j in range(lo, hi + 1) if fits(slots[k], j)}
    return out


def resolve(candidates: Sequence[set[int]], n_params: int) -> Binding:
    """Every slot proven or not, given each slot's candidate params; distinct slots take distinct params.

    A slot is proven when it gets the same param in every assignment that places all slots. Found with
    one maximum matching and, per slot, a search for an alternating path that would move it (to a free
    param, or around a cycle); cost is linear in the candidate edges per slot.
    """
    match_slot: dict[int, int] = {}  # slot -> param
    match_param: dict[int, int] = {}  # param -> slot
    for s in range(len(candidates)):
        if not _augment(s, candidates, match_slot, match_param):
            return Binding({}, tuple(range(len(candidates))), consistent=False)
    proven: dict[int, int] = {}
    undetermined = []
    for s in range(len(candidates)):
        if _can_move(s, candidates, match_slot, match_param):
            undetermined.append(s)
        else:
            proven[s] = match_slot[s]
    return Binding(proven, tuple(undetermined), consistent=True)


def _augment(s: int, candidates: Sequence[set[int]], match_slot: dict[int, int],
             match_param: dict[int, int]) -> bool:
    """Place the unmatched slot ``s`` along a shortest alternating path (breadth first: no recursion)."""
    reached_from: dict[int, int] = {}  # param -> the slot that reached it
    queue = deque([s])
    seen_slots = {s}
    while queue:
        x = queue.popleft()
        for p in sorted(candidates[x]):
            if p in reached_from:
                continue
            reached_from[p] = x
            owner = match_param.get(p)
            if owner is None:
                while True:  # flip the path back to s, whose old match is None
                    x = reached_from[p]
                    old = match_slot.get(x)
                    match_slot[x] = p
                    match_param[p] = x
                    if old is None:
                        return True
                    p = old
            if owner not in seen_slots:
                seen_slots.add(owner)
                queue.append(owner)
    return False


def _can_move(s: int, candidates: Sequence[set[int]], match_slot: dict[int, int],
              match_param: dict[int, int]) -> bool:
    """Whether slot ``s`` has another param in some assignment: an alternating path from ``s`` over a
    non-matching edge reaches a free param, or comes back to ``s``'s own param (a cycle)."""
    home = match_slot[s]
    seen_params: set[int] = set()
    queue = deque([s])
    seen_slots = {s}
    while queue:
        slot = queue.popleft()
        for p in candidates[slot]:
            if p == match_slot[slot] or p in seen_params:
                continue
            if p == home:
                return True
            seen_params.add(p)
            owner = match_param.get(p)
            if owner is None:
                return True
            if owner not in seen_slots:
                seen_slots.add(owner)
                queue.append(owner)
    return False


def ambiguity_from(binding: Binding, candidates: Sequence[set[int]], slots: Sequence[Slot],
                   owners: Sequence[tuple[str, ...]], *, what: str, evidence: str,
                   values_agree: bool) -> Ambiguity | None:
    """The :class:`Ambiguity` for a binding's undetermined slots (None when everything is proven).
    ``owners[j]`` are the names candidate ``j`` stands for (one param, or every param viewing one flat
    buffer)."""
    if not binding.undetermined:
        return None
    taken = set(binding.slot_to_param.values())  # params that proven slots own in every binding
    names: set[str] = set()
    pairs = []
    for s in binding.undetermined:
        cands = tuple(n for j in sorted(candidates[s]) if j not in taken for n in owners[j])
        names.update(cands)
        pairs.append((slots[s].label, cands))
    return Ambiguity(tuple(sorted(names)), what, evidence, tuple(pairs), values_agree)
