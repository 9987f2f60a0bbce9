"""The package's version, in a module of its own so that any module can name it without
importing the package's front (``hermes_modal_tool/__init__.py`` imports the whole engine)."""

__version__ = "0.1.0"
