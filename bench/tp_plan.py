"""Reshard planning of a tensor-parallel checkpoint at 70B scale: :func:`dsckpt.tensor_parallel.rank_view` for one
target TP rank of a synthetic Llama-70B-shaped TP 8 x ZeRO-2 DP ``--dp`` checkpoint. Pure planning (no files, no
tensor data): the :class:`~dsckpt.model.LogicalCheckpoint` is built from model objects exactly as the TP reader
builds it (each TP rank's ZeRO partitions cut each local flat slice into contiguous local fragments, mapped to full
coordinates by :func:`~dsckpt.tensor_parallel.compose`: one strided fragment per row-parallel slice per partition).

    python bench/tp_plan.py                      # TP 8 -> 8 (kept), 80 layers, DP 8
    python bench/tp_plan.py --target-tp 4        # TP 8 -> 4 (two source runs per target row)
    python bench/tp_plan.py --layers 8 --memory  # peak Python memory of rank_view (tracemalloc, slower)
    python bench/tp_plan.py --plan               # + plan_reshard of all 8 TP ranks at DP 8 and DP 16
    python bench/tp_plan.py --fixtures           # plan + write time of every real TP fixture, output digest

Prints the source fragment count, the fragment count of the rank view (and how many are strided), rank_view's wall
time the process's peak RSS (before and after rank_view) and, with ``--memory``, tracemalloc's peak
during rank_view.
"""
from __future__ import annotations

import argparse
import math
import resource
import time
import tracemalloc
from pathlib import Path

from dsckpt.model import Fragment, Kind, LogicalCheckpoint, Piece, Precision, Role, TensorEntry
from dsckpt.parallel_layout import ParamCut, SplitKind, TpLayout
from dsckpt.tensor_parallel import compose, rank_view

ROLES = ("master", "exp_avg", "exp_avg_sq")  # the optimizer-side copies: the master, then the optimizer states


def _piece(copy: str, dtype: str, frags: tuple[Fragment, ...], replica: int = 0, same_as: int | None = None) -> Piece:
    if copy in ("master", "module"):
        return Piece(Role(copy), dtype, frags, replica, same_as)
    return Piece(Role.OPTIM_STATE, dtype, frags, replica, same_as, state_key=copy)


def llama_params(layers: int, hidden: int, inter: int, heads: int, kv_heads: int, vocab: int
                 ) -> list[tuple[str, tuple[int, ...], SplitKind]]:
    kv = hidden // heads * kv_heads
    out = [("model.embed_tokens.weight", (vocab, hidden), SplitKind.COLUMN)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (hidden, hidden), SplitKind.COLUMN),
                (p + "self_attn.k_proj.weight", (kv, hidden), SplitKind.COLUMN),
                (p + "self_attn.v_proj.weight", (kv, hidden), SplitKind.COLUMN),
                (p + "self_attn.o_proj.weight", (hidden, hidden), SplitKind.ROW),
                (p + "mlp.gate_proj.weight", (inter, hidden), SplitKind.COLUMN),
                (p + "mlp.up_proj.weight", (inter, hidden), SplitKind.COLUMN),
                (p + "mlp.down_proj.weight", (hidden, inter), SplitKind.ROW),
                (p + "input_layernorm.weight", (hidden,), SplitKind.REPLICATED),
                (p + "post_attention_layernorm.weight", (hidden,), SplitKind.REPLICATED)]
    out += [("model.norm.weight", (hidden,), SplitKind.REPLICATED), ("lm_head.weight", (vocab, hidden), SplitKind.COLUMN)]
    return out


def cut_of(name: str, shape: tuple[int, ...], kind: SplitKind, tp: int) -> ParamCut:
    if kind is SplitKind.REPLICATED:
        return ParamCut(name, kind, None, shape, (shape,) * tp)
    dim = 1 if kind is SplitKind.ROW else 0
    assert shape[dim] % tp == 0
    w = shape[dim] // tp
    local = tuple(w if d == dim else s for d, s in enumerate(shape))
    return ParamCut(name, kind, dim, shape, (local,) * tp, ((w,) * tp,))


