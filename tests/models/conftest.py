import pytest

from dpclip.data import load_data
from dpclip.data.builtin import synthetic_restaurant_sentences
from dpclip.recipe.schema import BuiltinData, FilesData

@pytest.fixture(scope="session")
def digits_data():
    return load_data(BuiltinData(source="builtin", name="digits"), seed=0)


@pytest.fixture(scope="session")
def digit_images():
    return load_data(BuiltinData(source="builtin", name="digits", as_images=True), seed=0)


@pytest.fixture(scope="session")
def synthetic_text():
    return load_data(BuiltinData(source="builtin", name="synthetic-text", num_examples=40, max_length=64), seed=0)


@pytest.fixture(scope="session")
def text_classification(tmp_path_factory):
    """Restaurant sentences labelled by area, from a local csv (strings -> class ids)."""
    path = tmp_path_factory.mktemp("text") / "reviews.csv"
    lines = ["text,area"]
    for sentence in synthetic_restaurant_sentences(30, seed=1):
        area = "riverside" if "riverside" in sentence else "elsewhere"
        lines.append('"' + sentence.replace('"', '""') + '",' + area)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return load_data(FilesData(source="files", format="csv", train=str(path), text_field="text",
                               label_field="area", max_length=64), seed=0)
