"""What the certificate costs: a checked private step against unchecked ones, in one process.

GPT-2 small (random weights, 124M parameters) at B 4, T 256 by default, layer-wise clipping.
Per repeat, one step with the check due (a fresh family: the certificate is reset), one
without and one with a new batch size's one-row check (docs/certificate.md), interleaved, so
drifting machine load hits them alike; the medians, their ratios and the check's mode are
printed, plus one JSON line (docs/performance.md, "The certificate").

    python benchmarks/certificate_cost.py                 # GPT-2 small, B 4, T 256, dropout 0.1
    python benchmarks/certificate_cost.py --dropout 0     # the check's "alone" mode
    python benchmarks/certificate_cost.py --smoke         # tiny sizes (CI)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import dpclip
from dpclip.engine import DPEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--grouping", default="layer")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.embd, args.vocab, args.seq, args.batch, args.repeats = 2, 32, 64, 8, 3, 1
    dpclip.configure_speed()
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=args.layers, n_embd=args.embd, n_head=max(1, args.embd // 64), vocab_size=args.vocab,
                     n_positions=args.seq, bos_token_id=0, eos_token_id=0, resid_pdrop=args.dropout,
                     embd_pdrop=args.dropout, attn_pdrop=args.dropout)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    engine = DPEngine(model, {"grouping": args.grouping}, gradient_noise_multiplier=1.0,
                      expected_batch_size=args.batch)

    def step() -> float:
        start = time.perf_counter()
        logits = model(ids).logits[:, :-1]
        losses = F.cross_entropy(logits.reshape(-1, args.vocab), ids[:, 1:].reshape(-1),
                                 reduction="none").view(args.batch, -1).mean(1)
        engine.backward(losses)
        engine.privatize()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step()   # the first step also probes the batch axes: not timed
    checked, plain, sized, modes = [], [], [], []
    for _ in range(args.repeats):
        engine.certificate.reset()
        checked.append(step())
        modes.append(engine.certificate.last.mode)
        plain.append(step())
        engine.certificate.sizes.clear()   # the family checked, its batch size not: the one-row check
        sized.append(step())
        assert engine.certificate.last.rows == 1
    result = {"layers": args.layers, "embd": args.embd, "vocab": args.vocab, "seq": args.seq,
              "batch": args.batch, "dropout": args.dropout, "grouping": args.grouping,
              "threads": torch.get_num_threads(), "checked_s": statistics.median(checked),
              "unchecked_s": statistics.median(plain), "new_size_s": statistics.median(sized), "mode": modes[-1]}
    result["ratio"] = result["checked_s"] / result["unchecked_s"]
    result["new_size_ratio"] = result["new_size_s"] / result["unchecked_s"]
    print(f"checked step {result['checked_s']:.2f} s, unchecked {result['unchecked_s']:.2f} s: "
          f"{result['ratio']:.2f}x (mode {result['mode']}, {args.repeats} repeats); a new batch size's "
          f"one-row check {result['new_size_s']:.2f} s: {result['new_size_ratio']:.2f}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
