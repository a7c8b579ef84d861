"""Is the engine's norm rule right on this machine? Ghost norm vs instantiation, per layer shape.

For a clipped layer the engine needs per-sample norms and then Σ_i c_i G_i. Two ways:

    ghost        Gram matrices (L Lᵀ, R Rᵀ; O(T²(m+n))) for the norm, then the clipped sum as
                 one GEMM Lᵀ diag(c) R (O(B·T·m·n), the size of the usual weight gradient)
    instantiate  G_i = L_iᵀ R_i per sample (O(B·T·m·n)), its norm, then Σ_i c_i G_i, a cheap
                 pass over B·m·n numbers; needs G_i in memory until the clip factors are known

Both run here through the engine's own functions (``param_norm_sq``, ``clipped_sum``) on
random factors, timed interleaved, median. The table shows which is faster and what the
engine's time rule (``choose_ghost(..., transient=True)``: instantiate iff m·n ≤ 2T(m+n))
picks for groups clipped right after their layer (layer-wise, param-wise). A second table
times the Gram trick of ``symmetric_ghost`` against the plain product, and the reduction
``batched_dot`` against the bmm form it replaced.

``--strips`` instead times ``symmetric_ghost`` with k = 1, 2, 3, 4, 8 column strips on GPT-2
small's layer shapes (B 4, T 256 and B 2, T 1024; ``--device cuda`` on a GPU), beside the
k the engine picks there (``grams.ghost_strips``) and the engine's own ghost norm timed (with
its panels for a wide factor, ``grams.ghost_panel``): how GHOST_MIN_BLOCK, GHOST_MAX_STRIPS
and the panels were chosen.

    python benchmarks/norm_rule.py            # B 16 and 64, T 16..256, GPT-2-like shapes
    python benchmarks/norm_rule.py --strips   # the strip counts, GPT-2 small's shapes
    python benchmarks/norm_rule.py --traffic  # the parts of one-sample-at-a-time instantiation
    python benchmarks/norm_rule.py --norms    # a LayerNorm's backward, book-kept three ways
    python benchmarks/norm_rule.py --reductions   # sums of squares of one G_i, in cache and out
    python benchmarks/norm_rule.py --smoke    # tiny, one repeat (CI)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dpclip.allocator import keep_freed_memory  # noqa: E402
from dpclip.bench import time_rounds  # noqa: E402
from dpclip.engine import factors, grams  # noqa: E402
from dpclip.engine.sums import sum_of_squares  # noqa: E402
from dpclip.engine.factors import Bilinear, choose_ghost, clipped_sum, param_norm_sq  # noqa: E402
from dpclip.engine.streamed import streamed_clip  # noqa: E402

SHAPES = [(256, 768), (256, 256), (256, 1024), (1024, 256), (64, 64), (1024, 4096)]
MAX_FACTOR_FLOATS = 64 * 256 * 1024   # skip cells whose B·T·n factor is larger (time budget)


def median_ms(fns: dict, repeats: int) -> dict[str, float]:
    """Median milliseconds, interleaved after one warm-up round (dpclip.bench's timer)."""
    return {k: statistics.median(ts) * 1e3 for k, ts in time_rounds(fns, repeats, warmup=1).items()}


def rule_rows(batches, seqs, shapes, repeats: int) -> list[dict]:
    rows = []
    for b in batches:
        for t in seqs:
            for m, n in shapes:
                if b * t * max(m, n) > MAX_FACTOR_FLOATS:
                    continue
                gen = torch.Generator().manual_seed(t * 7 + m)
                use = Bilinear(torch.randn(b, 1, t, m, generator=gen),
                               torch.randn(b, 1, t, n, generator=gen))
                shape = torch.Size([m, n])
                c = torch.rand(b, generator=gen)

                def ghost():
                    _, parts = param_norm_sq([use], shape, "ghost", transient=True)
                    clipped_sum(parts, c, shape)

                def streamed(one_at_a_time=None):   # the engine's instantiation of a transient group
                    return lambda: streamed_clip([use], [shape], torch.zeros(b), lambda norms, rows: c[rows],
                                                 one_at_a_time=one_at_a_time)

                ms = median_ms({"ghost": ghost, "instantiate": streamed(), "chunks": streamed(False)}, repeats)
                ms = {"ghost": ms["ghost"], "instantiate": ms["instantiate"], "chunks": ms["chunks"]}
                rule = "ghost" if choose_ghost(use, "auto", transient=True) else "instantiate"
                faster = min(("ghost", "instantiate"), key=ms.get)
                rows.append({"B": b, "T": t, "m": m, "n": n, **ms, "rule": rule, "faster": faster,
                             "loss": ms[rule] / ms[faster]})
    return rows


def gram_rows(seqs, shapes, batch: int, repeats: int) -> list[dict]:
    rows = []
    for t in seqs:
        for m, n in shapes[:3]:
            gen = torch.Generator().manual_seed(t)
            left = torch.randn(batch, 1, t, m, generator=gen)
            right = torch.randn(batch, 1, t, n, generator=gen)
            gl, gr = left @ left.transpose(-1, -2), right @ right.transpose(-1, -2)
            flat = gl.reshape(batch, -1), gr.reshape(batch, -1)

            def plain():
                g1 = left @ left.transpose(-1, -2)
                g2 = right @ right.transpose(-1, -2)
                return factors.batched_dot(g1, g2)

            def bmm_dot():
                return torch.bmm(flat[0].unsqueeze(1), flat[1].unsqueeze(2))

            ms = median_ms({"plain Grams": plain, "symmetric": lambda: factors.ghost_norm_sq(left, right),
                            "vecdot": lambda: factors.batched_dot(*flat), "bmm dot": bmm_dot}, repeats)
            rows.append({"T": t, "m": m, "n": n, **ms})
    return rows


GPT2_SMALL = {"attn.c_attn": (768, 2304), "attn.c_proj": (768, 768), "mlp.c_fc": (768, 3072),
              "mlp.c_proj": (3072, 768), "lm_head": (768, 50257)}
STRIPS = (1, 2, 3, 4, 8)


def strip_rows(configs, shapes: dict, device: str, repeats: int) -> list[dict]:
    """Milliseconds of one ghost norm per strip count, per (B, T) and layer shape."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for b, t in configs:
        for name, (m, n) in shapes.items():
            gen = torch.Generator().manual_seed(t + m)
            left = torch.randn(b, 1, t, m, generator=gen).to(device)
            right = torch.randn(b, 1, t, n, generator=gen).to(device)
            fns = {k: (lambda k=k: factors.symmetric_ghost(left, right, False, strips=k)) for k in STRIPS}
            fns["engine"] = lambda: factors.symmetric_ghost(left, right, False)   # its own k, panels
            ms = {k: statistics.median(ts) * 1e3
                  for k, ts in time_rounds(fns, repeats, warmup=1, sync=sync).items()}
            wide = t * max(m, n) * 4
            panel = grams.ghost_panel(t, torch.device(device), wide)
            rows.append({"B": b, "T": t, "layer": name, "ms": ms,
                         "engine": f"{factors.ghost_strips(t, torch.device(device), wide)}"
                                   + (f"/p{panel}" if panel else "")})
    return rows


def traffic_rows(b: int, t: int, shapes: dict, repeats: int) -> list[dict]:
    """Where one-sample-at-a-time instantiation spends its time, per GPT-2 small block weight:
    the weight gradient's one GEMM against the B per-sample matmuls (the same multiply), the
    B norms of G_i (the engine's blocked sums, dpclip/engine/sums.py, and the whole-row
    reduction they replaced) and the B scaled adds c_i G_i (passes over memory a flop count
    cannot see); beside them, Σ_i c_i G_i as one product c·[G_1; ...; G_B] (every G_i held
    at once: each read once, the sum written once) and the ghost norm the other path takes
    instead of the instantiation (``symmetric_ghost``, the engine's strips)."""
    rows = []
    for name, (m, n) in shapes.items():
        gen = torch.Generator().manual_seed(m + n)
        left, right = torch.randn(b, t, m, generator=gen), torch.randn(b, t, n, generator=gen)
        buf, total, c = torch.empty(m, n), torch.zeros(m, n), torch.tensor([0.5])
        held, weights = torch.randn(b, m * n, generator=gen), torch.full((1, b), 0.5)
        fns = {"weight gradient": lambda: left.reshape(-1, m).t() @ right.reshape(-1, n),
               "B matmuls": lambda: [torch.mm(left[i].t(), right[i], out=buf) for i in range(b)],
               "B norms": lambda: [sum_of_squares(buf.unsqueeze(0)) for _ in range(b)],
               "whole-row norms": lambda: [torch.linalg.vector_norm(buf) for _ in range(b)],
               "B scaled adds": lambda: [total.addcmul_(buf, c) for _ in range(b)],
               "one product": lambda: torch.mm(weights, held, out=total.view(1, -1)),
               "ghost norm": lambda: grams.symmetric_ghost(left.unsqueeze(1), right.unsqueeze(1), False)}
        rows.append({"layer": name, **median_ms(fns, repeats)})
    return rows


def reduction_rows(sizes: dict, repeats: int) -> list[dict]:
    """Σ x² of one per-sample gradient, the engine's way (``sum_of_squares``: vector_norm over
    blocks of 128) beside other blocked reductions with the same rounding bound, and beside
    one whole-row ``torch.dot`` (no such bound: docs/formulas.md, "Rounding of a norm"), on a
    G_i that fits in L2 and one that does not. If the engine's form runs at the same GB/s on
    both, it is bound by its arithmetic, and forming G_i in cache-sized panels would not
    make its norm cheaper."""
    rows = []
    for label, (m, n) in sizes.items():
        x = torch.randn(m * n)
        blocks, scratch, ones = x.view(-1, 128), torch.empty(m * n), torch.ones(128)
        fns = {"sum_of_squares": lambda: sum_of_squares(x.view(1, -1)),
               "vecdot blocks": lambda: torch.linalg.vecdot(blocks, blocks),
               "square().sum": lambda: blocks.square().sum(-1),
               "mul + mv": lambda: torch.mv(torch.mul(x, x, out=scratch).view(-1, 128), ones),
               "dot (unbounded)": lambda: torch.dot(x, x)}
        ms = median_ms(fns, repeats)
        rows.append({"G_i": f"{label} {m}x{n}", "MiB": m * n * 4 / 2**20,
                     **{k: (v, m * n * 4 / v / 1e6) for k, v in ms.items()}})
    return rows


def print_strips(rows: list[dict]) -> None:
    print("ghost norm (ms) by column strips k (each strip reads the whole factor); engine = the "
          "engine's own choice, timed: its k (grams.ghost_strips), /pN where a wide factor is "
          "read in panels of N columns (grams.ghost_panel)")
    keys = STRIPS + ("engine",)
    print(f"{'B x T':>9}  {'layer':<12}" + "".join(f"{'k=' + str(k):>9}" for k in STRIPS)
          + f"{'engine':>9}{'k':>8}")
    for r in rows:
        print(f"{str(r['B']) + ' x ' + str(r['T']):>9}  {r['layer']:<12}"
              + "".join(f"{r['ms'][k]:>9.2f}" for k in keys) + f"{r['engine']:>8}")
    totals = {k: sum(r["ms"][k] * (1 if r["layer"] == "lm_head" else 12) for r in rows) for k in keys}
    print("per step, 12 blocks + lm_head, all shapes above: "
          + ", ".join(f"k={k} {v:.1f} ms" for k, v in totals.items()))


def layernorm_rows(configs, d: int, repeats: int) -> list[dict]:
    """A LayerNorm's backward book-kept three ways, ms: the fused backward once per sample
    (input gradient, Σ_t gy ⊙ x̂ and Σ_t gy in one pass; the engine on the CPU), the batch's
    fused input gradient then x̂ and the two sums (off the CPU), and the two-step path
    (autograd's normalisation backward, then the affine's input gradient, x̂'s product and
    the sums; half precision)."""
    from torch import nn

    from dpclip.engine.layers.norm import AffineNormRule, LayerNormRule

    rows = []
    for b, t in configs:
        gen = torch.Generator().manual_seed(b * t)
        norm = nn.LayerNorm(d)
        x = torch.randn(b, t, d, generator=gen)
        gy = torch.randn(b, t, d, generator=gen)
        rule, two_step = LayerNormRule(), AffineNormRule()
        _, info = rule.prepare(norm, x, None)   # the fused path's statistics
        rule.forward(norm, x, info)
        xin = x.clone().requires_grad_()
        xhat = rule.normalise(norm, xin)

        def per_sample():   # the rule's own backward: per sample on the CPU
            rule.input_grad(norm, x, gy, info)
            rule.uses(norm, x, gy, info)

        def batched():
            torch.ops.aten.native_layer_norm_backward(gy, x, (d,), info.mean, info.rstd, norm.weight,
                                                      norm.bias, [True, False, False])
            _, fresh = rule.prepare(norm, x, None)
            fresh.mean, fresh.rstd = info.mean, info.rstd
            rule.uses(norm, x, gy, fresh)

        def two_step_path():
            grad_xhat = two_step.input_grad(norm, xhat.detach(), gy, None)
            torch.autograd.grad(xhat, xin, grad_xhat, retain_graph=True)
            two_step.uses(norm, xhat.detach(), gy, None)

        with torch.no_grad():
            ms = median_ms({"per sample (CPU)": per_sample, "batched": batched}, repeats)
        ms.update(median_ms({"two-step": two_step_path}, repeats))
        rows.append({"B": b, "T": t, **ms})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--strips", action="store_true", help="time the strip counts of the symmetric Grams")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--traffic", action="store_true",
                    help="time the parts of one-sample-at-a-time instantiation (GPT-2 small, B 4, T 256)")
    ap.add_argument("--norms", action="store_true",
                    help="time a LayerNorm's backward, book-kept three ways (GPT-2 small's width)")
    ap.add_argument("--reductions", action="store_true",
                    help="time sums of squares of one G_i in L2-sized and larger buffers")
    args = ap.parse_args(argv)
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    if args.norms:
        configs, d = ([(4, 256), (2, 1024)], 768) if not args.smoke else ([(2, 8)], 16)
        rows = layernorm_rows(configs, d, 1 if args.smoke else args.repeats)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; LayerNorm({d}) backward "
              "and per-sample gradients, median ms")
        cols = [k for k in rows[0] if k not in ("B", "T")]
        print(f"{'B x T':>9}" + "".join(f"{k:>18}" for k in cols))
        for r in rows:
            print(f"{str(r['B']) + ' x ' + str(r['T']):>9}" + "".join(f"{r[k]:>18.3f}" for k in cols))
        return
    if args.reductions:
        sizes = {"in L2": (768, 256), "beyond L2": (768, 3072)} if not args.smoke else {"tiny": (4, 64)}
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median ms (GB/s read)")
        rows = reduction_rows(sizes, 1 if args.smoke else args.repeats)
        cols = [k for k in rows[0] if k not in ("G_i", "MiB")]
        print(f"{'G_i':<22}{'MiB':>6}" + "".join(f"{k:>20}" for k in cols))
        for r in rows:
            print(f"{r['G_i']:<22}{r['MiB']:>6.2f}"
                  + "".join(f"{r[k][0]:>12.4f} ({r[k][1]:>5.1f})" for k in cols))
        return
    if args.traffic:
        shapes = {k: v for k, v in GPT2_SMALL.items() if k != "lm_head"}
        b, t = (4, 256) if not args.smoke else (2, 8)
        rows = traffic_rows(b, t, shapes, 1 if args.smoke else args.repeats)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; B {b}, T {t}; median ms")
        cols = [k for k in rows[0] if k != "layer"]
        print(f"{'layer':<12}" + "".join(f"{k:>17}" for k in cols))
        for r in rows:
            print(f"{r['layer']:<12}" + "".join(f"{r[k]:>17.2f}" for k in cols))
        return
    if args.strips:
        configs, shapes = [(4, 256), (2, 1024)], GPT2_SMALL
        if args.smoke:
            configs, shapes, args.repeats = [(2, 64)], {"tiny": (8, 12)}, 1
        print(f"torch {torch.__version__}, {args.device}, median of {args.repeats}")
        print_strips(strip_rows(configs, shapes, args.device, args.repeats))
        return
    batches, seqs, shapes = [16, 64], [16, 32, 64, 128, 256], SHAPES
    gpt2 = [((4,), (256,)), ((2,), (1024,))]   # GPT-2 small's block weights at the table's shapes
    if args.smoke:
        batches, seqs, shapes, args.repeats, gpt2 = [2], [4, 64], [(8, 12)], 1, []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats}, ms")
    print("\nghost path vs instantiate path (norm + clipped sum; instantiate = the engine's streamed_clip,\n"
          "one sample at a time on the CPU; chunks = its batched chunks, as on other devices);\n"
          "rule = time rule for transient groups")
    print(f"{'B':>4}{'T':>5}{'m x n':>12}{'ghost':>10}{'inst':>10}{'chunks':>10}  {'rule':<12}{'faster':<12}"
          f"{'rule/best':>9}")
    rows = rule_rows(batches, seqs, shapes, args.repeats)
    gpt2_shapes = [shape for name, shape in GPT2_SMALL.items() if name != "lm_head"]
    for b, t in gpt2:
        rows += rule_rows(b, t, gpt2_shapes, args.repeats)
    for r in rows:
        print(f"{r['B']:>4}{r['T']:>5}{str(r['m']) + 'x' + str(r['n']):>12}{r['ghost']:>10.2f}"
              f"{r['instantiate']:>10.2f}{r['chunks']:>10.2f}  {r['rule']:<12}{r['faster']:<12}{r['loss']:>9.2f}")
    agree = sum(r["rule"] == r["faster"] for r in rows)
    worst = max(rows, key=lambda r: r["loss"])
    print(f"\nrule picked the faster path in {agree} of {len(rows)} cells; worst cell "
          f"B {worst['B']} T {worst['T']} {worst['m']}x{worst['n']}: {worst['loss']:.2f}x the faster path")
    print("\nGram trick and reduction (B 16): plain Grams vs symmetric strips; bmm vs vecdot dot")
    print(f"{'T':>5}{'m x n':>12}{'plain':>10}{'symm':>10}{'bmm dot':>10}{'vecdot':>10}")
    for r in gram_rows(seqs, shapes, 2 if args.smoke else 16, args.repeats):
        print(f"{r['T']:>5}{str(r['m']) + 'x' + str(r['n']):>12}{r['plain Grams']:>10.2f}"
              f"{r['symmetric']:>10.2f}{r['bmm dot']:>10.2f}{r['vecdot']:>10.2f}")


if __name__ == "__main__":
    main()
