"""Optional test dependencies skip where missing, and fail under .ci/run's strict switch."""
from __future__ import annotations

import pytest

import installed

MISSING = "pagedllm_no_such_module"


def test_a_missing_module_skips_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(installed.STRICT_VARIABLE, raising=False)
    with pytest.raises(pytest.skip.Exception):
        installed.need(MISSING)


def test_a_missing_module_fails_under_the_strict_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(installed.STRICT_VARIABLE, "1")
    with pytest.raises(ModuleNotFoundError, match=MISSING):
        installed.need(MISSING)
    assert installed.need("json").dumps([1]) == "[1]"
