"""Optional test dependencies: skipped where they are missing, except where the install must have put them.

``.ci/run`` installs everything from scratch and sets ``PAGEDLLM_TEST_STRICT_IMPORTS=1``:
there a missing client library (or the tritonserver wheel) means a broken install step,
so the tests that need it fail with the ImportError instead of skipping quietly.
"""
from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

STRICT_VARIABLE = "PAGEDLLM_TEST_STRICT_IMPORTS"


def strict() -> bool:
    return os.environ.get(STRICT_VARIABLE) == "1"


def need(module: str) -> ModuleType:
    """``module``, imported; a missing one skips the calling test module, or fails it under ``.ci/run``."""
    if strict():
        return importlib.import_module(module)
    return pytest.importorskip(module)