def build(args: argparse.Namespace) -> tuple[LogicalCheckpoint, TpLayout]:
    params = llama_params(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab)
    tp, dp = args.tp, args.dp
    layout = TpLayout(tp, "autotp", {n: cut_of(n, s, k, tp) for n, s, k in params})
    tag = Path("/synthetic/global_step1")
    frags: dict[str, dict[str, list[Fragment]]] = {n: {r: [] for r in (*ROLES, "module")} for n, _, _ in params}
    files: list[Path] = []
    for s in range(tp):
        model_file = tag / f"mp_rank_{s:02d}_model_states.pt"
        optim = [tag / f"bf16_zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for d in range(dp)]
        files += [model_file, *optim]
        sizes = [math.prod(layout.name_to_cut[n].rank_shapes[s]) for n, _, _ in params]
        part = -(-sum(sizes) // dp)  # ZeRO-2: the flat group cut into dp equal partitions
        offset = 0
        for (name, _, _), n in zip(params, sizes):
            cut = layout.name_to_cut[name]
            blocks = cut.rank_blocks(s)
            local = [Fragment(model_file, ("module", name), 0, n, 0)]
            frags[name]["module"] += local if cut.kind is SplitKind.REPLICATED else \
                [g for f in local for g in compose(f, blocks)]
            pos = offset
            while pos < offset + n:  # this param's elements in each ZeRO partition
                d = pos // part
                end = min(offset + n, (d + 1) * part)
                for r in ROLES:
                    f = Fragment(optim[d], ("state", 0, r), pos - d * part, end - pos, pos - offset, d)
                    frags[name][r] += [f] if cut.kind is SplitKind.REPLICATED else compose(f, blocks)
                pos = end
            offset += n
    entries = []
    for name, shape, kind in params:
        dtypes = {"master": "float32", "exp_avg": "float32", "exp_avg_sq": "float32", "module": "bfloat16"}
        if kind is SplitKind.REPLICATED:  # one copy per TP rank, numbered as combine_tp_ranks numbers them
            pieces = tuple(_piece(r, dtypes[r], (f,), s, 0 if s else None)
                           for r in dtypes for s, f in enumerate(frags[name][r]))
        else:
            pieces = tuple(_piece(r, dtypes[r], tuple(frags[name][r])) for r in dtypes)
        entries.append(TensorEntry(name, shape, Kind.PARAM, True, pieces, group=0))
    ckpt = LogicalCheckpoint(Path("/synthetic"), "global_step1", tag, "zero2", 2, Precision.BF16, dp, 1, tp, "0.19.8",
                             1, 1, 1, "DeepSpeedZeroOptimizer", tuple(entries), tuple(files), tensor_parallel=layout)
    return ckpt, layout


def fixtures() -> None:
    import hashlib
    import tempfile

    from dsckpt.readers import FileCache, read_checkpoint
    from dsckpt.reshard import plan_reshard, read_source_facts, run_reshard

    root = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "autotp"
    cases = [(fx, None) for fx in sorted(root.iterdir()) if (fx / "ckpt").is_dir()]
    cases += [(root / "autotp_z1_bf16_tp2_dp1_kv6", 4), (root / "autotp_z1_bf16_tp4_dp1_kv6", 2)]
    total_plan = total_write = 0.0
    for fx, tp in cases:
        cache = FileCache()
        ckpt = read_checkpoint(fx / "ckpt", cache=cache)
        facts = read_source_facts(ckpt, cache)
        tp_out = tp or ckpt.tp_world_size
        world = tp_out * 2 * max(1, ckpt.dp_world_size)
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            plan = plan_reshard(ckpt, world, facts=facts, tp_size=tp)
            best = min(best, time.perf_counter() - t0)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            run_reshard(plan, Path(tmp) / "o", cache=cache, verify="none", workers=1, fsync=False)
            wrote = time.perf_counter() - t0
            h = hashlib.sha256()
            for f in sorted((Path(tmp) / "o").rglob("*")):
                if f.is_file():
                    h.update(f.relative_to(tmp).as_posix().encode() + f.read_bytes())
        total_plan += best
        total_write += wrote
        print(f"{fx.name:36s} TP {ckpt.tp_world_size} -> {tp_out}, world {world:2d}: plan {best * 1e3:7.1f} ms, "
              f"write {wrote * 1e3:7.1f} ms, sha256 {h.hexdigest()[:16]}")
    print(f"all {len(cases)}: plan {total_plan * 1e3:.0f} ms, write {total_write * 1e3:.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--intermediate", type=int, default=28672)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--target-tp", type=int, default=None, help="plan for this TP size (default: the source's)")
    ap.add_argument("--rank", type=int, default=0, help="the target TP rank planned")
    ap.add_argument("--memory", action="store_true", help="trace peak Python memory of rank_view (slower)")
    ap.add_argument("--plan", action="store_true",
                    help="also time plan_reshard of every TP rank (TP kept, DP kept and doubled)")
    ap.add_argument("--fixtures", action="store_true", help="time reshard of the real TP fixtures instead")
    args = ap.parse_args()
    if args.fixtures:
        fixtures()
        return
    t0 = time.perf_counter()
    ckpt, layout = build(args)
    src_frags = sum(len(p.fragments) for e in ckpt.entries for p in e.pieces)
    src_strided = sum(f.strided for e in ckpt.entries for p in e.pieces for f in p.fragments)
    print(f"source: {len(ckpt.entries)} tensors, TP {args.tp} x DP {args.dp}, {src_frags} fragments "
          f"({src_strided} strided), built in {time.perf_counter() - t0:.1f} s")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    target = layout
    if args.target_tp and args.target_tp != args.tp:
        target = TpLayout(args.target_tp, "autotp", {
            n: cut_of(n, c.full_shape, c.kind, args.target_tp) for n, c in layout.name_to_cut.items()})
    if args.memory:
        tracemalloc.start()
    t0 = time.perf_counter()
    view = rank_view(ckpt, target, args.rank)
    dt = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] if args.memory else None
    tracemalloc.stop()
    n = sum(len(p.fragments) for e in view.entries for p in e.pieces)
    strided = sum(f.strided for e in view.entries for p in e.pieces for f in p.fragments)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
    mem = f", peak traced {peak / 2**20:.1f} MiB" if peak is not None else ""
    mem += f", process peak RSS {rss:.0f} MiB (source model {rss0:.0f} MiB)"
    print(f"rank_view TP {args.tp} -> {target.tp_size} rank {args.rank}: {n} fragments ({strided} strided), "
          f"{dt:.2f} s{mem}")
    if args.plan:
        from dsckpt.ds_writers.facts import derive_facts
        from dsckpt.reshard import plan_reshard

        for world in (args.tp * args.dp, 2 * args.tp * args.dp):
            t0 = time.perf_counter()
            plan = plan_reshard(ckpt, world, facts=derive_facts(ckpt))
            print(f"plan_reshard TP {args.tp} x DP {args.dp} -> TP {plan.tp_size} x DP {plan.world_size}: "
                  f"{time.perf_counter() - t0:.2f} s, process peak RSS "
                  f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB")


if __name__ == "__main__":
    main()
