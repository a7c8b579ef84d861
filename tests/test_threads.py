"""dpclip.threads.configure: what the command sets in its process, for Python API users."""

import pytest
import torch

from dpclip.errors import DpclipError
from dpclip.threads import configure


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
