"""Reshard planning of tensor-parallel slices (issue 20, "streaming and bounded memory"): ``rank_view``'s
closed-form mapping of a source slice onto a target TP rank (``dsckpt.tensor_parallel._local_fragments``) equals
the row-by-row mapping it replaced, element for element, on random layouts (Hypothesis); it stays a few fragments
per slice where the TP size is kept; and the streamed reader refuses strided fragments that do not tile a tensor."""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tensor_parallel import make_cut

from dsckpt.chunks import fragment_views, place, plan_piece_chunks
from dsckpt.errors import CorruptCheckpointError
from dsckpt.model import Fragment, Piece, Role, contiguous_fragments
from dsckpt.parallel_layout import ParamCut, SplitKind, TpBlock
from dsckpt.readers import FileCache
from dsckpt.tensor_parallel import _local_fragments, compose


def _per_row(piece: Piece, blocks: Sequence[TpBlock], name: str) -> tuple[Fragment, ...]:
    """The row-by-row mapping ``_local_fragments`` was before (commit b6338c6), kept as the oracle: every strided
    block expanded into one span per row, each span looked up among the piece's fragments expanded into runs."""
    runs = contiguous_fragments(piece)
    starts = [f.dst_offset for f in runs]
    out: list[Fragment] = []
    for b in blocks:
        r = b.run_numel
        spans = ([(b.local_offset + i * r, b.full_offset + i * b.full_stride, r) for i in range(b.numel // r)]
                 if r else [(b.local_offset, b.full_offset, b.numel)])
        for local, full, n in spans:
            i = max(0, bisect.bisect_right(starts, full) - 1)
            covered = 0
            while i < len(runs) and runs[i].dst_offset < full + n:
                f = runs[i]
                lo, hi = max(full, f.dst_offset), min(full + n, f.dst_offset + f.numel)
                if lo < hi:
                    g = Fragment(f.file, f.key, f.src_offset + lo - f.dst_offset, hi - lo, local + lo - full, f.rank)
                    last = out[-1] if out else None
                    if (last is not None and (last.file, last.key, last.rank) == (g.file, g.key, g.rank)
                            and last.src_offset + last.numel == g.src_offset
                            and last.dst_offset + last.numel == g.dst_offset):
                        out[-1] = dataclasses.replace(last, numel=last.numel + g.numel)
                    else:
                        out.append(g)
                    covered += hi - lo
                i += 1
            if covered != n:
                raise CorruptCheckpointError(f"tensor '{name}': covers {covered} of [{full}, {full + n})")
    return tuple(out)


def _elements(frags: Sequence[Fragment]) -> dict[int, tuple]:
    """local element -> (file, key, rank, source element): the mapping a fragment list stands for; asserts that no
    local element is mapped twice."""
    out: dict[int, tuple] = {}
    for f in frags:
        for k in range(f.numel):
            d = f.dst_index(k)
            assert d not in out, f"local element {d} mapped twice"
            out[d] = (f.file, f.key, f.rank, f.src_index(k))
    return out


def _split(draw, total: int, parts: int) -> tuple[int, ...]:
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))


@st.composite
def layouts(draw):
    """One tensor cut two ways (source and target TP sizes, random widths per rank, sub-params, vocabulary rows)."""
    kind = draw(st.sampled_from([SplitKind.COLUMN, SplitKind.ROW, SplitKind.VOCABULARY, SplitKind.SUB_PARAMS]))
    ndim = draw(st.integers(1, 3))
    dim = 1 if kind is SplitKind.ROW or (kind is SplitKind.SUB_PARAMS and ndim > 1 and draw(st.booleans())) else 0
    ndim = max(ndim, dim + 1)
    n_sub = draw(st.integers(1, 3)) if kind is SplitKind.SUB_PARAMS else 1
    totals = [draw(st.integers(0, 7)) for _ in range(n_sub)]
    if not sum(totals):
        totals[0] = 1
    other = [draw(st.integers(1, 5)) for _ in range(ndim)]
    keep = draw(st.integers(1, sum(totals))) if kind is SplitKind.VOCABULARY else None

    def cut(tp: int) -> ParamCut:
        return make_cut(kind, dim, other, tuple(_split(draw, n, tp) for n in totals), keep)

    return cut(draw(st.integers(1, 4))), cut(draw(st.integers(1, 4)))


