import json

import numpy as np
import torch

from dpclip.data import IGNORE_INDEX, load_data, select
from dpclip.data.builtin import synthetic_restaurant_sentences
from dpclip.data.size import training_set_size
from dpclip.data.split import split_fingerprint, split_indices
from dpclip.recipe.schema import BuiltinData


def digits(**fields):
    return BuiltinData(source="builtin", name="digits", **fields)


def synthetic_text(**fields):
    return BuiltinData(source="builtin", name="synthetic-text", **{"num_examples": 60, "max_length": 48, **fields})


def test_digits_are_flat_64_vectors_in_the_unit_interval_with_ten_integer_classes():
    data = load_data(digits(), seed=0)
    features, labels = data.train["features"], data.train["labels"]
    assert features.dtype == torch.float32 and features.shape == (data.num_train, 64)
    assert features.min() == 0.0 and features.max() == 1.0
    assert labels.dtype == torch.int64 and set(labels.tolist()) == set(range(10))
    assert data.task == "classification" and data.num_classes == 10 and data.input_shape == (64,)
    assert data.tokenizer is None and data.vocab_size is None


def test_digits_as_images_hold_the_same_pixels_as_one_by_eight_by_eight_images():
    flat = load_data(digits(), seed=0)
    images = load_data(digits(as_images=True), seed=0)
    assert images.input_shape == (1, 8, 8)
    assert images.train["features"].shape == (flat.num_train, 1, 8, 8)
    assert torch.equal(images.train["features"].reshape(flat.num_train, 64), flat.train["features"])


def test_builtin_training_sets_have_the_size_accounting_uses_before_loading():
    for config in (digits(), digits(test_fraction=0.5, as_images=True), synthetic_text(test_fraction=0.3)):
        assert load_data(config, seed=4).num_train == training_set_size(config)


def test_split_uses_the_recipe_seed_and_records_its_fingerprint():
    from sklearn.datasets import load_digits

    data = load_data(digits(test_fraction=0.25), seed=7)
    train_indices, test_indices = split_indices(len(load_digits().target), 0.25, seed=7)
    assert np.array_equal(data.train_indices, train_indices) and np.array_equal(data.test_indices, test_indices)
    assert data.fingerprint == split_fingerprint(train_indices, test_indices)
    # The rows really are those positions of the bundled set.
    expected = torch.as_tensor(load_digits().data[test_indices] / 16.0, dtype=torch.float32)
    assert torch.equal(data.test["features"], expected)
    assert load_data(digits(test_fraction=0.25), seed=8).fingerprint != data.fingerprint


def test_synthetic_text_is_the_same_for_the_same_seed_and_differs_for_another():
    assert synthetic_restaurant_sentences(30, seed=1) == synthetic_restaurant_sentences(30, seed=1)
    assert synthetic_restaurant_sentences(30, seed=1) != synthetic_restaurant_sentences(30, seed=2)
    first, again = load_data(synthetic_text(), seed=3), load_data(synthetic_text(), seed=3)
    assert torch.equal(first.train["input_ids"], again.train["input_ids"])
    assert first.fingerprint == again.fingerprint


def test_synthetic_text_tokens_decode_back_to_the_generated_sentences():
    data = load_data(synthetic_text(max_length=200), seed=5)
    sentences = synthetic_restaurant_sentences(60, seed=5)
    decoded = [data.tokenizer.decode(row) for row in data.train["input_ids"]]
    assert decoded == [sentences[i] for i in data.train_indices]
    assert data.task == "causal-lm" and data.vocab_size == 259 and data.pad_token_id == 256


def test_causal_lm_labels_are_the_input_ids_with_padding_set_to_minus_100():
    data = load_data(synthetic_text(), seed=0)
    ids, mask, labels = (data.train[k] for k in ("input_ids", "attention_mask", "labels"))
    assert ids.shape == mask.shape == labels.shape == (data.num_train, 48)
    assert torch.equal(labels[mask == 1], ids[mask == 1])
    assert (labels[mask == 0] == IGNORE_INDEX).all() and (mask == 0).any(), "some sentences are padded"
    assert (ids[mask == 0] == data.pad_token_id).all()
    # Right padding: every row is ones, then zeros.
    assert torch.equal(mask, torch.sort(mask, dim=1, descending=True).values)


def test_select_indexes_every_tensor_of_a_split_alike():
    data = load_data(synthetic_text(), seed=0)
    rows = torch.tensor([4, 0, 4])
    batch = select(data.train, rows)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    for name, tensor in batch.items():
        assert torch.equal(tensor, data.train[name][rows])


def test_describe_is_a_short_json_summary():
    data = load_data(synthetic_text(), seed=0)
    summary = json.loads(json.dumps(data.describe()))
    assert summary["num_train"] == data.num_train and summary["num_test"] == data.num_test
    assert summary["task"] == "causal-lm" and summary["tokenizer"] == "byte"
    assert summary["split_fingerprint"] == data.fingerprint and summary["source"] == "builtin:synthetic-text"


def test_synthetic_cuisine_sentences_name_their_label():
    from dpclip.data.builtin import FOODS, synthetic_cuisine_sentences

    texts, labels = synthetic_cuisine_sentences(200, seed=4)
    assert len(set(labels.tolist())) == len(FOODS)
    assert all(FOODS[label] in text for text, label in zip(texts, labels))
    data = load_data(BuiltinData(source="builtin", name="synthetic-cuisine", num_examples=50, max_length=48), seed=0)
    assert data.task == "classification" and data.num_classes == len(FOODS)
    assert data.num_train == training_set_size(BuiltinData(source="builtin", name="synthetic-cuisine",
                                                           num_examples=50, max_length=48))
