"""Evidence for docs/auditing.md, "Results on text": canary exposure of secrets planted in the
shipped `gpt2-tiny-text` recipe, with and without DP.

    python scripts/exposure_evidence.py                       # ε 1 and 8, and σ = 0.01; seed 0
    python scripts/exposure_evidence.py --eps 8 --seeds 0 1 -- training.epochs=3   # overrides after --

Each run plants secrets of 5 digits (a space of 10^5, ranked in full) 1, 4, 16 and 64 times,
with 16 never-planted controls, trains the recipe (at ε, or at σ = 0.01 for the run without
DP: ε in the thousands), and measures the exposure with `dpclip audit-mia --attack exposure`.
Prints a Markdown table (exposure in bits, of at most log₂ 10^5 = 16.6; measured on private
data, not covered by ε) and writes the JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpclip.audit.report import audit  # noqa: E402
from dpclip.files import write_text_atomic  # noqa: E402
from dpclip.recipe import load_recipe  # noqa: E402
from dpclip.train.workflow import train  # noqa: E402

RECIPE = REPO / "recipes" / "gpt2-tiny-text.yaml"
REPETITIONS = [1, 4, 16, 64]
PLANT = f"audit.exposure={{length: 5, repetitions: {REPETITIONS}, controls: 16, candidates: 100000}}"


def run_one(setting: str, seed: int, overrides: list[str], out: Path) -> dict:
    privacy = (["privacy.epsilon=null", "privacy.noise_multiplier=0.01"] if setting == "none"
               else [f"privacy.epsilon={setting}"])
    recipe = load_recipe(RECIPE, [f"output_dir={out}", f"seed={seed}", PLANT, *privacy, *overrides])
    result = train(recipe)
    report = audit(result.run_dir, ["exposure"], seed=seed)
    exposure = report["exposure"]
    return {"setting": setting, "seed": seed, "epsilon": report["ledger"]["epsilon"],
            "planted": {row["repetitions"]: row["exposure"] for row in exposure["planted"]},
            "how": {row["repetitions"]: row["how"] for row in exposure["planted"]},
            "controls_mean": exposure["controls"]["mean_exposure"], "max": exposure["max_exposure"],
            "test_perplexity": result.final_eval.get("perplexity") if result.final_eval else None}


def table(rows: list[dict]) -> str:
    head = ("| DP | ledger ε | " + " | ".join(f"planted {r}x" for r in REPETITIONS)
            + " | 16 controls (chance 1.44) | test perplexity |")
    lines = [head, "|" + " --- |" * (len(REPETITIONS) + 4)]
    for setting in dict.fromkeys(r["setting"] for r in rows):
        group = [r for r in rows if r["setting"] == setting]
        cell = lambda values: " / ".join(f"{v:.1f}" for v in values)  # noqa: E731
        label = "none (σ = 0.01)" if setting == "none" else f"ε = {setting}"
        eps = cell([r["epsilon"] for r in group]) if setting != "none" else f"{group[0]['epsilon']:.3g}"
        planted = [cell([r["planted"][rep] for r in group]) for rep in REPETITIONS]
        controls = cell([r["controls_mean"] for r in group])
        ppl = " / ".join(f"{r['test_perplexity']:.2f}" if r["test_perplexity"] else "-" for r in group)
        lines.append(f"| {label} | {eps} | " + " | ".join(planted) + f" | {controls} | {ppl} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eps", nargs="+", default=["1", "8"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--no-baseline", action="store_true", help="skip the σ = 0.01 run")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "auditing-evidence" / "exposure.json")
    ap.add_argument("overrides", nargs="*", help="recipe overrides (after --)")
    args = ap.parse_args(argv)
    settings = [*args.eps, *([] if args.no_baseline else ["none"])]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for setting in settings:
            for seed in args.seeds:
                rows.append(run_one(setting, seed, args.overrides, Path(folder)))
                print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, json.dumps({"recipe": "gpt2-tiny-text", "overrides": args.overrides,
                                            "plant": PLANT, "rows": rows}, indent=1))
    print(table(rows))
    spread = [r["controls_mean"] for r in rows]
    print(f"controls: mean {statistics.mean(spread):.2f} bits over {len(rows)} runs")


if __name__ == "__main__":
    main()