def _source_piece(draw, cut: ParamCut) -> Piece:
    """The piece a TP reader builds: each source rank's local flat slice cut at random ZeRO partition boundaries
    (rows cut anywhere), each part in its own file at a random offset, mapped to full coordinates by compose."""
    frags: list[Fragment] = []
    for t in range(cut.tp_size):
        n = math.prod(cut.rank_shapes[t])
        bounds = sorted(set(draw(st.lists(st.integers(0, n), max_size=4))) | {0, n})
        for p, (a, b) in enumerate(pairwise(bounds)):
            if a < b:
                base = draw(st.integers(0, 5))
                frags += compose(Fragment(Path(f"rank{t}_part{p}"), ("flat",), base, b - a, a, p), cut.rank_blocks(t))
    random.Random(draw(st.integers(0, 2**16))).shuffle(frags)
    return Piece(Role.MASTER, "float32", tuple(frags))


@settings(derandomize=True, max_examples=400, deadline=None)
@given(pair=layouts(), data=st.data())
def test_closed_form_equals_per_row_mapping(pair, data):
    """For every target rank: the same (file, key, rank, source element) for every local element as the per-row
    oracle, every local element of the target's blocks mapped once, (where the source runs equal the target runs,
    the TP-kept case) no more fragments than the source has pieces of the slice, and never one per row: at most
    three per (block, source fragment) pair, strided in the source where a target run takes part of a source
    run (TP split)."""
    src, dst = pair
    piece = _source_piece(data.draw, src)
    for t in range(dst.tp_size):
        blocks = dst.rank_blocks(t)
        fast = _local_fragments(piece, blocks, "w")
        slow = _per_row(piece, blocks, "w")
        got = _elements(fast)
        assert got == _elements(slow)
        assert sorted(got) == sorted(b.local_offset + k for b in blocks for k in range(b.numel))
        assert [f.dst_offset for f in fast] == sorted(f.dst_offset for f in fast)
        for f in fast:
            assert not f.run_numel or (f.strided and f.numel % f.run_numel == 0 and f.run_numel <= f.dst_stride
                                       and f.run_numel <= f.src_step)
            assert list(f.runs()) == [Fragment(f.file, f.key, f.src_index(k), f.run_numel or f.numel,
                                               f.dst_index(k), f.rank)
                                      for k in range(0, f.numel, f.run_numel or max(f.numel, 1))]
        assert len(fast) <= 3 * len(blocks) * len(piece.fragments)
        if src == dst:
            assert len(fast) <= len(slow) and len(fast) <= len(piece.fragments)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(pair=layouts(), data=st.data())
def test_missing_source_fragment_is_refused_like_per_row(pair, data):
    """A source piece with one fragment left out: refused (CorruptCheckpointError) for exactly the target ranks
    the per-row mapping refused."""
    src, dst = pair
    piece = _source_piece(data.draw, src)
    if len(piece.fragments) < 2:
        return
    drop = data.draw(st.integers(0, len(piece.fragments) - 1))
    piece = dataclasses.replace(piece, fragments=piece.fragments[:drop] + piece.fragments[drop + 1:])
    for t in range(dst.tp_size):
        blocks = dst.rank_blocks(t)
        try:
            _per_row(piece, blocks, "w")
            slow_ok = True
        except CorruptCheckpointError:
            slow_ok = False
        if slow_ok:
            assert _elements(_local_fragments(piece, blocks, "w")) == _elements(_per_row(piece, blocks, "w"))
        else:
            with pytest.raises(CorruptCheckpointError, match="'w': its master copy covers .* incomplete"):
                _local_fragments(piece, blocks, "w")


