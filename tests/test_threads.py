"""dpclip.threads.configure: what the command sets in its process, for Python API users."""

import pytest
import torch

from dpclip.errors import DpclipError
from dpclip.threads import auto_threads, configure


def test_configure_sets_torch_threads_and_reports_the_allocator_setting():
    before = torch.get_num_threads()
    try:
        applied = configure(1)
        assert torch.get_num_threads() == 1 and applied["threads"] == 1
        assert isinstance(applied["keep_freed_memory"], bool)
        assert configure()["threads"] == 1, "None keeps the current count"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_configure_refuses_a_thread_count_that_is_not_a_whole_positive_number(bad):
    with pytest.raises(DpclipError) as info:
        configure(bad)
    assert "threads" in info.value.message and info.value.hint


@pytest.mark.parametrize("cores, load, ceiling, expected", [
    (2, 0.0, 2, 2),    # idle: torch's default
    (2, 0.4, 2, 2),    # a little background noise rounds away
    (2, 1.0, 2, 1),    # one busy job holds one of two cores
    (2, 13.0, 2, 1),   # never below one thread
    (16, 3.2, 8, 8),   # never above torch's own count (physical cores)
    (16, 10.6, 8, 5),
])
def test_auto_threads_takes_the_cores_the_load_average_leaves_free(cores, load, ceiling, expected):
    assert auto_threads(cores, load, ceiling) == expected


def test_configure_auto_sets_the_auto_count(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr("dpclip.threads.auto_threads", lambda: 1)
    try:
        assert configure("auto")["threads"] == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_configure_refuses_a_word_other_than_auto():
    with pytest.raises(DpclipError) as info:
        configure("many")
    assert "'auto'" in info.value.message


def test_configure_speed_sets_what_dpclip_train_sets_and_returns_it(monkeypatch):
    import dpclip

    before = torch.get_num_threads()
    monkeypatch.setattr("dpclip.threads.auto_threads", lambda: 1)
    try:
        applied = dpclip.configure_speed()          # "auto" by default, as `dpclip train --threads`
        assert applied["threads"] == 1 == torch.get_num_threads()
        assert applied == dpclip.threads.configure(None)   # the same settings, still in force
        assert dpclip.configure_speed(None)["threads"] == 1
    finally:
        torch.set_num_threads(before)


def test_importing_dpclip_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, dpclip; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
