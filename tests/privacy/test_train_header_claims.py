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


def test_a_user_level_header_counts_the_people_its_rate_is_over(cli, tmp_path):
    result = cli("train", REPO / "recipes" / "user-text.yaml", f"output_dir={tmp_path / 'runs'}",
                 "training.epochs=null", "training.steps=2", "data.num_examples=400", "data.num_users=100",
                 "training.batch_size=8", "--dry-run")
    assert result.code == 0, result.err
    text = " ".join(result.out.split())
    # q = 8 / 90 training people (10% held out), not 8 over the records
    assert "people N 90 (" in text and "training examples N" not in text and "0.08889" in text
