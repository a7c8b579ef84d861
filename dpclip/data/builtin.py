"""Data sets shipped with dpclip: nothing is ever downloaded.

- ``digits``: scikit-learn's bundled 1,797 handwritten digits (8x8 grey levels 0..16).
- ``synthetic-cuisine``: the same kind of sentences, each mentioning a cuisine, labelled
  with that cuisine (7 classes): a text-classification task for encoder recipes.
- ``synthetic-users``: such descriptions written by a number of synthetic people, each with a
  style of their own (a favourite cuisine and area, a way of ending a sentence, a sign-off)
  and a number of records of their own: the data set for user-level privacy.
- ``synthetic-text``: short restaurant descriptions generated from slot values, in the
  spirit of the E2E NLG challenge data (name, food, area, price range, rating,
  family-friendly, near). Structured enough that a tiny language model visibly learns
  something in a minute, and seeded, so the same seed always gives the same sentences.
"""

from __future__ import annotations

import random

import numpy as np

DIGITS_MAX_GREY_LEVEL = 16.0

# The public feature domain of each builtin table/image set, in the units the model sees:
# what the data set's documentation declares, never measured on the data (the training
# rows are private). Digits: scikit-learn documents "an integer in the range 0..16" per
# pixel, which load_digits_arrays scales by 1/16.
FEATURE_DOMAINS: dict[str, tuple[float, float]] = {"digits": (0.0, 1.0)}


def load_digits_arrays(as_images: bool) -> tuple[np.ndarray, np.ndarray]:
    """(features float32 in [0, 1], labels int64): ``[1797, 64]`` or ``[1797, 1, 8, 8]``."""
    from sklearn.datasets import load_digits  # lazy: scikit-learn takes about a second to import

    digits = load_digits()
    features = (digits.data / DIGITS_MAX_GREY_LEVEL).astype(np.float32)
    if as_images:
        features = features.reshape(-1, 1, 8, 8)
    return features, digits.target.astype(np.int64)


# Slot values. Names and landmarks are made up; the other slots follow the E2E ontology,
# worded so every template stays grammatical and most sentences fit in 64 bytes.
RESTAURANT_NAMES = [
    "Aromi", "Blue Spice", "Cotto", "Giraffe", "Green Man", "Loch Fyne", "The Eagle",
    "The Mill", "The Punter", "Strada", "Zizzi", "Fitzbillies", "The Olive Grove", "Wildwood",
]
FOODS = ["Italian", "French", "Chinese", "Indian", "Japanese", "English", "Spanish"]
AREAS = ["the centre", "the riverside"]
PRICE_RANGES = ["cheap", "moderately priced", "expensive"]
RATINGS = ["low", "average", "high"]
FAMILY = ["family-friendly", "adults-only"]
LANDMARKS = ["the Crowne Plaza", "Café Sicilia", "the Rice Boat", "Burger King",
             "the Portland Arms", "All Bar One", "Café Brazil"]

# Each template uses a subset of the slots; {a_food} and {a_family} carry their article.
TEMPLATES = [
    "{name} serves {food} food in {area}.",
    "{name} is {a_food} restaurant near {near}.",
    "{name} is {price} and has a {rating} rating.",
    "{name} is {a_family} {food} place.",
    "{name} in {area} is {price}.",
    "{name} near {near} is rated {rating}.",
    "Try {name} for {price} {food} food.",
]


def _with_article(word: str) -> str:
    return ("an " if word[0].lower() in "aeiou" else "a ") + word