def _row_cut(tp: int, rows: int, cols: int) -> ParamCut:
    return ParamCut("o_proj", SplitKind.ROW, 1, (rows, cols), ((rows, cols // tp),) * tp, ((cols // tp,) * tp,))


@pytest.mark.parametrize("target_tp, expect_strided", [(8, False), (4, True), (1, True), (16, True)])
def test_70b_row_slice_is_a_few_fragments(target_tp, expect_strided):
    """o_proj of a 70B Llama (8192 x 8192) at TP 8, each rank's slice cut by 3 ZeRO partitions (mid-row): a target
    rank's slice at TP 8 (kept) is one contiguous fragment per source partition, at TP 4 / 1 (merged) one strided
    fragment per source piece, at TP 16 (split) one fragment strided in the source per source piece -- not one per
    row (8192). How long planning takes is bench/tp_plan.py's business, not a unit test's."""
    src = _row_cut(8, 8192, 8192)
    frags = []
    for t in range(8):
        n = math.prod(src.rank_shapes[t])
        for p, (a, b) in enumerate([(0, n // 3 + 5), (n // 3 + 5, 2 * n // 3 + 11), (2 * n // 3 + 11, n)]):
            frags += compose(Fragment(Path(f"r{t}p{p}"), ("flat",), 0, b - a, a, p), src.rank_blocks(t))
    piece = Piece(Role.MASTER, "float32", tuple(frags))
    out = _local_fragments(piece, _row_cut(target_tp, 8192, 8192).rank_blocks(0), "o_proj")
    per_source_rank = 3 * 3  # each partition: head run, strided body, tail run
    assert len(out) <= max(1, 8 // target_tp) * per_source_rank
    assert any(f.strided for f in out) == expect_strided
    assert any(f.src_strided for f in out) == (target_tp > 8)
    assert sum(f.numel for f in out) == 8192 * 8192 // target_tp


# --------------------------------------------------------------------------------------------
# The streamed reader (chunks.py): strided pieces must tile the tensor


def _fake_cache(tmp_path: Path, numel: int) -> tuple[FileCache, Path]:
    import torch

    from dsckpt import safe_save

    path = tmp_path / "flat.pt"
    safe_save.save({"flat": torch.arange(numel, dtype=torch.float32)}, path)  # hand-made: malformed-input test
    return FileCache(), path


@pytest.mark.parametrize("frags, why", [
    # two strided fragments over the same runs (the element count adds up, columns 2-3 of each row are missing)
    ([(0, 8, 0, 2, 4), (8, 8, 0, 2, 4)], "overlap"),
    # columns 0-1 one row down: row 4 lies past the 4 x 4 tensor, row 0 of those columns is never written
    ([(0, 8, 2, 2, 4), (8, 8, 4, 2, 4)], "outside"),
    # a contiguous fragment covering elements a strided one covers too
    ([(0, 8, 0, 2, 4), (8, 8, 0, 0, 0)], "overlap"),
    # contiguous only: elements 4-7 twice, 12-15 never (read_piece would have returned uninitialised memory)
    ([(0, 8, 0, 0, 0), (8, 8, 4, 0, 0)], "overlap"),
])
def test_strided_pieces_that_do_not_tile_are_refused(tmp_path, frags, why):
    """Both ways of reading a piece refuse fragments that do not cover the tensor once each, naming it."""
    from dsckpt.assemble import read_piece

    cache, path = _fake_cache(tmp_path, 16)
    piece = Piece(Role.MASTER, "float32", tuple(Fragment(path, ("flat",), s, n, d, None, run_numel=r, dst_stride=st_)
                                                for s, n, d, r, st_ in frags))
    if any(r for _, _, _, r, _ in frags):
        with pytest.raises(CorruptCheckpointError, match=f"'w'.*{why}"):
            plan_piece_chunks(piece, (4, 4), cache, name="w")
    with pytest.raises(CorruptCheckpointError, match=f"'w': its master copy's fragments do not tile.*{why}"):
        read_piece(piece, (4, 4), cache, name="w")


def test_strided_pieces_that_tile_are_planned(tmp_path):
    cache, path = _fake_cache(tmp_path, 16)
    piece = Piece(Role.MASTER, "float32", (Fragment(path, ("flat",), 0, 8, 0, None, run_numel=2, dst_stride=4),
                                           Fragment(path, ("flat",), 8, 6, 2, None, run_numel=2, dst_stride=4),
                                           Fragment(path, ("flat",), 14, 2, 14)))
    assert plan_piece_chunks(piece, (4, 4), cache, name="w")


@pytest.mark.parametrize("outer, cols, tp", [(3, 8, 2), (5, 6, 3), (1, 4, 2)])
def test_strided_source_against_one_block_longer_than_a_row(outer, cols, tp):
    """A target block that is one contiguous range over several rows (the whole tensor) against row-parallel
    source slices: each source run cut out of the block's range, as the per-row oracle does."""
    src = ParamCut("w", SplitKind.ROW, 1, (outer, cols), ((outer, cols // tp),) * tp, ((cols // tp,) * tp,))
    frags = [g for t in range(tp) for g in compose(Fragment(Path(f"r{t}"), ("flat",), 1, outer * cols // tp, 0, t),
                                                   src.rank_blocks(t))]
    piece = Piece(Role.MASTER, "float32", tuple(frags))
    blocks = (TpBlock(0, outer * cols, 0),)
    assert _elements(_local_fragments(piece, blocks, "w")) == _elements(_per_row(piece, blocks, "w"))


# --------------------------------------------------------------------------------------------
# Fragments strided in the source (a TP split's local slices) and the consumers that read them


def test_fragment_strided_in_the_source():
    """Run ``i`` from ``src_offset + i * src_stride`` to ``dst_offset + i * dst_stride``; ``src_stride`` 0 is the
    contiguous source every reader's fragment has; contiguous runs on both sides are not strided."""
    f = Fragment(Path("f"), ("flat",), 3, 6, 10, 1, run_numel=2, dst_stride=2, src_stride=5)
    assert f.strided and f.src_strided and not f.dst_strided and f.src_step == 5
    assert [f.src_index(k) for k in range(6)] == [3, 4, 8, 9, 13, 14]
    assert [f.dst_index(k) for k in range(6)] == list(range(10, 16))
    assert f.src_end == 15
    assert list(f.runs()) == [Fragment(Path("f"), ("flat",), s, 2, d, 1) for s, d in [(3, 10), (8, 12), (13, 14)]]
    both = dataclasses.replace(f, dst_stride=4)
    assert both.src_strided and both.dst_strided
    assert [(r.src_offset, r.dst_offset) for r in both.runs()] == [(3, 10), (8, 14), (13, 18)]
    old = Fragment(Path("f"), ("flat",), 3, 6, 10, 1, run_numel=2, dst_stride=4)  # a reader's row slice
    assert old.strided and not old.src_strided and old.src_step == 2 and old.src_end == 9
    assert [old.src_index(k) for k in range(6)] == list(range(3, 9))
    for flat in (Fragment(Path("f"), ("flat",), 3, 6, 10), dataclasses.replace(f, src_stride=2),
                 Fragment(Path("f"), ("flat",), 3, 6, 10, run_numel=2, dst_stride=2, src_stride=2),
                 dataclasses.replace(f, numel=2)):  # one run: nothing to stride
        assert not flat.strided and flat.src_end == 3 + flat.numel
        assert [flat.src_index(k) for k in range(flat.numel)] == list(range(3, 3 + flat.numel))
        assert list(flat.runs()) == [Fragment(Path("f"), ("flat",), 3, flat.numel, 10, flat.rank)]


@settings(derandomize=True, max_examples=300, deadline=None)
@given(run=st.integers(1, 5), gap=st.integers(0, 4), runs=st.integers(1, 6), d0=st.integers(0, 7),
       head=st.integers(0, 4), tail=st.integers(0, 4), lo=st.integers(0, 60), width=st.integers(0, 60))
def test_window_and_views_follow_the_destination(run, gap, runs, d0, head, tail, lo, width):
    """``window(lo, hi)`` is exactly the fragment elements landing in ``[lo, hi)``; ``fragment_views`` of them
    are, in order, the places ``dst_index`` names, and ``place`` puts values there and nowhere else."""
    numel = run * runs
    k_first, k_last = min(head, numel - 1), max(0, numel - tail)  # drop a few elements, as a chunk edge would
    f = Fragment(Path("f"), ("flat",), 0, numel, d0, None, run_numel=run, dst_stride=run + gap)
    hi = lo + width
    inside = [k for k in range(numel) if lo <= f.dst_index(k) < hi]
    k0, k1 = f.window(lo, hi)
    assert list(range(k0, k1)) == inside
    k0, k1 = max(k0, k_first), min(k1, max(k_last, k_first))
    base = min(lo, d0)
    arr = np.full(d0 + numel * (run + gap) + 8, -1, dtype=np.int64)
    got = [(k, v.reshape(-1).tolist()) for k, v in fragment_views(arr, f, k0, k1, base)]
    assert [k for ks, vals in got for k in range(ks, ks + len(vals))] == list(range(k0, k1))
    place(np.arange(k0, k1, dtype=np.int64), arr, f, k0, base)
    want = np.full_like(arr, -1)
    for k in range(k0, k1):
        want[f.dst_index(k) - base] = k
    assert arr.tolist() == want.tolist()


def _arange_piece(tmp_path: Path, numel: int, frags: Sequence[tuple[int, ...]]) -> tuple[FileCache, Piece]:
    cache, path = _fake_cache(tmp_path, numel)
    return cache, Piece(Role.MASTER, "float32", tuple(Fragment(path, ("flat",), s, n, d, None, run_numel=r,
                                                               dst_stride=ds, src_stride=ss)
                                                      for s, n, d, r, ds, ss in frags))


# A 4 x 4 target read from a stored 0..39: rows 0-1 take 4 of every 10 stored elements (a TP split: part of each
# source row), rows 2-3 columns 0-1 and 2-3 each strided on both sides, from the far end of the file.
SPLIT = [(1, 8, 0, 4, 4, 10), (30, 4, 8, 2, 4, 3), (35, 4, 10, 2, 4, 3)]
SPLIT_WANT = [1, 2, 3, 4, 11, 12, 13, 14, 30, 31, 35, 36, 33, 34, 38, 39]


@pytest.mark.parametrize("gap_ratio", [3, 0], ids=["span", "per-run"])
@pytest.mark.parametrize("chunk_nbytes", [4, 12, 20, 28, 1 << 20])
def test_source_strided_pieces_are_read_right(tmp_path, monkeypatch, gap_ratio, chunk_nbytes):
    """read_piece and to-fp32's streamed chunks (GatherRead) read fragments strided in the source: one read of the
    span and a strided copy, or (gaps wider than SPAN_GAP_RATIO x the runs) one read per run, with chunk edges
    inside and across runs."""
    from dsckpt import chunks
    from dsckpt.assemble import read_piece
    from dsckpt.chunks import read_chunks

    monkeypatch.setattr(chunks, "SPAN_GAP_RATIO", gap_ratio)
    cache, piece = _arange_piece(tmp_path, 40, SPLIT)
    assert read_piece(piece, (4, 4), cache, name="w").reshape(-1).tolist() == SPLIT_WANT
    reads = plan_piece_chunks(piece, (4, 4), cache, name="w", chunk_nbytes=chunk_nbytes)
    assert reads is not None
    got = [x for _, a in read_chunks(reads, workers=0, chunk_nbytes=chunk_nbytes) for x in a.tolist()]
    assert got == SPLIT_WANT


def test_source_strided_piece_past_the_stored_tensor_is_refused(tmp_path):
    """The bounds check covers the source span (runs and gaps), not ``numel`` elements from ``src_offset``."""
    cache, piece = _arange_piece(tmp_path, 40, [(25, 16, 0, 4, 4, 5)])  # 16 elements, but the span ends at 44
    with pytest.raises(CorruptCheckpointError, match=r"'w' needs elements \[25, 44\)"):
        plan_piece_chunks(piece, (4, 4), cache, name="w")


@pytest.mark.parametrize("start, numel", [(0, 16), (0, 5), (3, 6), (9, 1), (6, 10), (15, 1)])
def test_range_copies_of_strided_fragments(tmp_path, start, numel):
    """The ZeRO writers' copy list of a range: one copy per (partial) run the range meets, in destination order,
    each pointing at the right stored elements (src-strided and dst-strided runs alike)."""
    from dsckpt.ds_writers.plan import range_copies

    _, piece = _arange_piece(tmp_path, 40, SPLIT)
    copies = range_copies(piece, start, numel, 100, "w")
    assert [c.dst_offset for c in copies] == sorted(c.dst_offset for c in copies)
    got = {c.dst_offset + k: c.src_offset + k for c in copies for k in range(c.numel)}
    assert got == {100 + i: SPLIT_WANT[start + i] for i in range(numel)}
    assert len(copies) <= numel


@pytest.mark.parametrize("src_tp, dst_tp", [(2, 4), (4, 2)], ids=["split", "merge"])
def test_rank_view_of_real_slices_reads_the_target_slices(src_tp, dst_tp):
    """Every target TP rank's view of a real AutoTP checkpoint (kv6: q/k/v split by KV heads, row-parallel o_proj and
    down_proj), read through read_piece, the streamed chunks and the ZeRO writers' range copies, equals the full
    tensor cut by the target layout, element for element. Both ways some row-parallel slices are strided in the
    source: TP 2 -> 4 cuts o_proj's 12/12 columns into 8/8/4/4, and TP 4 -> 2 merges 8/8/4/4 into 12/12, so target
    rank 0 takes part of each row of source rank 1."""
    import numpy as np
    import torch

    from dsckpt.assemble import read_piece
    from dsckpt.autotp_widths import read_autotp_meta
    from dsckpt.chunks import read_chunks
    from dsckpt.ds_writers.plan import range_copies
    from dsckpt.readers import read_checkpoint
    from dsckpt.tensor_parallel import rank_view, resize_layout

    root = Path(__file__).parent / "fixtures" / "autotp" / f"autotp_z1_bf16_tp{src_tp}_dp1_kv6" / "ckpt"
    cache = FileCache()
    ckpt = read_checkpoint(root, cache=cache)
    layout = resize_layout(ckpt.tensor_parallel, dst_tp, meta=read_autotp_meta(root, ckpt.ds_config))
    src_strided = 0
    for t in range(dst_tp):
        for e in rank_view(ckpt, layout, t).entries:
            cut = layout.name_to_cut[e.name]
            if e.tied_to is not None or cut.dim is None or cut.kind is SplitKind.REPLICATED:
                continue
            idx = torch.tensor([b.full_index(k) for b in cut.rank_blocks(t) for k in range(b.numel)])
            src = ckpt.entry(e.name)
            for p in e.pieces:
                full = next(q for q in src.pieces if (q.role, q.replica, q.state_key) == (p.role, p.replica, p.state_key))
                want = read_piece(full, src.shape, cache, name=e.name).reshape(-1)[idx]
                src_strided += sum(f.src_strided for f in p.fragments)
                assert read_piece(p, e.shape, cache, name=e.name).reshape(-1).equal(want), (e.name, t, p.label)
                reads = plan_piece_chunks(p, e.shape, cache, name=e.name, chunk_nbytes=64)
                assert reads is not None
                got = np.concatenate([a.copy() for _, a in read_chunks(reads, workers=0, chunk_nbytes=64)])
                raw = want.view(torch.int16) if want.dtype == torch.bfloat16 else want
                assert got.tobytes() == raw.numpy().tobytes(), (e.name, t, p.role)
                for lo in range(0, e.numel, 37):
                    for c in range_copies(p, lo, min(37, e.numel - lo), 0, e.name):
                        stored = cache.tensor(c.file, c.key).read(c.src_offset, c.numel)
                        assert stored.equal(want[lo + c.dst_offset: lo + c.dst_offset + c.numel]), (e.name, t)
    assert src_strided > 0
