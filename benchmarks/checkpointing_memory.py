"""What gradient checkpointing saves in the private step: peak memory and time, with and without
it, private and not, each in a fresh process (docs/performance.md, "Gradient checkpointing").

GPT-2 small (random weights, 124M parameters), B 4, T 256 by default, dropout 0, layer-wise
clipping, noise 0 (so the private gradients of the two runs can be compared). A child process
runs one step first (the certificate's checked step for the private runs), returns the memory it
freed to the system (glibc's malloc_trim), then measures the peak RSS rise of the next step
(dpclip.bench.step_memory_mib) and its time, and saves that step's
gradients; the parent prints the table, the largest relative gradient difference between the
runs without checkpointing and with it (non-reentrant, reentrant), and one JSON line.

    python benchmarks/checkpointing_memory.py              # GPT-2 small, B 4, T 256
    python benchmarks/checkpointing_memory.py --smoke      # tiny sizes (CI)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def child(spec: dict) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    import dpclip
    from dpclip.bench import step_memory_mib
    from dpclip.engine import DPEngine

    dpclip.configure_speed()
    cfg = GPT2Config(n_layer=spec["layers"], n_embd=spec["embd"], n_head=max(1, spec["embd"] // 64),
                     vocab_size=spec["vocab"], n_positions=spec["seq"], bos_token_id=0, eos_token_id=0,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).train()
    if spec["checkpointing"]:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": spec["checkpointing"] == "reentrant"})
    ids = torch.randint(0, spec["vocab"], (spec["batch"], spec["seq"]))
    engine = DPEngine(model, {"grouping": "layer"}, gradient_noise_multiplier=0.0,
                      expected_batch_size=spec["batch"]) if spec["private"] else None

    def step() -> None:
        model.zero_grad(set_to_none=True)
        logits = model(ids, use_cache=False).logits[:, :-1]
        losses = F.cross_entropy(logits.reshape(-1, spec["vocab"]), ids[:, 1:].reshape(-1),
                                 reduction="none").view(spec["batch"], -1).mean(1)
        if engine is None:
            losses.mean().backward()
        else:
            engine.backward(losses)
            engine.privatize()

    step()   # the first (checked) step, and the allocator's warm-up
    if engine is not None:
        engine.reset_peak()
    # what the warm-up freed goes back to the system, so that the next step's peak shows as a rise
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    start = time.perf_counter()
    mib = step_memory_mib(step, steps=1)
    seconds = time.perf_counter() - start
    torch.save({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, spec["grads"])
    stash = 0.0 if engine is None else engine.stash_bytes_peak / 2**20
    print(json.dumps({"mib": mib, "seconds": seconds, "stash_mib": stash}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.smoke:
        args.layers, args.embd, args.vocab, args.seq, args.batch = 2, 32, 64, 8, 3
    rows, grads = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for private in (False, True):
            for checkpointing in (None, "non-reentrant", "reentrant"):
                how = {None: "", "non-reentrant": ", checkpointing", "reentrant": ", reentrant checkpointing"}
                name = f"{'private' if private else 'non-private'}{how[checkpointing]}"
                spec = {"layers": args.layers, "embd": args.embd, "vocab": args.vocab, "seq": args.seq,
                        "batch": args.batch, "private": private, "checkpointing": checkpointing,
                        "grads": str(Path(tmp) / f"{private}-{checkpointing}.pt")}
                out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                                     text=True, check=True)
                rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
                grads[name] = torch.load(spec["grads"])
    differs = {}
    for kind in ("non-private", "private"):
        for how in ("checkpointing", "reentrant checkpointing"):
            a, b = grads[kind], grads[f"{kind}, {how}"]
            differs[f"{kind}, {how}"] = max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30))
                                            for n in a)
    print(f"GPT-2 ({args.layers} layers, d {args.embd}), B {args.batch}, T {args.seq}, threads "
          f"{torch.get_num_threads()}: peak RSS rise of one step, and its time")
    for name, row in rows.items():
        print(f"  {name:<36} {row['mib']:8.0f} MiB  {row['seconds']:6.2f} s")
    for name, diff in differs.items():
        kind, how = name.split(", ")
        with_it, without = rows[name], rows[kind]
        kept = f"{with_it['mib'] / without['mib']:.2f}x" if without["mib"] > 0 else "n/a (no rise measured)"
        print(f"  {kind}: {how} keeps {kept} of the memory, takes {with_it['seconds'] / without['seconds']:.2f}x "
              f"the time; largest relative gradient difference {diff:.1e}")
    print(json.dumps({"sizes": vars(args), "rows": rows, "gradient_difference": differs}))


if __name__ == "__main__":
    main()
