"""What each spawned rank runs in tests/distributed/test_fsdp_engine.py and
tests/privacy/test_fsdp_noise.py: DPEngine on a model sharded with FSDP2 (``fully_shard``)
over gloo ranks (docs/distributed.md, "Sharded training"). Importable by name: spawn pickles
the rank's function by reference.

Every rank builds the same tiny float64 model (fixed torch seed), computes the one-process
reference itself (a second copy, the whole batch, a plain DPEngine) and compares it with the
whole gradient of the sharded one (``p.grad.full_tensor()``, a collective). Each sharded
forward and backward is a collective, so no rank may leave the loop early: a case's failure
is recorded (not raised) and the loop goes on; rank 0 writes what every rank found to
``out/<name>.json`` (or ``.pt``), and the tests assert on it.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from dpclip.distributed.sharded import ShardReducer, Shards, lockstep_micro_batches, shard_rows
from dpclip.engine import DPEngine
from tests.distributed.engine_case import CLIPPING as ENGINE_CLIPPING
from tests.engine.conftest import bert_batch, bert_loss, gpt2_batch, gpt2_loss, run_engine, tiny_bert, tiny_gpt2


def tiny_llama():
    """Llama (RMSNorm through the torch.func rule, rotary, grouped-query attention, untied
    head) from a random config, float64, no dropout (as tests/engine/zoo/hf.py's, with
    gpt2_batch's vocabulary)."""
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=False,
        attn_implementation="eager")).double()


