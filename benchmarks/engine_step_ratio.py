"""DP / non-DP step-time ratio of dpclip's engine on a small GPT-2 (docs/performance.md setting).

A non-private step (forward, mean loss, backward, SGD step) and private steps (forward,
per-sample losses, engine.backward, engine.privatize, SGD step) for each grouping are
timed interleaved in one process (A B C A B C ...), so drifting machine load hits all of
them alike; the medians and their ratios are printed, plus one JSON line.

    python benchmarks/engine_step_ratio.py              # GPT-2 4 layers, d 256, V 1024, T 128, B 16
    python benchmarks/engine_step_ratio.py --smoke      # tiny sizes, 1 repeat (CI)

A step with tiny layers is all host work: ``--layers 12 --embd 16 --vocab 64 --seq 4 --batch
2 --threads 1`` times what a GPU's host does per step for GPT-2 small's 148 parameters, less
the launches. ``--count-ops`` also counts the tensor operations of one step of each (aten
operations that are not views: on a GPU each is a kernel launch), a number that does not
depend on the machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F


def build_model(layers: int, embd: int, vocab: int, seq: int, device: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=embd, n_head=max(1, embd // 64), vocab_size=vocab,
                     n_positions=seq, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).to(device)


def per_sample_loss(model, ids):
    logits = model(input_ids=ids, use_cache=False).logits
    tok = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    return tok.mean(1)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--groupings", nargs="+", default=["all-layer", "layer"])
    ap.add_argument("--norm-method", default="auto", choices=["auto", "ghost", "instantiate"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repeat, no warm-up")
    ap.add_argument("--count-ops", action="store_true",
                    help="also count the non-view aten operations of one step of each")
    args = ap.parse_args(argv)
    from dpclip.allocator import keep_freed_memory

    keep_freed_memory()  # as the dpclip command does (see dpclip/allocator.py)
    if args.smoke:
        args.layers, args.embd, args.vocab, args.seq, args.batch = 1, 32, 64, 16, 4
        args.repeats, args.warmup = 1, 0

    from dpclip.engine import DPEngine

    torch.set_num_threads(args.threads)
    base = build_model(args.layers, args.embd, args.vocab, args.seq, args.device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)

    runners = {}
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def nondp_step(model=model, opt=opt):
        per_sample_loss(model, ids).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    runners["non-DP"] = nondp_step
    for grouping in args.groupings:
        m = copy.deepcopy(base)
        o = torch.optim.SGD(m.parameters(), lr=1e-4)
        engine = DPEngine(m, {"grouping": grouping, "norm_method": args.norm_method},
                          gradient_noise_multiplier=1.0, expected_batch_size=args.batch, seed=0)

        def dp_step(m=m, o=o, engine=engine):
            engine.backward(per_sample_loss(m, ids))
            engine.privatize()
            o.step()
            o.zero_grad(set_to_none=True)

        runners[f"DP {grouping}"] = dp_step

    for _ in range(args.warmup):
        for run in runners.values():
            run()
    times = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            sync(args.device)
            t0 = time.perf_counter()
            run()
            sync(args.device)
            times[name].append(time.perf_counter() - t0)

    med = {name: statistics.median(ts) for name, ts in times.items()}
    ref = med["non-DP"]
    ops = {name: count_ops(run) for name, run in runners.items()} if args.count_ops else None
    result = {
        "setting": {k: getattr(args, k) for k in ("layers", "embd", "vocab", "seq", "batch",
                                                    "threads", "repeats", "norm_method", "device")},
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
        "median_s": med,
        "ratio": {name: t / ref for name, t in med.items()},
    }
    if ops is not None:
        result["ops_per_step"] = ops
    print(f"GPT-2 {args.layers} layers, n_embd {args.embd}, vocab {args.vocab}, T {args.seq}, "
          f"B {args.batch}, {args.threads} threads, {args.repeats} interleaved repeats "
          f"(median), device {args.device}")
    print(f"{'step':<18}{'median s':>10}{'ratio':>8}" + (f"{'ops':>8}" if ops else ""))
    for name, t in med.items():
        print(f"{name:<18}{t:>10.4f}{t / ref:>8.2f}" + (f"{ops[name]:>8}" if ops else ""))
    print(json.dumps(result))
    return result


# aten operations that only make views (no kernel on any device)
VIEW_OPS = {"view", "_unsafe_view", "slice", "transpose", "expand", "select", "unsqueeze", "squeeze",
            "squeeze_", "t", "diagonal", "detach", "reshape", "split", "alias", "permute", "as_strided",
            "unbind", "lift_fresh", "promote_types"}


def count_ops(run) -> int:
    """Non-view aten operations of one call of ``run``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] not in VIEW_OPS:
                Count.count += 1
            return func(*args, **(kwargs or {}))

    with Count():
        run()
    return Count.count


if __name__ == "__main__":
    main()