def synthetic_restaurant_sentences(num_examples: int, seed: int) -> list[str]:
    """``num_examples`` restaurant descriptions; the same seed gives the same list.

    Uses :class:`random.Random`, whose sequence is fixed across platforms and Python
    versions for these calls, so a recipe's text never changes under it.
    """
    rng = random.Random(seed)
    sentences = []
    for _ in range(num_examples):
        food = rng.choice(FOODS)
        slots = {
            "name": rng.choice(RESTAURANT_NAMES),
            "food": food,
            "a_food": _with_article(food),
            "area": rng.choice(AREAS),
            "price": rng.choice(PRICE_RANGES),
            "rating": rng.choice(RATINGS),
            "a_family": _with_article(rng.choice(FAMILY)),
            "near": rng.choice(LANDMARKS),
        }
        sentences.append(rng.choice(TEMPLATES).format(**slots))
    return sentences


# Templates that name the cuisine, for the labelled variant.
CUISINE_TEMPLATES = [t for t in TEMPLATES if "{food}" in t or "{a_food}" in t]


def synthetic_cuisine_sentences(num_examples: int, seed: int) -> tuple[list[str], np.ndarray]:
    """(sentences, cuisine ids into FOODS): every sentence names its restaurant's cuisine."""
    rng = random.Random(seed)
    sentences, labels = [], []
    for _ in range(num_examples):
        label = rng.randrange(len(FOODS))
        food = FOODS[label]
        slots = {
            "name": rng.choice(RESTAURANT_NAMES), "food": food, "a_food": _with_article(food),
            "area": rng.choice(AREAS), "price": rng.choice(PRICE_RANGES), "rating": rng.choice(RATINGS),
            "a_family": _with_article(rng.choice(FAMILY)), "near": rng.choice(LANDMARKS),
        }
        sentences.append(rng.choice(CUISINE_TEMPLATES).format(**slots))
        labels.append(label)
    return sentences, np.asarray(labels, dtype=np.int64)


SIGN_OFFS = ["Ana", "Ben", "Caro", "Dev", "Eli", "Femi", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena", "Mo", "Nia",
             "Otto", "Pia", "Raj", "Sol", "Tam", "Uma", "Vic", "Wen", "Xia", "Yul", "Zoe"]
ENDINGS = [".", "!", "!!", "...", " :)"]


def synthetic_user_sentences(num_examples: int, num_users: int, seed: int) -> tuple[list[str], np.ndarray]:
    """(sentences, the user id of each): ``num_users`` people write ``num_examples``
    restaurant descriptions between them, every person at least one.

    A person has a favourite cuisine and area (used 80% of the time), an ending and a
    sign-off ("~Ana7"), so a model that memorises a person's records learns their style:
    what user-level privacy is about. How many records each person writes varies a lot
    (weights exp(N(0, 1)) over the records beyond the first), as real contribution counts do.
    """
    if num_users > num_examples:
        raise ValueError(f"{num_users} users cannot each write one of {num_examples} sentences")
    rng = random.Random(seed)
    styles = [(rng.randrange(len(FOODS)), rng.choice(AREAS), rng.choice(ENDINGS),
               f"{rng.choice(SIGN_OFFS)}{rng.randrange(10)}") for _ in range(num_users)]
    weights = [rng.lognormvariate(0.0, 1.0) for _ in range(num_users)]
    authors = list(range(num_users)) + rng.choices(range(num_users), weights=weights, k=num_examples - num_users)
    rng.shuffle(authors)
    sentences = []
    for user in authors:
        favourite, area, ending, sign_off = styles[user]
        food = FOODS[favourite] if rng.random() < 0.8 else rng.choice(FOODS)
        slots = {
            "name": rng.choice(RESTAURANT_NAMES), "food": food, "a_food": _with_article(food),
            "area": area if rng.random() < 0.8 else rng.choice(AREAS), "price": rng.choice(PRICE_RANGES),
            "rating": rng.choice(RATINGS), "a_family": _with_article(rng.choice(FAMILY)),
            "near": rng.choice(LANDMARKS),
        }
        sentence = rng.choice(TEMPLATES).format(**slots).rstrip(".")
        sentences.append(f"{sentence}{ending} ~{sign_off}")
    return sentences, np.asarray(authors, dtype=np.int64)
