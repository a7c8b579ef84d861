"""What a private step costs on a tiny Mixtral and a tiny Mamba, against the non-private step
(docs/performance.md, "Mixture-of-experts and Mamba").

The models of recipes/mixtral-tiny-text.yaml and recipes/mamba-tiny-text.yaml (random weights,
vocabulary 259, train mode, no generation cache), B 64, T 48 by default: one process, every
method timed interleaved (A B C A B C ...) after warm-up rounds (the first private step probes
the model and runs the certificate's check), the median step and the median over rounds of the
ratio to non-private. Step = forward, loss, backward, SGD step; private: per-sample losses,
engine.backward, engine.privatize (abadi, threshold 1, σ 1, norm_method auto). Mixtral runs
with transformers' default experts kernel and with its eager loop.

    python benchmarks/moe_ssm_cost.py                # the table of docs/performance.md
    python benchmarks/moe_ssm_cost.py --smoke        # tiny sizes, one round (CI)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
import torch.nn.functional as F

import dpclip
from dpclip.bench import round_ratios, time_rounds
from dpclip.engine import DPEngine

VOCAB = 259   # the byte tokenizer's


def build(name: str, smoke: bool):
    import transformers as tf
    width = 16 if smoke else 64
    if name.startswith("mixtral"):
        model = tf.MixtralForCausalLM(tf.MixtralConfig(
            vocab_size=VOCAB, num_hidden_layers=2, hidden_size=width, intermediate_size=width,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=64))
        if name.endswith("eager"):
            model.set_experts_implementation("eager")
    else:
        model = tf.MambaForCausalLM(tf.MambaConfig(vocab_size=VOCAB, num_hidden_layers=2, hidden_size=width,
                                                   state_size=8, expand=2, conv_kernel=4))
    model.config.use_cache = False
    return model.train()


def steps_for(name: str, batch: int, seq: int, smoke: bool) -> dict:
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))
    steps = {}
    for method in ("non-private", "dpclip all-layer", "dpclip layer"):
        torch.manual_seed(0)
        model = build(name, smoke)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        engine = None if method == "non-private" else DPEngine(
            model, {"grouping": method.split()[1], "threshold": {"kind": "fixed", "value": 1.0}},
            gradient_noise_multiplier=1.0, expected_batch_size=batch)

        def step(model=model, opt=opt, engine=engine) -> None:
            opt.zero_grad(set_to_none=True)
            logits = model(input_ids=ids).logits[:, :-1]
            losses = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)
            if engine is None:
                losses.mean().backward()
            else:
                engine.backward(losses)
                engine.privatize()
            opt.step()
        steps[method] = step
    return steps


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:
        args.batch, args.seq, args.repeats, args.warmup = 3, 6, 1, 1
    dpclip.configure_speed()
    rows = {}
    for name in ("mixtral", "mixtral-eager", "mamba"):
        times = time_rounds(steps_for(name, args.batch, args.seq, args.smoke), args.repeats, args.warmup)
        ratios = round_ratios(times, "non-private")
        rows[name] = {m: {"median_s": statistics.median(ts), "ratio": ratios[m]} for m, ts in times.items()}
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; B {args.batch}, T {args.seq}; {args.repeats} interleaved rounds "
          f"after {args.warmup} warm-up, median")
    print("| model | method | median step (s) | ratio to non-private (quartiles) |")
    print("|---|---|---|---|")
    labels = {"mixtral": "Mixtral (grouped_mm experts)", "mixtral-eager": "Mixtral (eager experts)",
              "mamba": "Mamba"}
    for name, methods in rows.items():
        for method, row in methods.items():
            r, q1, q3 = row["ratio"]
            print(f"| {labels[name]} | {method} | {row['median_s']:.3f} | {r:.2f}x ({q1:.2f}-{q3:.2f}) |")
    print(json.dumps({"sizes": vars(args), "rows": rows}))
    return rows


if __name__ == "__main__":
    main()
