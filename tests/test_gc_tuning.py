"""The engine's garbage-collector settings: young collections rarer, the start-up heap frozen where a
process holds one engine for life, and garbage made later still collected."""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from pagedllm import LLM
from pagedllm.platform.gc_tuning import YOUNG_THRESHOLD, collect_young_less_often


@pytest.fixture
def default_thresholds() -> Iterator[None]:
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        yield
    finally:
        gc.set_threshold(*saved)


def test_building_an_engine_raises_the_young_threshold(default_thresholds: None,
                                                       tiny_model_dir: Callable[[str], Path]) -> None:
    LLM(model=str(tiny_model_dir("llama")), dtype="float32", num_kv_blocks=16, max_model_len=64)
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)


def test_a_threshold_raised_further_is_kept(default_thresholds: None) -> None:
    gc.set_threshold(5 * YOUNG_THRESHOLD, 10, 10)
    collect_young_less_often()
    assert gc.get_threshold()[0] == 5 * YOUNG_THRESHOLD


def test_freezing_hides_the_startup_heap_and_later_cycles_are_still_collected() -> None:
    code = textwrap.dedent("""
        import gc, weakref
        from pagedllm.platform.gc_tuning import freeze_startup_heap

        class Node:
            pass

        before = gc.get_freeze_count()
        freeze_startup_heap()
        assert gc.get_freeze_count() > before + 1000, (before, gc.get_freeze_count())
        node = Node()
        node.me = node  # a cycle: only the collector frees it
        ref = weakref.ref(node)
        del node
        gc.collect()
        assert ref() is None, "a cycle made after the freeze was not collected"
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.slow
def test_a_frozen_engine_process_exits_without_nanobind_leak_reports(tiny_model_dir: Callable[[str], Path]) -> None:
    """Frozen objects escape the interpreter's last collection; unfrozen at exit, triton's bindings are freed."""
    code = textwrap.dedent(f"""
        from pagedllm import LLM
        from pagedllm.platform.gc_tuning import freeze_startup_heap

        llm = LLM(model={str(tiny_model_dir("llama"))!r}, dtype="float32", num_kv_blocks=16, max_model_len=64)
        freeze_startup_heap()
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    assert "nanobind" not in result.stderr, result.stderr[-3000:]
