"""The compiled private step on the CPU: training.compile against the eager step and non-private.

For the tiny transformer recipes (GPT-2, Llama, BERT; the cases of benchmarks/graph_breaks.py)
and the small GPT-2 of docs/performance.md (4 layers, n_embd 256, vocab 1024, B 16, T 128),
runs :func:`dpclip.bench.bench_recipe` with ``compiled=True``: the non-private step (eager, and
with its model under ``torch.compile``), the eager private step and the private step as
``training.compile`` runs it (one micro-batch of the whole batch through the compiled graph),
interleaved in one process; and the compiled micro-batch's graph breaks. Writes the table into
docs/performance.md between the ``<!-- compiled: start/end -->`` markers and the raw results to
benchmarks/results/compiled_step_cpu.json.

    python benchmarks/compiled_step.py                     # about 10 minutes on 2 vCPUs
    python benchmarks/compiled_step.py --render benchmarks/results/compiled_step_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (REPO, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from graph_breaks import LLAMA  # noqa: E402

PAGE = REPO / "docs" / "performance.md"
RESULTS = HERE / "results" / "compiled_step_cpu.json"
START, END = "<!-- compiled: start -->", "<!-- compiled: end -->"
SMALL_GPT2 = ["model.config={model_type: gpt2, n_layer: 4, n_embd: 256, n_head: 4, n_positions: 128}",
              "data.max_length=128", "training.batch_size=16"]
# name -> (recipe file, overrides)
CASES = {
    "gpt2-tiny, B 32": ("gpt2-tiny-text.yaml", ["training.batch_size=32"]),
    "llama-tiny, B 32": ("gpt2-tiny-text.yaml", [LLAMA, "training.batch_size=32"]),
    "bert-tiny, B 64": ("bert-tiny-classify.yaml", ["training.batch_size=64"]),
    "gpt2 4 layers, n_embd 256, byte vocab, B 16, T 128": ("gpt2-tiny-text.yaml", SMALL_GPT2),
}


def measure(repeats: int) -> dict:
    from dpclip.bench import bench_recipe

    out = {"torch": torch.__version__, "repeats": repeats, "cases": {}}
    for name, (file, overrides) in CASES.items():
        result = bench_recipe(REPO / "recipes" / file, overrides, groupings=("all-layer",), repeats=repeats,
                              warmup=2, memory=False, floor=False, breaks=True, compiled=True)
        out["cases"][name] = result.to_dict()
        print(name, json.dumps({k: round(v, 4) for k, v in result.median_s.items()}), flush=True)
    return out


def render(results: dict) -> str:
    first = next(iter(results["cases"].values()))
    lines = [f"machine: {first['threads']} threads, torch {results['torch']}, float32, CPU; median of "
             f"{results['repeats']} interleaved rounds; `python benchmarks/compiled_step.py`", "",
             "| model, batch | non-private (s) | non-private, compiled | private, eager | private, compiled "
             "(training.compile) | compiled graph: graphs, breaks |", "|---|---|---|---|---|---|"]
    for name, r in results["cases"].items():
        base, ratio, over = r["median_s"]["non-private"], r["ratio"], r["ratio_compiled"]
        lines.append(f"| {name} | {base:.4f} | {ratio['non-private, compiled']:.2f}x | {ratio['dp all-layer']:.2f}x | "
                     f"{ratio['dp all-layer, compiled']:.2f}x ({over['dp all-layer, compiled']:.2f}x compiled "
                     f"non-private) | {r['graph_breaks']['graphs']}, {r['graph_breaks']['breaks']} |")
    return "\n".join(lines) + "\n"


def write_page(table: str, page: Path = PAGE) -> None:
    text = page.read_text(encoding="utf-8")
    start, end = text.index(START) + len(START), text.index(END)
    page.write_text(text[:start] + "\n\n" + table + "\n" + text[end:], encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--render", type=Path, help="re-render a saved run, no measuring")
    ap.add_argument("--no-page", action="store_true", help="print only; leave docs/performance.md alone")
    args = ap.parse_args(argv)
    if args.render:
        results = json.loads(args.render.read_text())
    else:
        results = measure(args.repeats)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    table = render(results)
    print(table, end="")
    if not args.no_page:
        write_page(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
