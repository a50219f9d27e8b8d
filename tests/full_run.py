"""``pytest --full``: the long matrices, beside the one case of each kind the default run keeps.

conftest reads the option before any test module is imported, so a module may build its
parametrizations from :func:`full` at import time; a single test that only the full run
takes carries ``@pytest.mark.full`` instead.
"""
from __future__ import annotations

OPTION = "--full"
_full = False


def set_full(value: bool) -> None:
    global _full
    _full = value


def full() -> bool:
    """Whether this run was asked for the long matrices (``pytest --full``)."""
    return _full
