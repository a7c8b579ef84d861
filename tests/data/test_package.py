import subprocess
import sys

import dpclip.data


def test_every_advertised_name_of_the_data_package_imports():
    for name in dpclip.data.__all__:
        assert getattr(dpclip.data, name) is not None


def test_counting_training_rows_for_accounting_does_not_import_torch():
    code = ("import sys, dpclip.data.size, dpclip.data.split; "
            "from dpclip.data import training_set_size; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
