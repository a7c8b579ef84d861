"""Evidence for docs/methods-evidence.md, "User-level privacy": a user-level run against example-level
runs that protect a person by group privacy, at the same per-person (ε, δ).

    python scripts/user_evidence.py --eps 4 8 --seeds 0 1
    python scripts/user_evidence.py --eps 8 --seeds 0 -- training.epochs=1   # recipe overrides after --

The data: the shipped `user-text` recipe's synthetic people (each with a style of their own and
1 to a few dozen records). Three ways to give every person (ε, δ):

* user-level: `privacy.unit: user` at (ε, δ), k = the recipe's max_examples_per_user;
* example-level, capped: each training person's first k records only (written to a text file
  with the same held-out people), at (ε/k, δ_k) with k·e^{(k−1)ε/k}·δ_k = δ, so that group
  privacy over k records gives (ε, δ) (dpclip/accounting/group.py);
* example-level, all records: every record, at (ε/n, δ_n) with n the most records any training
  person has, the group a person's records form.

Example-level runs take the user-level run's expected records per step as their batch size and
the same number of steps. Prints a Markdown table of held-out perplexity (not covered by ε) and
writes the JSON under --out (default docs/methods-evidence/users.json).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dpclip.accounting.group import group_privacy  # noqa: E402
from dpclip.data import load_data  # noqa: E402
from dpclip.data.builtin import synthetic_user_sentences  # noqa: E402
from dpclip.files import write_text_atomic  # noqa: E402
from dpclip.recipe import load_recipe  # noqa: E402
from dpclip.train.workflow import train  # noqa: E402

RECIPE = REPO / "recipes" / "user-text.yaml"


def write_files(recipe, folder: Path) -> dict:
    """train-capped.txt, train-all.txt and test.txt of the recipe's split; sizes for the runs."""
    data = load_data(recipe.data, recipe.seed)
    texts, authors = synthetic_user_sentences(recipe.data.num_examples, recipe.data.num_users, recipe.seed)
    k = recipe.data.max_examples_per_user
    taken: Counter = Counter()
    capped = []
    for row in data.train_indices:
        if taken[authors[row]] < k:
            capped.append(texts[row])
            taken[authors[row]] += 1
    counts = Counter(authors[row] for row in data.train_indices)
    for name, lines in (("train-capped.txt", capped), ("train-all.txt", [texts[r] for r in data.train_indices]),
                        ("test.txt", [texts[r] for r in data.test_indices])):
        (folder / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    people = data.num_users
    # Expected records per step of the user-level run: q·Σ_u min(n_u, k).
    records_per_step = recipe.training.batch_size / people * sum(min(n, k) for n in counts.values())
    return {"people": people, "k": k, "largest": max(counts.values()), "records_per_step": records_per_step,
            "capped": len(capped), "all": data.num_train}


def run(recipe_path: Path, overrides: list[str], out: Path) -> dict:
    recipe = load_recipe(recipe_path, [f"output_dir={out}", "checkpoint.every_steps=null", *overrides])
    result = train(recipe)
    return {"epsilon": result.epsilon, "delta": recipe.privacy.delta, "steps": result.steps_done,
            "sigma": result.noise["noise_multiplier"], "final_eval": result.final_eval}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eps", type=float, nargs="+", default=[4.0, 8.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "methods-evidence" / "users.json")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the user-text recipe")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for seed in args.seeds:
            base = load_recipe(RECIPE, [f"seed={seed}", *args.overrides])
            sizes = write_files(base, folder)
            steps = math.ceil(base.training.epochs * sizes["people"] / base.training.batch_size)
            delta, k, largest = base.privacy.delta, sizes["k"], sizes["largest"]
            for epsilon in args.eps:
                user = run(RECIPE, [f"seed={seed}", f"privacy.epsilon={epsilon}", *args.overrides], folder)
                rows.append({"way": "user-level", "seed": seed, "epsilon_person": epsilon, "group": 1, **user})
                for way, train_file, group in (("example-level, first k records", "train-capped.txt", k),
                                              ("example-level, all records", "train-all.txt", largest)):
                    epsilon_example = epsilon / group
                    delta_example = delta / (group * math.exp((group - 1) * epsilon_example))
                    batch = max(1, round(sizes["records_per_step"]))
                    result = run(RECIPE, [
                        f"seed={seed}", *args.overrides, "privacy.unit=example", f"privacy.epsilon={epsilon_example}",
                        f"privacy.delta={delta_example}", f"training.batch_size={batch}", "training.epochs=null",
                        f"training.steps={steps}",
                        f"data={{source: files, format: text, train: {folder / train_file}, test: {folder / 'test.txt'}, "
                        f"max_length: {base.data.max_length}, tokenizer: {base.data.tokenizer}}}"], folder)
                    person = group_privacy(result["epsilon"], delta_example, group)
                    rows.append({"way": way, "seed": seed, "epsilon_person": epsilon, "group": group,
                                 "person_guarantee": person, **result})
                for row in rows[-3:]:
                    print(json.dumps(row), flush=True)
    text = table(rows)
    print(text)
    write_text_atomic(args.out, json.dumps({"recipe": "recipes/user-text.yaml", "overrides": args.overrides,
                                            "rows": rows, "table": text}, indent=1) + "\n")
    return {"rows": rows, "table": text}


def table(rows: list[dict]) -> str:
    """One line per (ε, way); group, ε and σ per seed where the seeds differ (the largest person
    of each seed's split sets the group of "all records")."""
    def each(found, key, fmt):
        values = list(dict.fromkeys(fmt.format(r[key]) for r in found))
        return " / ".join(values)

    lines = ["| ε per person | way | group k | ε of the run | σ | held-out perplexity (mean) | runs |",
             "|---|---|---|---|---|---|---|"]
    for epsilon in sorted({r["epsilon_person"] for r in rows}):
        for way in dict.fromkeys(r["way"] for r in rows):
            found = [r for r in rows if r["epsilon_person"] == epsilon and r["way"] == way]
            values = [r["final_eval"]["perplexity"] for r in found]
            lines.append(f"| {epsilon:g} | {way} | {each(found, 'group', '{}')} | {each(found, 'epsilon', '{:.3g}')} | "
                         f"{each(found, 'sigma', '{:.3f}')} | {statistics.mean(values):.3f} | "
                         + ", ".join(f"{v:.3f}" for v in values) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
