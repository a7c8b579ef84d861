"""`dpclip train`'s header states the sampling the loader uses: "Poisson" only for Poisson batches."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def header(cli, tmp_path, *overrides) -> str:
    result = cli("train", QUICKSTART, f"output_dir={tmp_path / 'runs'}", "training.epochs=null",
                 "training.steps=4", *overrides, "--dry-run")
    assert result.code == 0, result.err
    return result.out.split("planned ε")[0]


def test_a_shuffled_loader_is_never_called_poisson_in_the_train_header(cli, tmp_path):
    text = header(cli, tmp_path, "training.sampling=shuffle")
    assert "Poisson rate" not in text
    assert "fixed-size shuffled batches, accounted as if Poisson" in " ".join(text.split())


def test_a_poisson_loader_is_named_poisson_in_the_train_header(cli, tmp_path):
    assert "Poisson rate q" in header(cli, tmp_path)


def test_a_banded_run_is_not_called_poisson_at_rate_q_in_the_train_header(cli, tmp_path):
    text = " ".join(header(cli, tmp_path, "privacy.mechanism={kind: banded-mf, bands: 2}").split())
    assert "Poisson rate" not in text and "cyclic over 2 groups" in text
