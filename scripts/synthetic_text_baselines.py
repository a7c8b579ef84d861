"""Print the synthetic-text yardsticks of docs/results.md: repeated sentences and a unigram perplexity.

    python scripts/synthetic_text_baselines.py [--recipe recipes/gpt2-tiny-text.yaml] [--splits 5]

For the recipe's data (seed as in the recipe): how many distinct sentences the generator
drew, and the held-out perplexity of an add-one smoothed byte unigram fitted on the
training rows, scored on the same next-token targets as the model's test perplexity
(padding left out). A run's train/test split comes from its own private key, so the
unigram is scored on --splits splits (keys 0..N-1). Deterministic; a few seconds on one thread.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from dpclip.data.builtin import synthetic_restaurant_sentences
from dpclip.data.columns import IGNORE_INDEX
from dpclip.data.dataset import load_data
from dpclip.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]


def next_token_targets(split: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tokens a causal LM is scored on: every label after the first, padding left out."""
    labels = split["labels"][:, 1:]
    return labels[labels != IGNORE_INDEX]


def unigram_perplexity(train: torch.Tensor, test: torch.Tensor, vocab: int) -> float:
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    probabilities = counts / counts.sum()
    return math.exp(-probabilities[test].log().mean().item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "gpt2-tiny-text.yaml")
    parser.add_argument("--splits", type=int, default=5)
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, [])
    sentences = synthetic_restaurant_sentences(recipe.data.num_examples, recipe.seed)
    print(f"{args.recipe.name}: {len(sentences):,} sentences, {len(set(sentences)):,} distinct")
    perplexities = []
    for key in range(args.splits):
        data = load_data(recipe.data, recipe.seed, split_key=key)
        train, test = next_token_targets(data.train), next_token_targets(data.test)
        vocab = int(max(train.max(), test.max())) + 1
        perplexities.append(unigram_perplexity(train, test, vocab))
    print(f"add-one smoothed byte unigram, held-out perplexity over {args.splits} splits: "
          f"{min(perplexities):.2f}–{max(perplexities):.2f}")


if __name__ == "__main__":
    main()
