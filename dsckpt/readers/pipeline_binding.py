"""DeepSpeed's own fp32 pipeline save without ZeRO: each stage's torch optimizer state bound to named params.

DeepSpeed 0.19.8 keeps each stage's torch ``optimizer.state_dict()`` in its ``mp_rank_{s:02d}_model_states.pt`` with
``param_shapes`` None: params by index only (DEEPSPEED-NOTES 1.3, 1.6; tests/fixtures pp2_fp32_z0). What the run
fixes (seen on 0.19.8): a stage's optimizer holds the stage module's params that require grad in
``PipelineModule.parameters()`` order -- its tied modules first (``tied_modules`` is registered before the layers),
in the order of their first use on the stage, then its layers' own params in layer order --; frozen params are
absent (the run passed ``[p for p in model.parameters() if p.requires_grad]``). The stages cut the layer list into
contiguous runs (pipe/module.py ``_partition_layers``). The layer files give each layer's params, shapes and order; a
``TiedLayerSpec`` module is saved once, in the file of its first use, under that layer's index and without its key
(``layer.state_dict()``), and its later uses with a ``forward_fn`` have no file.

So the binding is inferred and then proven (bind, then prove; :mod:`dsckpt.binding`). A reading is: a set of (at
most :data:`MAX_TIED`) layer files that are tied modules, each used on a stage without its file too (nothing else
shows a module is tied; such a use is a layer without a file, so that stage's layers must leave room for one between
its files), with the (at most :data:`MAX_FROZEN_TIED`) params of theirs that are frozen (on every stage
alike); a cut of the layer files
into the stages; per stage, which tied modules it uses and in which order. Every reading is tried (stage by stage,
memoised), each stage's states fitted to its params by shape and module order (:func:`~dsckpt.binding.order_candidates`
and :func:`~dsckpt.binding.resolve`, as the dense stage-0 reader binds its torch optimizer state).
The binding is proven when every reading that fits gives each state the same param; otherwise the names involved are
ambiguous and the checkpoint is refused naming them (a reading that fits only in part -- a tied param that only some
bindings give a state -- leaves a state open, and is refused the same way). A tied module used on one stage only is
indistinguishable from a plain layer there and is read as one.

The key of a tied module (``tied_modules.<key>.<param>``, the name the run's optimizer and a universal checkpoint
know it by) is stated by no file: it is taken from ``tied_keys`` (layer index -> key, ``reshard --tied-key``), else
the module is named with the stand-in key ``layer_NN`` and the checkpoint records it as unkeyed (reshard refuses to
write a name the files do not state).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..binding import Ambiguity, AmbiguousBindingError, Slot, order_candidates, resolve
from ..errors import CorruptCheckpointError, UnsupportedCheckpointError, UsageError
from .stage0 import state_shape

__all__ = ["MAX_FROZEN_TIED", "MAX_READINGS", "MAX_TIED", "LayerParams", "StageBinding", "bind_stage_optimizers",
           "stand_in_key"]

MAX_TIED = 2  # tied modules (layer files used on several stages) tried at once
MAX_FROZEN_TIED = 2  # frozen params among them tried at once
MAX_READINGS = 20_000  # stage fits tried before refusing (each costs one order_candidates + resolve)


def stand_in_key(layer: int) -> str:
    """The key a tied module whose ``TiedLayerSpec`` key no file states is named by."""
    return f"layer_{layer:02d}"


@dataclass(frozen=True)
class LayerParams:
    """A layer file's params (buffers left out): its global layer index and ``(key, shape)`` in file order."""

    index: int
    params: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class StageBinding:
    """The proven binding: per stage, ``param_shapes`` as dsckpt's own stage-0 pipeline files save it (per optimizer
    group, ``name -> shape`` in the order of the group's ``params``); ``renames``: layer-file name ``"{layer}.{key}"``
    -> ``tied_modules.<key>.<param>`` for every tied module's param; ``unkeyed``: the layers of tied modules named
    with :func:`stand_in_key`."""

    param_shapes: tuple[tuple[dict[str, tuple[int, ...]], ...], ...]
    renames: dict[str, str]
    unkeyed: tuple[int, ...]


# one stage's states bound in one reading: per slot the names it may be (one name: proven)
_Names = tuple[frozenset[str], ...]


