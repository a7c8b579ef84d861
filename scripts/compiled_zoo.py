"""Which models of the zoo training.compile takes: the compiled micro-batch on every tiny transformers case.

For each ``hf`` case of tests/engine/zoo (tiny random-weight architectures, float32, dropout off):
an engine (all-layer, auto norms, a fixed threshold at the median norm) takes one eager micro-batch
(the batch-axis probe and the certificate), then the compiled micro-batch
(:class:`dpclip.engine.compiled.CompiledMicroBatch`, traced with ``aot_eager``: dynamo and
autograd's trace with ``fullgraph=True``, no code generated) runs on a second batch and is compared
with the eager engine on the same rows. Verdicts: ``equal`` (within 1e-5 relative, measured as the
step's own check measures, :func:`dpclip.engine.compiled.disagreement`), ``refused``
(the compiled step says why, with a hint: the eager engine trains the model), ``differs`` (would be
refused at its first micro-batch by the check against the engine), ``fails`` (tracing raised).

    python scripts/compiled_zoo.py                  # about 10 minutes on 2 vCPUs
    python scripts/compiled_zoo.py --render         # the table of the saved results

Results: benchmarks/results/compiled_zoo.json; docs/compiled.md cites the counts.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "compiled_zoo.json"


def judge(name: str) -> tuple[str, str]:
    """(verdict, detail) of one zoo case."""
    import torch

    from dpclip.engine import DPEngine
    from dpclip.engine.compiled import CompiledMicroBatch, disagreement
    from dpclip.errors import EngineError
    from tests.engine import zoo

    case = zoo.CASES[name]
    model = case.build()
    b, t = zoo.SHAPES["generic"]
    first, second = (case.batch(b, t, torch.Generator().manual_seed(seed)) for seed in (1, 2))
    try:
        engine = DPEngine(model, {"grouping": "all-layer", "threshold": {"kind": "fixed", "value": 1.0}},
                          gradient_noise_multiplier=0.0, expected_batch_size=b)
        engine.backward(case.loss(model, first))
        engine.debug_clipped()
    except EngineError as exc:
        return "eager refuses", str(exc).splitlines()[0][:160]
    try:
        compiled = CompiledMicroBatch(engine, model, case.loss, backend="aot_eager")
        engine.backward(case.loss(model, second))
        eager = engine.debug_clipped()
        sums, norms, _, suspect, _ = compiled.graph(second, torch.ones(b), None)
    except EngineError as exc:   # the compiled step's own refusal, or torch.compile's failure to trace
        message = str(exc).splitlines()[0]
        failed = message.startswith("torch.compile could not compile")
        return ("fails" if failed else "refused"), message.removeprefix(
            "torch.compile could not compile this model's micro-batch ")[:160]
    finally:
        engine.detach()
    scale = 1.0 / b   # debug_clipped's sums are Σ_i c_i G_i; the graph's carry 1/B
    worst, where = disagreement(sums, norms, [s * scale for s in eager.sums.values()], eager.norms,
                                engine.step_accumulator.context, engine.thresholds, scale)
    detail = f"{worst:.1e}" + ("" if worst <= 1e-5 else f" at {where}") + (" (flagged)" if bool(suspect) else "")
    return ("equal" if worst <= 1e-5 else "differs"), detail


def run(pattern: str | None) -> dict:
    import torch
    import transformers

    from tests.engine import zoo
    names = [n for n, c in zoo.CASES.items() if c.family == "hf" and (pattern is None or re.search(pattern, n))]
    out = {"torch": torch.__version__, "transformers": transformers.__version__, "cases": {}}
    for name in names:
        started = time.perf_counter()
        verdict, detail = judge(name)
        out["cases"][name] = {"verdict": verdict, "detail": detail}
        print(f"{name}: {verdict} ({detail}) {time.perf_counter() - started:.1f}s", flush=True)
        torch._dynamo.reset()
    return out


def render(results: dict) -> str:
    counts = Counter(r["verdict"] for r in results["cases"].values())
    lines = [f"torch {results['torch']}, transformers {results['transformers']}: "
             + ", ".join(f"{counts[v]} {v}" for v in ("equal", "refused", "differs", "fails", "eager refuses")
                         if counts[v]) + f" of {len(results['cases'])}", "",
             "| case | verdict | detail |", "|---|---|---|"]
    lines += [f"| {name} | {r['verdict']} | {r['detail'].replace('|', '/')} |" for name, r in results["cases"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", help="a regular expression over the case names")
    ap.add_argument("--render", action="store_true", help="print the saved results' table, measure nothing")
    args = ap.parse_args(argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if args.render:
        results = json.loads(RESULTS.read_text())
    else:
        results = run(args.cases)
        if args.cases is None:
            RESULTS.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(render(results), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