def llama_loss(model, batch):
    ids = batch["ids"]
    logits = model(input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


MODELS = {
    "gpt2": (tiny_gpt2, gpt2_loss, gpt2_batch),     # tied embedding/head (one parameter, two uses)
    "llama": (tiny_llama, llama_loss, gpt2_batch),
    "bert": (tiny_bert, bert_loss, bert_batch),
}
GROUPINGS = {"all-layer": "all-layer", "layer": "layer", "param": "param", "block": "block",
             "uniform3": {"uniform": 3}}

# Examples per rank and micro-batch (contiguous rows of the batch, in rank order); a rank with
# fewer micro-batches than the busiest one runs padded backwards (samples=0) for the rest. The
# split with a rank that holds no example runs last: were it to fail on one rank only, the
# ranks' collectives would no longer pair up, and the cases after it could not run.
SPLITS = {
    2: {"uneven": [[4], [1]],                           # batch 5
        "accumulate": [[2, 1], [2]],                    # rank 1: one micro-batch and a padded one
        "rank-without-examples": [[5], []]},
    4: {"uneven": [[4], [3], [2], [1]],                 # batch 10
        "accumulate": [[2, 1], [2], [1, 2], [2]],
        "rank-without-examples": [[4], [3], [3], []]},
}


def batch_size(size: int) -> int:
    return sum(sum(counts) for counts in SPLITS[size]["uneven"])


def take(batch: dict, idx) -> dict:
    idx = torch.as_tensor(list(idx), dtype=torch.long)
    return {k: v[idx] for k, v in batch.items()}


def micro_batches(split: list[list[int]], rank: int) -> list[list[int]]:
    """This rank's micro-batches (row indices) of ``split``."""
    start = sum(sum(counts) for counts in split[:rank])
    out = []
    for count in split[rank]:
        out.append(list(range(start, start + count)))
        start += count
    return out


def median_thresholds(make, loss_fn, batch, grouping) -> list[float]:
    """Per group, a threshold halfway between the two middle norms of the examples: about half
    the examples are clipped in every group (so a wrong per-example norm shows in the clipped
    sum), and none sits on the threshold, where round-off could flip its count as clipped."""
    model = make()
    engine, _ = run_engine(model, loss_fn, batch, {"grouping": grouping, "threshold": {"kind": "fixed", "value": 1e9}},
                           batch["ids"].shape[0])
    norms = torch.cat(engine.observed_norms).sort(0).values
    engine.detach()
    middle = norms.shape[0] // 2
    return ((norms[middle - 1] + norms[middle]) / 2).clamp_min(1e-12).tolist()


def one_process(make, loss_fn, batch, clipping, n, steps=1, **kw):
    """The reference: the whole batch through a plain DPEngine; per step, the grads by name and the report."""
    model = make()
    engine = DPEngine(model, clipping, gradient_noise_multiplier=kw.pop("sigma", 0.0), expected_batch_size=n, **kw)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    out = []
    for _ in range(steps):
        engine.backward(loss_fn(model, batch))
        report = engine.privatize()
        out.append(({name: p.grad.detach().clone() for name, p in model.named_parameters()}, report))
        optimizer.step()
    engine.detach()
    return out


def sharded(world, make, loss_fn, batch, clipping, n, *, sigma=0.0, seed=None):
    """The model sharded over the ranks and its engine, as docs/distributed.md sets them up:
    Shards before the engine, the whole model certified (which probes its batch axes), then fully_shard."""
    model = make()
    shards = Shards(model, world)
    engine = DPEngine(model, clipping, gradient_noise_multiplier=sigma, expected_batch_size=n, seed=seed,
                      # buckets of 500 elements: every model's sum goes out in several reduce-scatters
                      reducer=ShardReducer(world, bucket_elements=500))
    engine.certify(lambda: loss_fn(model, take(batch, range(3))), before="sharding")
    shards.shard(engine)
    return model, engine


def sharded_backward(world, engine, model, loss_fn, batch, mine: list[list[int]]) -> int:
    """Every rank runs as many backwards as the busiest: padded ones (one row of loss weight
    0) where it has no examples left. Returns the number run."""
    count = lockstep_micro_batches(world, sum(1 for rows in mine if rows))
    for k in range(count):
        rows = mine[k] if k < len(mine) else []
        if rows:
            engine.backward(loss_fn(model, take(batch, rows)))
        else:
            engine.backward(loss_fn(model, take(batch, [0])), samples=0)
    return count


def whole_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (a collective: all ranks call it in the same order)."""
    return {name: p.grad.full_tensor().detach().clone() for name, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    if sorted(a) != sorted(b):
        return float("inf")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _failed(exc: BaseException) -> str:
    if isinstance(exc, RankFailed):
        return str(exc)
    return f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"


class RankFailed(Exception):
    """A case failed on some rank (the message names each failed rank and its error)."""


def agreed(world, step):
    """``step()`` on every rank, then the ranks' outcomes exchanged: ``step``'s result, or
    :class:`RankFailed` on every rank when it failed on any. A rank whose step failed after the
    step's last collective (e.g. in the report, after the reduce-scatter) still meets the
    others here, so the ranks stay paired for the cases that follow."""
    try:
        value, error = step(), None
    except Exception as exc:
        value, error = None, _failed(exc)
    failed = {r: e for r, e in enumerate(world.all_gather(error)) if e is not None}
    if failed:
        raise RankFailed("; ".join(f"rank {r}: {e}" for r, e in failed.items()))
    return value


# ------------------------------------------------------------------ the equivalence cases


def equivalence(world, out: str) -> None:
    """Every split × model × grouping: the sharded clipped sum (noise 0) against the one-process one."""
    n = batch_size(world.size)
    results = Results(world, out, f"equivalence-{world.size}")
    references = {}
    for split_name, split in SPLITS[world.size].items():
        for model_name, (make, loss_fn, make_batch) in MODELS.items():
            batch = make_batch(n)
            for grouping_name, grouping in GROUPINGS.items():
                if (model_name, grouping_name) not in references:
                    clipping = {"grouping": grouping, "threshold": {
                        "kind": "fixed", "value": median_thresholds(make, loss_fn, batch, grouping)}}
                    references[model_name, grouping_name] = clipping, one_process(make, loss_fn, batch, clipping, n)[0]
                clipping, (ref, ref_report) = references[model_name, grouping_name]
                start = time.perf_counter()

                def step():
                    model, engine = sharded(world, make, loss_fn, batch, clipping, n)
                    runs = sharded_backward(world, engine, model, loss_fn, batch, micro_batches(split, world.rank))
                    return model, engine, runs, engine.privatize()

                try:
                    model, engine, runs, report = agreed(world, step)
                    found = {
                        "diff": max_diff(whole_grads(model), ref), "scale": max(float(v.abs().max()) for v in ref.values()),
                        "clip_fraction": report.clip_fraction.tolist(), "ref_clip_fraction": ref_report.clip_fraction.tolist(),
                        "samples": report.samples_seen, "backwards": runs,
                        "sharded": all(hasattr(p, "to_local") for p in model.parameters())}
                    engine.detach()
                except Exception as exc:
                    found = {"error": _failed(exc)}
                found["seconds"] = time.perf_counter() - start
                results.add(f"{model_name}/{grouping_name}/{split_name}", found)


# The adaptive policies of tests/distributed/engine_case.py. Their statistic's noise is drawn by
# rank 0 alone, but a sharded rank 0 draws it from its own stream ("gradient-noise/rank-0-of-W"),
# not the one-process stream: with dcsgd-p's sigma_hist 1.0 the second step's thresholds then
# differ from one process's (seeded), so here its histogram noise is near zero as the
# quantile policy's is.
POLICIES = {"quantile": ENGINE_CLIPPING["quantile"],
            "dcsgd-p": {"grouping": "layer", "threshold": {"kind": "dcsgd-p", "sigma_hist": 1e-9, "bins": 8,
                                                           "range": 4.0}}}


def policies(world, out: str) -> None:
    """The quantile and dcsgd-p thresholds over 2 steps (SGD between), seed 0 on both sides;
    GPT-2, layer grouping, the uneven split."""
    make, loss_fn, make_batch = MODELS["gpt2"]
    n = batch_size(world.size)
    batch = make_batch(n)
    results = Results(world, out, f"policies-{world.size}")
    for name, clipping in POLICIES.items():
        ref = one_process(make, loss_fn, batch, clipping, n, steps=2, seed=0)
        try:
            model, engine = sharded(world, make, loss_fn, batch, clipping, n, seed=0)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            steps = []
            mine = micro_batches(SPLITS[world.size]["uneven"], world.rank)
            for (ref_grads, ref_report) in ref:
                def step():
                    sharded_backward(world, engine, model, loss_fn, batch, mine)
                    return engine.privatize()

                report = agreed(world, step)
                steps.append({"diff": max_diff(whole_grads(model), ref_grads),
                              "thresholds": report.thresholds.tolist(),
                              "ref_thresholds": ref_report.thresholds.tolist(),
                              "noise_multiplier": report.noise_multiplier,
                              "ref_noise_multiplier": ref_report.noise_multiplier})
                optimizer.step()
            found = {"steps": steps}
            engine.detach()
        except Exception as exc:
            found = {"error": _failed(exc)}
        results.add(name, found)


# ------------------------------------------------------------------ noise and refusals


NOISE_SIGMA = 2.0
NOISE_B = 4
# Distinct per-group thresholds for the allocation cases (layer grouping).
NOISE_CASES = {
    "global": {"grouping": "all-layer", "noise_allocation": "global", "threshold": {"kind": "fixed", "value": 1.0}},
    "equal-budget": {"grouping": "layer", "noise_allocation": "equal-budget"},
    "weighted": {"grouping": "layer", "noise_allocation": "weighted"},
}


def noise_model():
    return tiny_gpt2(n_embd=64)      # about 110k coordinates: the sample variance is within 1% of σ²


def layer_thresholds(k: int) -> list[float]:
    return [0.5 + 0.1 * j for j in range(k)]


def noise_clipping(name: str) -> dict:
    clipping = dict(NOISE_CASES[name])
    if "threshold" not in clipping:
        from dpclip.engine import build_groups, trainable_params
        model = noise_model()
        k = len(build_groups(model, "layer", trainable_params(model)).names)
        clipping["threshold"] = {"kind": "fixed", "value": layer_thresholds(k)}
    return clipping


def noise_only(world, out: str, seeds: list, cases: list[str] | None = None) -> None:
    """No rank holds an example (each runs one padded backward), σ > 0: ``p.grad`` is pure
    noise. Rank 0 saves the whole gradients per case and seed (None: OS entropy) to
    ``out/noise-<W>.pt``; the tests read their statistics."""
    batch = gpt2_batch(3)
    saved = {}
    for name in cases or list(NOISE_CASES):
        clipping = noise_clipping(name)
        for seed in seeds:
            def step():
                model, engine = sharded(world, noise_model, gpt2_loss, batch, clipping, NOISE_B, sigma=NOISE_SIGMA,
                                        seed=seed)
                sharded_backward(world, engine, model, gpt2_loss, batch, [])
                return model, engine, engine.privatize()

            try:
                model, engine, report = agreed(world, step)
                saved[(name, seed)] = {"grads": whole_grads(model), "samples": report.samples_seen,
                                       "noise_std_grad": report.noise_std_grad.clone()}
                engine.detach()
            except Exception as exc:
                saved[(name, seed)] = {"error": _failed(exc)}
            if world.main:
                torch.save(saved, Path(out) / f"noise-{world.size}.pt")


def draw_order(grads: dict[str, torch.Tensor], rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s coordinates of the whole gradients, in the order it drew their noise:
    parameter by parameter, its rows of each (``shard_rows``: the dim-0 cut anyone who knows
    the model and W can compute), flattened."""
    parts = []
    for g in grads.values():
        start, stop = shard_rows(g.shape[0] if g.dim() else 1, rank, size)
        parts.append((g if g.dim() else g.reshape(1))[start:stop].reshape(-1))
    return torch.cat(parts)


def refusal_after_sharding(world, out: str) -> None:
    """GPT-2 probed with shared positions ([1, T]) and, once sharded, fed positions per example
    ([b, T]): the position embedding's call needs a probe, which the sealed engine refuses."""
    make, loss_fn, make_batch = MODELS["gpt2"]
    batch = make_batch(4)
    model, engine = sharded(world, make, loss_fn, batch, {"grouping": "all-layer"}, 4)
    found = {}
    try:
        ids = take(batch, [0, 1])["ids"]
        positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
        model(input_ids=ids, position_ids=positions, use_cache=False)
        found["raised"] = None
    except Exception as exc:
        found["raised"] = {"type": type(exc).__name__, "message": str(getattr(exc, "message", exc)),
                           "hint": getattr(exc, "hint", None)}
    Results(world, out, f"refusal-{world.size}").add("positions-per-example", found)


def all_cases(world, out: str, noise_seeds: list) -> None:
    """One spawn for everything (process start-up is the cost); the refusal last, as it
    leaves its sharded model mid-forward."""
    equivalence(world, out)
    policies(world, out)
    noise_only(world, out, noise_seeds)
    refusal_after_sharding(world, out)


class Results:
    """This rank's findings, written to ``out/<name>-rank<r>.json`` after each case: a rank
    that stops (or hangs, until the test's timeout) leaves what it found before."""

    def __init__(self, world, out: str, name: str):
        self.path = Path(out) / f"{name}-rank{world.rank}.json"
        self.found: dict[str, dict] = {}

    def add(self, key: str, found: dict) -> None:
        self.found[key] = found
        self.path.write_text(json.dumps(self.found, indent=1, default=str))


def read_results(out: Path, name: str, size: int) -> list[dict]:
    """Every rank's findings (an empty dict for a rank that wrote none)."""
    paths = [Path(out) / f"{name}-rank{r}.json" for r in range(size)]
    return [json.loads(p.read_text()) if p.exists() else {} for p in paths]