def bind_stage_optimizers(optimizers: Sequence[Mapping[str, Any]], layers: Sequence[LayerParams], *,
                          model_files: Sequence[Path], tag_dir: Path,
                          tied_keys: Mapping[int, str] | None = None) -> StageBinding:
    """Bind every stage's torch optimizer state (``optimizers[s]``, saved in ``model_files[s]``) to the named params
    of ``layers`` (every layer file, in layer order), or raise: :class:`~dsckpt.binding.AmbiguousBindingError` when
    several bindings fit, :class:`~dsckpt.errors.UnsupportedCheckpointError` when none does."""
    keys = dict(tied_keys or {})
    slots = [_slots(opt, path, s) for s, (opt, path) in enumerate(zip(optimizers, model_files))]
    search = _Search(list(layers), slots, keys)
    found = search.run()
    if not found:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}' is a pipeline run without ZeRO whose optimizer states (stage by stage, by index) fit no "
            "cut of its layer files into the stages by shape and module order (tied modules first, frozen params "
            f"absent; at most {MAX_TIED} tied modules, each saved in one layer file, tried); the files come from "
            "different runs or from a model dsckpt cannot bind. DeepSpeed 0.19.8 loads such a save unchanged at "
            "another data-parallel size")
    if len(found) > 1 or any(len(n) != 1 for _, stages in found for names in stages for n in names):
        raise AmbiguousBindingError(_ambiguous_message(tag_dir, found, slots))
    (tied, stages), = found
    stray = sorted(set(keys) - tied)
    if stray:
        raise UsageError(f"--tied-key names layer(s) {stray} of '{tag_dir}', which hold no tied module used on several "
                         f"stages (its tied modules: {', '.join(f'layer {i}' for i in sorted(tied)) or 'none'})")
    named = {n: sh for layer in layers for n, sh in _layer_names(layer, tied, keys)}
    shapes = []
    for s, names in enumerate(stages):
        groups: list[dict[str, tuple[int, ...]]] = [{} for _ in range(1 + max((x.group for x in slots[s]), default=-1))]
        for slot, n in zip(slots[s], names):
            name = next(iter(n))
            groups[slot.group][name] = named[name]
        shapes.append(tuple(groups))
    renames = {f"{layer.index}.{k}": n for layer in layers if layer.index in tied
               for (k, _), (n, _) in zip(layer.params, _layer_names(layer, tied, keys))}
    return StageBinding(tuple(shapes), renames, tuple(i for i in sorted(tied) if i not in keys))


def _slots(optimizer: Mapping[str, Any], path: Path, stage: int) -> list[Slot]:
    groups = optimizer.get("param_groups")
    state = optimizer.get("state") or {}
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        raise CorruptCheckpointError(f"{path}: 'optimizer' is not a torch optimizer state_dict (param_groups, state)")
    slots = []
    seen: set[Any] = set()
    for g, pg in enumerate(groups):
        indices = pg.get("params") if isinstance(pg, Mapping) else None
        if not isinstance(indices, list) or any(not isinstance(k, int) or k in seen for k in indices):
            raise CorruptCheckpointError(f"{path}: optimizer param_groups[{g}]['params'] is not a list of distinct "
                                         "param indices; the file is damaged")
        seen.update(indices)
        for i, k in enumerate(indices):
            slots.append(Slot(g, i, state_shape(state.get(k)), f"stage {stage} optimizer.state[{k}]"))
    return slots


def _layer_names(layer: LayerParams, tied: frozenset[int],
                 keys: Mapping[int, str]) -> list[tuple[str, tuple[int, ...]]]:
    if layer.index in tied:
        key = keys.get(layer.index, stand_in_key(layer.index))
        return [(f"tied_modules.{key}.{k}", sh) for k, sh in layer.params]
    return [(f"{layer.index}.{k}", sh) for k, sh in layer.params]


