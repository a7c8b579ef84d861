"""Reproduce the results table of docs/auditing.md: membership inference on digits.

    OMP_NUM_THREADS=1 python scripts/audit_table.py [--shadows 16] [--out runs/audit-table] [--json FILE]
    python scripts/audit_table.py --render docs/auditing-evidence/digits.json

Three runs of one recipe (an MLP on scikit-learn's digits, half the data held out, 200
out-of-distribution canaries): non-DP (the engine's noise removed with the test seam
tests/audit/seam.py's scaled_noise(0) and clipping at 100, i.e. effectively off), DP at
ε = 8 and DP at ε = 1. Each run is audited with every attack; LiRA trains --shadows
shadow models per run, which RMIA reuses as its reference models. Prints two markdown
tables (the attacks side by side; both one-run ε lower bounds against the ledger) and
writes the rows to --json (default OUT/audit-table.json; the page's evidence file is
docs/auditing-evidence/digits.json). About 5 minutes on one thread (the `minutes` of that
file). --render FILE prints the tables from saved rows without training.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

from dpclip.audit import audit
from dpclip.recipe import load_recipe
from dpclip.train.workflow import train

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the noise seam is a test helper: it ships in tests/, not in the package
from tests.audit.seam import scaled_noise  # noqa: E402
BASE = ["training.epochs=null", "training.steps=600", "training.batch_size=64", "training.micro_batch_size=64",
        "data.test_fraction=0.5", "model.hidden=[256]", "audit.canaries.count=200", "audit.canaries.kind=ood",
        "checkpoint.every_steps=null", "eval.every_steps=null", "training.optimizer.lr=0.5"]
SETTINGS = [
    ("non-DP (no noise, no clipping)", 0.0, ["privacy.epsilon=8", "clipping.threshold.value=100"]),
    ("DP, ε = 8", 1.0, ["privacy.epsilon=8", "clipping.threshold.value=1"]),
    ("DP, ε = 1", 1.0, ["privacy.epsilon=1", "clipping.threshold.value=1"]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shadows", type=int, default=16)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "audit-table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="20 steps, 2 shadows, no bootstrap: checks the script")
    parser.add_argument("--json", type=Path, help="where the rows go (default OUT/audit-table.json)")
    parser.add_argument("--render", type=Path, metavar="FILE", help="print the tables from saved rows; no training")
    args = parser.parse_args()
    if args.render:
        print_tables(json.loads(args.render.read_text()), args.shadows)
        return
    base = [*BASE, "training.steps=20"] if args.smoke else BASE
    shadows, bootstrap = (2, 0) if args.smoke else (args.shadows, 200)
    torch.set_num_threads(1)
    rows = []
    for label, noise, overrides in SETTINGS:
        started = time.time()
        name = "audit-" + label.split(" ")[0].lower().replace(",", "") + "-" + overrides[0].split("=")[1]
        recipe = load_recipe(REPO / "recipes" / "quickstart.yaml",
                             [f"output_dir={args.out}", f"name={name}", f"seed={args.seed}", *base, *overrides])
        # The shadows must be trained the way the target was, so the seam covers both.
        seam = scaled_noise(0.0) if noise == 0.0 else contextlib.nullcontext()
        with seam:
            result = train(recipe)
            report = audit(result.run_dir, ["loss", "logistic", "lira", "rmia", "one-run"], shadows=shadows,
                           seed=args.seed, bootstrap=bootstrap)
        attacks = report["attacks"]
        rows.append({
            "setting": label, "accuracy": result.final_eval.get("accuracy"),
            "ledger_epsilon": None if noise == 0.0 else report["ledger"]["epsilon"],
            "loss_auc": attacks["loss"]["auc"], "logistic_auc": attacks["logistic"]["auc"],
            "lira_auc": attacks["lira-online"]["auc"], "lira_ci": attacks["lira-online"]["auc_ci95"],
            "lira_offline_auc": attacks["lira-offline"]["auc"],
            "lira_tpr_1": attacks["lira-online"]["tpr_at_1%_fpr"],
            "lira_tpr_01": attacks["lira-online"]["tpr_at_0.1%_fpr"],
            "rmia_auc": attacks["rmia-online"]["auc"], "rmia_offline_auc": attacks["rmia-offline"]["auc"],
            "rmia_tpr_1": attacks["rmia-online"]["tpr_at_1%_fpr"],
            "rmia_tpr_01": attacks["rmia-online"]["tpr_at_0.1%_fpr"],
            "loss_tpr_01": attacks["loss"]["tpr_at_0.1%_fpr"],
            "null_std": attacks["loss"]["auc_null_std"],
            "eps_lb": report["one_run"]["epsilon_lower_bound"],
            "fdp_eps_lb": report["one_run"]["fdp"]["epsilon_lower_bound"],
            "fdp_mu_lb": report["one_run"]["fdp"]["mu_lower_bound"],
            "canary_guesses": f"{report['one_run']['correct']}/{report['one_run']['guesses']}",
            "run_dir": str(result.run_dir), "minutes": (time.time() - started) / 60,
        })
        print(json.dumps(rows[-1]), flush=True)
    rows_file = args.json or args.out / "audit-table.json"
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    rows_file.write_text(json.dumps(rows, indent=1))
    print_tables(rows, shadows)


def print_tables(rows: list[dict], shadows: int) -> None:
    """The two markdown tables of docs/auditing.md and their footnote."""
    print()
    print("| setting | test acc. | ledger ε | loss AUC | logistic AUC | LiRA online AUC [95% CI] | LiRA offline AUC "
          "| RMIA online AUC | RMIA offline AUC | TPR @ 0.1% FPR: loss / LiRA / RMIA | TPR @ 1% FPR: LiRA / RMIA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        eps = "∞ (noise removed)" if r["ledger_epsilon"] is None else f"{r['ledger_epsilon']:.2f}"
        low, high = r["lira_ci"]
        ci = f" [{low:.3f}, {high:.3f}]" if low is not None else ""
        print(f"| {r['setting']} | {r['accuracy']:.3f} | {eps} | {r['loss_auc']:.3f} | {r['logistic_auc']:.3f} "
              f"| {r['lira_auc']:.3f}{ci} | {r['lira_offline_auc']:.3f} | {r['rmia_auc']:.3f} "
              f"| {r['rmia_offline_auc']:.3f} | {r['loss_tpr_01']:.3f} / {r['lira_tpr_01']:.3f} / "
              f"{r['rmia_tpr_01']:.3f} | {r['lira_tpr_1']:.3f} / {r['rmia_tpr_1']:.3f} |")
    print()
    print("| setting | ledger ε | canary guesses right | one-run ε ≥ (Steinke et al.) | f-DP ε ≥ (μ ≥) |")
    print("|---|---|---|---|---|")
    for r in rows:
        eps = "∞ (noise removed)" if r["ledger_epsilon"] is None else f"{r['ledger_epsilon']:.2f}"
        print(f"| {r['setting']} | {eps} | {r['canary_guesses']} | {r['eps_lb']:.2f} | {r['fdp_eps_lb']:.2f} "
              f"({r['fdp_mu_lb']:.2f}) |")
    print(f"\nnull AUC standard error (members vs non-members): {rows[0]['null_std']:.4f}; "
          f"LiRA and RMIA on {shadows} shadow models; one-run bounds at 95% confidence each, δ = 1e-5.")


if __name__ == "__main__":
    main()
