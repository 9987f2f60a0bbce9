"""Package discovery for setuptools (the metadata is in pyproject.toml).

Every package under ``hermes_modal_tool/`` is found, so a new subpackage cannot be left
out of the wheel (``hermes_modal_tool.images`` once was, when the list was written by
hand); ``adapters/`` is installed as ``hermes_modal_tool.adapters``.
``tests/test_wheel.py`` builds the wheel and checks both.
"""

from setuptools import find_packages, setup

ADAPTERS = "hermes_modal_tool.adapters"

setup(
    packages=find_packages(include=["hermes_modal_tool", "hermes_modal_tool.*"])
    + [ADAPTERS] + [f"{ADAPTERS}.{name}" for name in find_packages("adapters")],
    package_dir={ADAPTERS: "adapters"},
)