class _Search:
    """Every reading (tied set, stage cuts, tied orders) whose stages all fit; the distinct bindings they give."""

    def __init__(self, layers: list[LayerParams], slots: list[list[Slot]], keys: Mapping[int, str]) -> None:
        self.layers, self.slots, self.keys = layers, slots, keys
        self.fits = 0
        self.memo: dict[tuple[int, int, frozenset[int]], set[tuple[_Names, ...]]] = {}
        self.frozen: frozenset[str] = frozenset()  # the tied modules' frozen params, in the reading tried

    def run(self) -> set[tuple[frozenset[int], tuple[_Names, ...]]]:
        found: set[tuple[frozenset[int], tuple[_Names, ...]]] = set()
        for tied, frozen in self._tied_sets():
            self.frozen = frozen
            self.memo = {}
            for stages in self._stages(tied, 0, 0, frozenset()):
                found.add((tied, stages))
        return found

    def _tied_sets(self) -> Iterator[tuple[frozenset[int], frozenset[str]]]:
        """Sets of layers that may be tied modules, each with every choice of its frozen params (a tied module's
        params are frozen on every stage or on none): a tied module used on a stage without its file has a param
        whose shape is that of some state of a stage after the first."""
        shapes = {x.shape for s in self.slots[1:] for x in s if x.shape is not None}
        cands = [layer for layer in self.layers if any(sh in shapes for _, sh in layer.params)]
        for r in range(min(MAX_TIED, len(cands)) + 1):
            for combo in itertools.combinations(cands, r):
                per_layer = [[n for n, _ in _layer_names(layer, frozenset({layer.index}), self.keys)]
                             for layer in combo]
                names = [n for ns in per_layer for n in ns]
                for chosen in _subsets(range(len(names)), MAX_FROZEN_TIED):
                    frozen = frozenset(names[k] for k in chosen)
                    if all(any(n not in frozen for n in ns) for ns in per_layer):  # all frozen: nothing shows it
                        yield frozenset(layer.index for layer in combo), frozen

    def _stages(self, tied: frozenset[int], s: int, p: int,
                revealed: frozenset[int]) -> set[tuple[_Names, ...]]:
        """The bindings of stages ``s``.. when stage ``s`` starts at layer file position ``p``; ``revealed``: the
        tied modules used so far on a stage without their file (each must be, or nothing shows it is tied)."""
        n_stages, m = len(self.slots), len(self.layers)
        if s == n_stages:
            return {()} if p == m and revealed == tied else set()
        memo_key = (s, p, revealed)
        if memo_key in self.memo:
            return self.memo[memo_key]
        out: set[tuple[_Names, ...]] = set()
        for q in ([m] if s == n_stages - 1 else range(p, m + 1)):
            own = [i for i in range(p, q) if self.layers[i].index in tied]
            # a use of an earlier tied module is a layer without a file (a forward_fn use): its index lies between
            # this stage's files, or past the last file on the last stage
            room = q == m or self.layers[q].index - (self.layers[p - 1].index + 1 if p else 0) > q - p
            earlier = [i for i in range(p) if self.layers[i].index in tied] if room else []
            for used in _subsets(earlier):
                for order in set(itertools.permutations(own + list(used))):
                    names = self._fit(s, order, [i for i in range(p, q) if self.layers[i].index not in tied], tied)
                    if names is None:
                        continue
                    for rest in self._stages(tied, s + 1, q, revealed | {self.layers[i].index for i in used}):
                        out.add((names, *rest))
        self.memo[memo_key] = out
        return out

    def _fit(self, s: int, tied_order: Sequence[int], plain: Sequence[int], tied: frozenset[int]) -> _Names | None:
        self.fits += 1
        if self.fits > MAX_READINGS:
            raise UnsupportedCheckpointError(
                f"binding the pipeline stages' optimizer states took more than {MAX_READINGS} tries: with many "
                "equally shaped layers, where the stages cut the layer list, which params are frozen and which layers "
                "are tied modules are open in too many ways; dsckpt does not guess. DeepSpeed 0.19.8 loads such a "
                "save unchanged at another data-parallel size")
        params = [nm for i in (*tied_order, *plain) for nm in _layer_names(self.layers[i], tied, self.keys)
                  if nm[0] not in self.frozen]
        n_tied = sum(1 for i in tied_order for nm in _layer_names(self.layers[i], tied, self.keys)
                     if nm[0] not in self.frozen)
        slots = self.slots[s]
        cands = order_candidates(slots, [sh for _, sh in params])
        binding = resolve(cands, len(params))
        # A tied module's params that are not frozen in this reading must be able to own a state on every stage
        # using it; one that no state here can be would be frozen here and not elsewhere: no such reading. (One that
        # only some bindings give a state leaves a slot undetermined: the result is then refused as ambiguous.)
        if not binding.consistent or any(all(j not in c for c in cands) for j in range(n_tied)):
            return None
        taken = set(binding.slot_to_param.values())
        return tuple(frozenset({params[binding.slot_to_param[k]][0]}) if k in binding.slot_to_param
                     else frozenset(params[j][0] for j in cands[k] if j not in taken) for k in range(len(slots)))


def _subsets(items: Sequence[int], most: int | None = None) -> Iterator[tuple[int, ...]]:
    for r in range(min(len(items), len(items) if most is None else most) + 1):
        yield from itertools.combinations(items, r)


def _ambiguous_message(tag_dir: Path, found: set[tuple[frozenset[int], tuple[_Names, ...]]],
                       slots: list[list[Slot]]) -> str:
    pairs = []
    names: set[str] = set()
    for s, stage_slots in enumerate(slots):
        for k, slot in enumerate(stage_slots):
            fits = frozenset().union(*(stages[s][k] for _, stages in found))
            if len(fits) > 1:
                pairs.append((slot.label, tuple(sorted(fits))))
                names |= fits
    if not pairs:  # the same states, read with other tied modules
        pairs = [("tied modules", tuple(sorted(",".join(map(str, sorted(t))) or "none" for t, _ in found)))]
    shown = 8  # a model of many equal blocks leaves most states open: the first few name the problem
    amb = Ambiguity(tuple(sorted(names)), "optimizer state", "shape and module order, stage by stage",
                    tuple((label, fits if len(fits) <= shown else (*fits[:shown], f"{len(fits) - shown} more"))
                          for label, fits in pairs[:shown]), values_agree=True)
    more = f" (and {len(pairs) - shown} more open states)" if len(pairs) > shown else ""
    return (f"'{tag_dir}' is DeepSpeed's own fp32 pipeline save without ZeRO, whose optimizer states name no param, "
            f"and more than one binding fits: {amb.describe()}{more}. Which params are frozen and which moments belong "
            "to which param depend on the choice; dsckpt does not guess, so it reads and reshards no such save. "
            "DeepSpeed 0.19.8 loads it unchanged at another data-parallel size")
