"""Where torch.compile breaks the private step's graph: the eager step, and the compiled micro-batch.

For the tiny transformer recipes (GPT-2, Llama, BERT), builds the private step as
``dpclip tune-cost`` times it (:func:`dpclip.train.parts.assemble_for_timing`: the recipe's
model, engine, optimizer and step, stand-in noise), takes one eager step (the batch-axis probe
and the certificate run there, once), then traces with ``torch._dynamo.explain`` (1) the next
eager private step (the engine's hooks: issue 54's starting measure) and (2) the micro-batch
``training.compile`` compiles (:class:`dpclip.engine.compiled.CompiledMicroBatch`), and prints
the number of graphs, of graph breaks, and the breaks grouped by reason and by the source line
where they happen. A step that compiles whole with ``fullgraph=True`` has one graph and 0
breaks; each break is a host round trip or a Python fallback (benchmarks/README.md, "Graph breaks").

    python benchmarks/graph_breaks.py                       # all three, printed
    python benchmarks/graph_breaks.py --cases gpt2 --out benchmarks/results/graph_breaks_cpu.txt

Not a test: it reports what is, whatever it is (tests/benchmarks/test_graph_breaks.py runs
it on the smallest case).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LLAMA = ("model.config={model_type: llama, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, "
         "num_attention_heads: 4, num_key_value_heads: 2, max_position_embeddings: 64}")
# name -> (recipe file, overrides)
CASES = {
    "gpt2": ("gpt2-tiny-text.yaml", []),
    "llama": ("gpt2-tiny-text.yaml", [LLAMA]),
    "bert": ("bert-tiny-classify.yaml", []),
}


def _recipe(name: str, batch: int):
    from dpclip.recipe import load_recipe
    file, overrides = CASES[name]
    return load_recipe(REPO / "recipes" / file, [*overrides, f"training.batch_size={batch}",
                                                 f"training.micro_batch_size={batch}"])


def explain_step(name: str, batch: int = 8) -> dict:
    """{"case", "graphs", "breaks", "reasons": [(count, reason, where)], "compiled": {the same}} of
    one eager private step (:func:`dpclip.bench.step_graph_breaks`) and of the compiled micro-batch
    on the same rows (what ``dpclip bench --graph-breaks`` prints)."""
    from dpclip.bench import _grouped_breaks, step_graph_breaks
    from dpclip.data import select
    from dpclip.engine.compiled import CompiledMicroBatch
    from dpclip.train.parts import assemble_for_timing

    parts = assemble_for_timing(_recipe(name, batch), steps=4)
    learner = parts.learner
    rows = torch.arange(batch)  # a fixed batch, not a Poisson draw: the same shapes on every run
    result = step_graph_breaks(lambda: learner.private_step(rows))
    compiled = CompiledMicroBatch(learner.engine, learner.model, learner.loss_fn)
    result["compiled"] = _grouped_breaks(*compiled.graph_breaks(select(parts.feed.data.train, rows), batch))
    learner.engine.detach()
    return {"case": name, **result}


def render(results: list[dict], top: int) -> str:
    lines = [f"# benchmarks/graph_breaks.py, torch {torch.__version__}, CPU: one private step traced by "
             "torch._dynamo.explain", "", "| recipe | eager step: graphs | graph breaks | compiled micro-batch "
             "(training.compile): graphs | graph breaks |", "|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['graphs']} | {r['breaks']} | {r['compiled']['graphs']} | "
              f"{r['compiled']['breaks']} |" for r in results]
    for r in results:
        if r["compiled"]["reasons"]:
            lines += ["", f"## {r['case']}: the compiled micro-batch's breaks"]
            lines += [f"- {count} x {reason} ({where})" for count, reason, where in r["compiled"]["reasons"][:top]]
    for r in results:
        lines += ["", f"## {r['case']}, the eager step: the {top} most frequent breaks (count, reason, where)"]
        lines += [f"- {count} x {reason} ({where})" for count, reason, where in r["reasons"][:top]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--batch", type=int, default=8, help="batch (and micro-batch) size of the traced step")
    ap.add_argument("--top", type=int, default=12, help="break reasons listed per case")
    ap.add_argument("--out", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = [explain_step(name.strip(), args.batch) for name in args.cases.split(",")]
    text = render(results, args.top)
    print(text, end="")
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
