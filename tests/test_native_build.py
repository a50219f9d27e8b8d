"""How compiled C sources are cached: by their text and the text of the headers they include."""
from __future__ import annotations

import ctypes
import logging
import shutil
from pathlib import Path

import pytest

from pagedllm.platform.native_build import CACHE_ENV, load_library

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
LOG = logging.getLogger(__name__)


def answer(library: ctypes.CDLL | None) -> int:
    assert library is not None
    return int(library.answer())


def test_editing_an_included_header_builds_a_new_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    source, header = tmp_path / "probe.c", tmp_path / "value.h"
    source.write_text('#include "value.h"\nint answer(void) { return VALUE; }\n')
    header.write_text("#define VALUE 41\n")
    assert answer(load_library(source, "PAGEDLLM_TEST_PROBE", "no probe", LOG)) == 41
    header.write_text("#define VALUE 42\n")
    assert answer(load_library(source, "PAGEDLLM_TEST_PROBE", "no probe", LOG)) == 42
    assert len(list((tmp_path / "cache").glob("probe-*.so"))) == 2


def test_a_source_that_does_not_compile_is_reported_with_the_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    source = tmp_path / "broken.c"
    source.write_text("int answer(void) { return }\n")
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert load_library(source, "PAGEDLLM_TEST_PROBE", "the probe runs without it", LOG) is None
    assert "building broken.c failed, so the probe runs without it" in caplog.text
