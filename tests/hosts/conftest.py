"""The host matrix's marker: ``-m hosts`` selects its tests (the VM cells run only with
``HERMES_MODAL_TOOL_HOSTS=1``: see tests/hosts/run.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.hosts` for the cells


def pytest_configure(config):
    config.addinivalue_line("markers", "hosts: the host matrix (tests/hosts/run.py)")
