import time

import pytest

from dpclip.data import load_data
from dpclip.errors import DpclipError
from dpclip.recipe.schema import HFData


@pytest.fixture
def hub_offline(monkeypatch):
    """Offline mode as a user would set it; `datasets` and `huggingface_hub` read these
    variables when first imported, so the already-imported constants are set too."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_an_unavailable_hub_data_set_is_a_quick_clear_error_not_a_traceback(hub_offline):
    config = HFData(source="hf", name="dpclip-made-up/no-such-data-set", text_field="text")
    started = time.perf_counter()
    with pytest.raises(DpclipError) as info:
        load_data(config, seed=0)
    assert time.perf_counter() - started < 10
    assert "dpclip-made-up/no-such-data-set" in info.value.message
    assert "needs network or a local cache" in info.value.hint
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.fixture
def fake_hub(monkeypatch):
    """`datasets.load_dataset` answering from memory: a labelled text set with two splits."""
    import datasets

    splits = {
        "train": datasets.Dataset.from_dict(
            {"sentence": ["good food", "bad service", "nice view", "cold soup"], "label": [1, 0, 1, 0]},
            features=datasets.Features({"sentence": datasets.Value("string"),
                                        "label": datasets.ClassLabel(names=["neg", "pos"])})),
        "validation": datasets.Dataset.from_dict(
            {"sentence": ["warm bread", "rude staff"], "label": [1, 0]},
            features=datasets.Features({"sentence": datasets.Value("string"),
                                        "label": datasets.ClassLabel(names=["neg", "pos"])})),
    }
    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return splits[split]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def test_a_hub_text_data_set_with_a_test_split_becomes_text_classification(fake_hub):
    config = HFData(source="hf", name="someone/reviews", config="en", test_split="validation",
                    text_field="sentence", label_field="label", max_length=16)
    data = load_data(config, seed=0)
    assert fake_hub == [("someone/reviews", "en", "train"), ("someone/reviews", "en", "validation")]
    assert data.task == "classification" and data.num_classes == 2
    assert data.num_train == 4 and data.num_test == 2 and data.test_indices.tolist() == [0, 1]
    assert data.train["labels"].tolist() == [1, 0, 1, 0]
    assert data.tokenizer.decode(data.test["input_ids"][1]) == "rude staff"
    assert data.describe()["source"] == "hf:someone/reviews/en:train (test validation)"


def test_a_hub_data_set_without_a_test_split_is_cut_with_the_recipe_seed(fake_hub):
    config = HFData(source="hf", name="someone/reviews", text_field="sentence", test_fraction=0.25)
    data = load_data(config, seed=0)
    assert data.task == "causal-lm" and (data.num_train, data.num_test) == (3, 1)
    assert sorted(data.train_indices.tolist() + data.test_indices.tolist()) == [0, 1, 2, 3]


def test_a_hub_column_of_ragged_sequences_is_refused_like_a_files_one(monkeypatch, tmp_path):
    import datasets

    ragged = datasets.Dataset.from_dict({"v": [[0.0], [1.0, 1.0], [2.0, 2.0, 2.0], [3.0]], "label": [0, 1, 0, 1]})
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None, split=None: ragged)
    with pytest.raises(DpclipError, match="holds sequences of different lengths") as info:
        load_data(HFData(source="hf", name="someone/ragged", label_field="label"), seed=0)
    assert "same number of features" in info.value.hint


@pytest.fixture
def hub_with_an_unseen_class(monkeypatch):
    """A ClassLabel of three classes whose rows hold only two of them."""
    import datasets

    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["neg", "neutral", "pos"])})
    rows = datasets.Dataset.from_dict({"sentence": ["good", "bad", "fine", "cold"], "label": [1, 0, 1, 0]},
                                      features=features)
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None, split=None: rows)


def test_a_class_label_fixes_the_classes_whatever_the_rows_hold(hub_with_an_unseen_class):
    """The schema's three classes, not the largest id + 1 (which a neighbour with one "pos" row moves)."""
    data = load_data(HFData(source="hf", name="someone/reviews", text_field="sentence", label_field="label",
                            max_length=8), seed=0)
    assert data.num_classes == 3 and data.label_names == ["neg", "neutral", "pos"]


def test_labels_declared_by_name_match_a_class_labels_ids_by_their_names(hub_with_an_unseen_class):
    data = load_data(HFData(source="hf", name="someone/reviews", text_field="sentence", label_field="label",
                            max_length=8, labels=["neutral", "neg"], test_fraction=0.5), seed=0)
    assert data.num_classes == 2 and data.label_names == ["neutral", "neg"]
    labels = dict(zip(data.train_indices.tolist(), data.train["labels"].tolist()))
    assert all(labels[row] == {1: 0, 0: 1}[[1, 0, 1, 0][row]] for row in labels)


def test_a_hub_test_splits_unlabelled_rows_are_refused_not_made_a_class(monkeypatch):
    """GLUE-style test splits label every row -1 (unlabelled): it was a class of its own ("-1"),
    which shifted every class id by one."""
    import datasets

    features = datasets.Features({"sentence": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["neg", "pos"])})
    splits = {"train": datasets.Dataset.from_dict({"sentence": ["good", "bad"], "label": [1, 0]}, features=features),
              "test": datasets.Dataset.from_dict({"sentence": ["fine"], "label": [-1]}, features=features)}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config=None, split=None: splits[split])
    with pytest.raises(DpclipError) as refused:
        load_data(HFData(source="hf", name="glue", test_split="test", text_field="sentence", label_field="label",
                         max_length=8), seed=0)
    assert "row 1 of the test data has the label -1" in refused.value.message
    assert "-1 means unlabelled" in refused.value.hint


def test_a_hub_error_past_loading_is_labelled_as_quoting_the_data(monkeypatch):
    """datasets' cast errors quote the row they could not read ("Couldn't cast 'Alice, 52, HIV+'"):
    the refusal says it quotes the data's rows (rev45); an offline error (OSError) quotes none."""
    import datasets

    from dpclip.errors import QUOTES_DATA_NOTE

    def cast_error(name, config=None, split=None):
        raise ValueError("Couldn't cast value 'Alice, 52, HIV+' to int64")

    monkeypatch.setattr(datasets, "load_dataset", cast_error)
    with pytest.raises(DpclipError) as info:
        load_data(HFData(source="hf", name="someone/records", text_field="t"), seed=0)
    assert "Alice" in info.value.message and info.value.message.endswith(QUOTES_DATA_NOTE)

    def offline(name, config=None, split=None):
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DpclipError) as info:
        load_data(HFData(source="hf", name="someone/records", text_field="t"), seed=0)
    assert QUOTES_DATA_NOTE not in info.value.message
