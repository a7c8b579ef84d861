from pathlib import Path

import yaml

from dpclip.recipe.shipped import shipped_names, shipped_summary

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"


def test_recipes_list_shows_every_shipped_recipe(cli):
    result = cli("recipes", "list")
    assert result.code == 0
    for name in shipped_names():
        assert name in result.out


def test_recipe_summaries_are_whole_first_sentences_even_across_comment_lines():
    for name in shipped_names():
        summary = shipped_summary(name)
        assert summary.endswith("."), f"{name}: {summary!r} stops mid-sentence"
        assert "reaches" not in summary   # the results line is not part of what a recipe shows
    # its first sentence runs over two comment lines; "Bu et al.)" does not end one
    assert shipped_summary("bert-tiny-classify").endswith("synthetic restaurant sentences with DP-AdamW, "
                                                          "layer-wise clipping.")
    assert shipped_summary("cnn-layer").endswith("one fixed C split as C/sqrt(K).")


def test_shipped_recipes_are_the_files_in_recipes_dir():
    assert shipped_names() == sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


def test_recipes_show_prints_the_file(cli):
    result = cli("recipes", "show", "quickstart")
    assert result.code == 0 and result.out == QUICKSTART.read_text()


def test_recipes_copy_writes_once_and_refuses_to_overwrite(cli, tmp_path):
    assert cli("recipes", "copy", "quickstart", tmp_path).code == 0
    copied = tmp_path / "quickstart.yaml"
    assert copied.read_text() == QUICKSTART.read_text()
    again = cli("recipes", "copy", "quickstart", tmp_path)
    assert again.code == 2 and "already exists" in again.err and "--force" in again.err
    assert cli("recipes", "copy", "quickstart", tmp_path, "--force").code == 0


def test_unknown_shipped_recipe_lists_the_known_ones(cli):
    result = cli("recipes", "show", "nope")
    assert result.code == 2 and "quickstart" in result.err


def test_validate_accepts_a_good_recipe_and_shows_defaults(cli):
    assert cli("validate", QUICKSTART).code == 0
    shown = cli("validate", QUICKSTART, "training.optimizer.lr=0.05", "--show")
    resolved = yaml.safe_load(shown.out)
    assert resolved["training"]["optimizer"]["lr"] == 0.05
    assert resolved["clipping"]["gamma"] == 0.01  # a default filled in


def test_validate_reports_bad_yaml_unknown_key_and_wrong_type(cli, tmp_path):
    bad_yaml = tmp_path / "a.yaml"
    bad_yaml.write_text("name: x\n  bad: indent\n")
    unknown = tmp_path / "b.yaml"
    data = yaml.safe_load(QUICKSTART.read_text())
    data["training"]["epoch"] = 3
    unknown.write_text(yaml.safe_dump(data))
    for path, fragment in [(bad_yaml, "not valid YAML"), (unknown, "training.epoch: unknown key"),
                           (tmp_path / "missing.yaml", "not found")]:
        result = cli("validate", path)
        assert result.code == 2, result.err
        assert fragment in result.err and "hint:" in result.err and "Traceback" not in result.err
    wrong_type = cli("validate", QUICKSTART, "training.batch_size=[1]")
    assert wrong_type.code == 2 and "training.batch_size" in wrong_type.err


def test_validate_checks_the_rules_that_need_the_data_size(cli):
    ok = cli("validate", QUICKSTART)
    assert "training examples" in " ".join(ok.out.split())  # rich wraps at the console width
    big_delta = cli("validate", QUICKSTART, "privacy.delta=0.01")
    assert big_delta.code == 2 and "1/N" in big_delta.err and "hint:" in big_delta.err
    big_batch = cli("validate", QUICKSTART, "training.batch_size=5000")
    assert big_batch.code == 2 and "exceeds" in big_batch.err


def test_a_recipe_path_that_is_a_device_socket_or_pipe_is_refused_before_it_is_read(cli, tmp_path):
    # a socket was opened ("cannot read ...: No such device"); /dev/zero or a FIFO without a writer was read
    # until memory ran out, or forever (the socket comes first: before the fix this test fails, not hangs)
    import os
    import socket
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "s.yaml"))
    os.mkfifo(tmp_path / "pipe.yaml")
    try:
        for path in (tmp_path / "s.yaml", "/dev/zero", tmp_path / "pipe.yaml"):
            result = cli("validate", path)
            assert result.code == 2 and "is not a regular file" in result.err and "hint:" in result.err, result.err
    finally:
        server.close()
