"""Run the model zoo through the engine and write the "Supported models" table (issue 25).

Every case of tests/engine/zoo (tiny transformers architectures, the PyTorch / Opacus layer
zoo, the forward patterns) at every shape family (B ≠ T, B == T, B == T + 1, B == 1), every
grouping (all-layer, layer, param), norm method (ghost, instantiate, auto) and precision
(fp32, bf16 autocast) is judged against a per-sample reference (tests/engine/zoo/judge.py):
exact, refused (EngineError), wrong (silently mismatched) or crashed.

    python scripts/supported_models.py                 # the full zoo (a few minutes)
    python scripts/supported_models.py --quick         # all-layer, auto, fp32 only
    python scripts/supported_models.py --write-docs    # and regenerate docs/zoo.md's table
    python scripts/supported_models.py --render-only --write-docs   # docs from the saved JSON
    python scripts/supported_models.py --cases '^gemma3$' --merge --write-docs   # rerun some cases only

Results go to benchmarks/results/supported_models.json (``--out``). The docs block between
``<!-- supported-models:start -->`` and ``<!-- supported-models:end -->`` is exactly
:func:`render` of that JSON (tests/scripts/test_supported_models.py checks it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "supported_models.json"
DOCS = REPO / "docs" / "zoo.md"
START, END = "<!-- supported-models:start -->", "<!-- supported-models:end -->"
VERDICTS = ("exact", "refused", "wrong", "crashed", "broken-reference")   # the last: named only when it occurs
SHAPE_ORDER = ("generic", "B==T", "B==T+1", "B==1")


def _zoo():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.engine import zoo
    from tests.engine.zoo import judge
    return zoo, judge


def _round(x):
    return None if x is None else float(f"{x:.3g}")


def run_zoo(quick: bool = False, pattern: str | None = None, log=print) -> dict:
    """Judge every selected run; the JSON-ready results."""
    zoo, judge = _zoo()
    import torch
    import transformers
    groupings, methods, precisions = ((("all-layer",), ("auto",), ("fp32",)) if quick
                                      else (zoo.GROUPINGS, zoo.METHODS, zoo.PRECISIONS))
    cases = [c for c in zoo.CASES.values() if pattern is None or re.search(pattern, c.name)]
    runs, start = [], time.perf_counter()
    for n, case in enumerate(cases):
        counts = Counter()
        for shape in zoo.SHAPES:
            for grouping in groupings:
                for method in methods:
                    for precision in precisions:
                        r = judge.judge(case.name, shape, grouping, method, precision)
                        counts[r.verdict] += 1
                        row = {k: v for k, v in r.to_dict().items() if v not in (None, [])}
                        row.pop("seconds", None)
                        for k in ("max_rel_err", "norm_rel_err", "norm_bias"):
                            if k in row:
                                row[k] = _round(row[k])
                        runs.append(row)
        log(f"[{n + 1}/{len(cases)}] {case.name}: " + ", ".join(f"{v} {counts[v]}" for v in VERDICTS if counts[v]))
    return {
        "meta": {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__,
                 "shapes": {k: list(v) for k, v in zoo.SHAPES.items()}, "groupings": list(groupings),
                 "methods": list(methods), "precisions": list(precisions), "tolerance": judge.TOLERANCE,
                 "quick": quick, "seconds": round(time.perf_counter() - start)},
        "cases": {c.name: {"family": c.family, "what": c.what} for c in cases},
        "runs": runs,
    }


def merged(saved: dict, fresh: dict) -> dict:
    """``saved`` with the cases run in ``fresh`` replaced by their fresh runs (in the zoo's case
    order); ``seconds`` adds up. Both must come from the same versions and cross product."""
    same = ("torch", "transformers", "shapes", "groupings", "methods", "precisions", "tolerance", "quick")
    if any(saved["meta"].get(k) != fresh["meta"].get(k) for k in same):
        raise SystemExit("error: the saved results come from other versions or another cross product\n"
                         "hint: rerun the whole zoo without --merge")
    zoo, _ = _zoo()
    order = {name: n for n, name in enumerate(zoo.CASES)}
    cases = {**{k: v for k, v in saved["cases"].items() if k not in fresh["cases"]}, **fresh["cases"]}
    cases = dict(sorted(cases.items(), key=lambda item: order.get(item[0], len(order))))
    runs = [r for r in saved["runs"] if r["case"] not in fresh["cases"]] + fresh["runs"]
    runs.sort(key=lambda r: order.get(r["case"], len(order)))   # stable: each case's runs keep their order
    meta = {**saved["meta"], "seconds": saved["meta"]["seconds"] + fresh["meta"]["seconds"]}
    return {"meta": meta, "cases": cases, "runs": runs}


# ------------------------------------------------------------------ rendering


def summary(results: dict) -> Counter:
    return Counter(r["verdict"] for r in results["runs"])


def _counted(counts: Counter) -> str:
    """'16998 exact, 930 refused, 0 wrong, 0 crashed' (+ broken-reference runs, when any: a case
    whose float64 per-example reference is itself not finite, tests/engine/zoo/judge.py)."""
    return ", ".join(f"{counts[v]} {v}" for v in VERDICTS if counts[v] or v != "broken-reference")


def _cell(runs: list[dict], precisions: list[str]) -> str:
    """One backend's verdicts over shapes, groupings and precisions: 'exact', or each
    non-exact verdict with the shape families (and precision, when only one) it hit."""
    by = defaultdict(lambda: (set(), set()))
    for r in runs:
        by[r["verdict"]][0].add(r["shape"])
        by[r["verdict"]][1].add(r["precision"])
    if set(by) == {"exact"}:
        return "exact"
    parts = []
    for verdict in ("wrong", "crashed", "broken-reference", "refused"):
        if verdict not in by:
            continue
        shapes, precs = by[verdict]
        where = "all shapes" if len(shapes) == len(SHAPE_ORDER) else ", ".join(s for s in SHAPE_ORDER if s in shapes)
        if len(precs) < len(precisions):
            where += "; " + ", ".join(sorted(precs))
        parts.append(f"**{verdict}** ({where})" if verdict in ("wrong", "crashed", "broken-reference") else f"{verdict} ({where})")
    if "exact" in by:
        parts.append("exact otherwise")
    return "; ".join(parts)


def _notes(runs: list[dict]) -> str:
    notes = []
    wrong = [r for r in runs if r["verdict"] == "wrong"]
    if wrong:
        worst = max(wrong, key=lambda r: r.get("max_rel_err") or 0)
        params = Counter(p for r in wrong for p in r.get("params", [])[:2])
        notes.append(f"wrong: max rel. error {worst.get('max_rel_err')}, norms off by up to "
                     f"{max((r.get('norm_rel_err') or 0) for r in wrong):.3g}"
                     + (f" (e.g. `{'`, `'.join(p for p, _ in params.most_common(2))}`)" if params else ""))
    for verdict in ("crashed", "broken-reference", "refused"):
        messages = Counter(r.get("message", "") for r in runs if r["verdict"] == verdict)
        for message, _ in messages.most_common(1):       # variants differ only in the sizes
            text = re.sub(r"\s+", " ", message).replace("|", "\\|")
            notes.append(f"{verdict}: {text[:160]}{'…' if len(text) > 160 else ''}")
    return "<br>".join(notes)


def render(results: dict) -> str:
    """The markdown block between the markers: counts, then one row per case."""
    meta, runs = results["meta"], results["runs"]
    counts = summary(results)
    by_case = defaultdict(list)
    for r in runs:
        by_case[r["case"]].append(r)
    shapes = ", ".join(f"{k} (B {b}, T {t})" for k, (b, t) in meta["shapes"].items())
    lines = [
        "Generated by `scripts/supported_models.py` from `benchmarks/results/supported_models.json`",
        f"(torch {meta['torch']}, transformers {meta['transformers']}); do not edit by hand.",
        f"Each case runs at every shape family ({shapes}), grouping ({', '.join(meta['groupings'])})",
        f"and precision ({', '.join(meta['precisions'])}; bf16 = forward and loss under CPU autocast),",
        "against a per-sample autograd loop (tests/engine/zoo/judge.py): **exact** within tolerance "
        f"(fp32 {meta['tolerance']['fp32']:g}, bf16 {meta['tolerance']['bf16']:.3g} relative), "
        "**refused** with an error, **wrong** (silently mismatched) or **crashed**.",
        "",
        f"{len(runs)} runs: {_counted(counts)}.",
        f"{len(results['cases'])} cases; exact in every run: " + ", ".join(
            f"{exact} of {total} {FAMILIES.get(family, family)}"
            for family, (exact, total) in _families(results, by_case).items()) + ".",
        "",
        "| case | architecture / layer | " + " | ".join(meta["methods"]) + " | notes |",
        "|---|---|" + "---|" * len(meta["methods"]) + "---|",
    ]
    for name, info in results["cases"].items():
        case_runs = by_case[name]
        cells = [_cell([r for r in case_runs if r["method"] == m], meta["precisions"]) for m in meta["methods"]]
        lines.append(f"| `{name}` | {info['what']} | " + " | ".join(cells) + f" | {_notes(case_runs)} |")
    return "\n".join(lines)


FAMILIES = {"hf": "transformers architectures", "layer": "layers", "pattern": "forward patterns"}


def _families(results: dict, by_case: dict) -> dict[str, tuple[int, int]]:
    """Per family of cases (hf: transformers architectures; layers; patterns; ...): how many are
    exact in every run, of how many."""
    out: dict[str, list[int]] = {}
    for name, info in results["cases"].items():
        exact, total = out.setdefault(info["family"], [0, 0])
        out[info["family"]] = [exact + all(r["verdict"] == "exact" for r in by_case[name]), total + 1]
    return {family: (exact, total) for family, (exact, total) in out.items()}


def write_docs(results: dict, path: Path = DOCS) -> None:
    text = path.read_text()
    block = f"{START}\n{render(results)}\n{END}"
    if START in text:
        head, rest = text.split(START, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## Supported models\n\n" + block + "\n"
    path.write_text(text)


def docs_block(path: Path = DOCS) -> str | None:
    text = path.read_text()
    if START not in text:
        return None
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n")


def dump(results: dict) -> str:
    """JSON with one run per line (readable diffs when a fix flips verdicts)."""
    runs = ",\n".join(json.dumps(r) for r in results["runs"])
    return (f'{{\n"meta": {json.dumps(results["meta"])},\n"cases": {json.dumps(results["cases"], indent=1)},\n'
            f'"runs": [\n{runs}\n]\n}}\n')


def _compress(keys: set[tuple], domains: list[tuple[str, ...]]) -> list[tuple]:
    """Cover a set of (shape, grouping, method, precision) keys by few products of value
    sets ('*' for a whole domain): split on the first dimension until each part is a product."""
    projections = [sorted({k[d] for k in keys}, key=domains[d].index) for d in range(len(domains))]
    if len(keys) == math.prod(len(p) for p in projections):
        return [tuple("*" if len(p) == len(domains[d]) else (p[0] if len(p) == 1 else tuple(p))
                      for d, p in enumerate(projections))]
    split = next(d for d, p in enumerate(projections) if len(p) > 1)
    out = []
    for value in projections[split]:
        out += _compress({k for k in keys if k[split] == value}, domains)
    return out


def fault_table(results: dict, expected_refusals=()) -> str:
    """KNOWN_FAULTS entries (Python source) for every run that is not exact (nor an expected
    refusal), with a generated reason to edit: a developer's aid after a zoo run."""
    meta = results["meta"]
    domains = [tuple(meta["shapes"]), tuple(meta["groupings"]), tuple(meta["methods"]), tuple(meta["precisions"])]
    bad = defaultdict(dict)
    for r in results["runs"]:
        if r["verdict"] != "exact" and not (r["case"] in expected_refusals and r["verdict"] == "refused"):
            bad[r["case"]][(r["shape"], r["grouping"], r["method"], r["precision"])] = r
    lines = []
    for case, runs in bad.items():
        for pattern in _compress(set(runs), domains):
            hits = [r for k, r in runs.items() if all(p == "*" or k[d] == p or (isinstance(p, tuple) and k[d] in p)
                                                     for d, p in enumerate(pattern))]
            verdicts = Counter(r["verdict"] for r in hits)
            first = max(hits, key=lambda r: r.get("max_rel_err") or 0)
            what = (f"wrong, rel. error up to {first.get('max_rel_err')} in {', '.join(first.get('params', [])[:2])}"
                    if first["verdict"] == "wrong" else f"{first['verdict']}: {first.get('message', '')[:90]}")
            tag = "/".join(sorted(verdicts))
            lines.append(f"    ({case!r}, {', '.join(repr(p) for p in pattern)}):\n"
                         f"        \"issue 25: {tag}: {what}\",".replace("'", '"'))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="all-layer, auto, fp32 only (every case and shape)")
    ap.add_argument("--cases", help="regex: only the cases whose name it matches")
    ap.add_argument("--out", type=Path, default=RESULTS, help=f"results JSON (default {RESULTS.relative_to(REPO)})")
    ap.add_argument("--write-docs", action="store_true", help="regenerate the table of docs/zoo.md")
    ap.add_argument("--render-only", action="store_true", help="run nothing: render the JSON at --out")
    ap.add_argument("--merge", action="store_true",
                    help="with --cases: replace those cases' runs in the JSON at --out and keep the others")
    ap.add_argument("--known-faults", action="store_true",
                    help="print KNOWN_FAULTS entries for tests/engine/zoo/known_faults.py (reasons to edit)")
    args = ap.parse_args(argv)
    if args.render_only:
        results = json.loads(args.out.read_text())
    else:
        import torch
        torch.set_num_threads(1)       # tiny models: threads only add overhead and nondeterminism
        results = run_zoo(args.quick, args.cases, log=lambda s: print(s, flush=True))
        if args.merge:
            results = merged(json.loads(args.out.read_text()), results)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(dump(results))
        print(f"wrote {args.out}")
    counts = summary(results)
    print(f"{len(results['runs'])} runs: {_counted(counts)}")
    if args.known_faults:
        _, _ = _zoo()
        from tests.engine.zoo.known_faults import EXPECTED_REFUSALS
        print(fault_table(results, EXPECTED_REFUSALS))
    if args.write_docs:
        write_docs(results)
        print(f"wrote the model zoo's table in {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
