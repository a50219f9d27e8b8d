"""The serving path's hop stamps (``pagedllm.engine.latency_trace``) and how ``pagedllm bench latency`` pairs them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pagedllm_bench.latency import _gaps, _read_trace
from pagedllm.engine import latency_trace
from pagedllm.engine.latency_trace import TRACE_ENV

MARK_TWO = ("from pagedllm.engine import latency_trace as t; "
            "t.mark('stub.received', 'abc123-def'); t.mark('core.stepped', 'abc123')")


def test_marks_are_written_per_process_under_the_request_key(tmp_path: Path) -> None:
    env = {**os.environ, TRACE_ENV: str(tmp_path / "trace")}
    subprocess.run([sys.executable, "-c", MARK_TWO], env=env, check=True)
    hops = _read_trace(tmp_path / "trace")
    assert set(hops) == {"abc123"}
    assert set(hops["abc123"]) == {"stub.received", "core.stepped"}
    assert hops["abc123"]["stub.received"][0] <= hops["abc123"]["core.stepped"][0]


def test_without_the_variable_nothing_is_written(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != TRACE_ENV}
    subprocess.run([sys.executable, "-c", MARK_TWO], env=env, check=True, cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert not latency_trace.enabled()  # the test process runs without it too


def test_key_is_the_head_of_the_stub_request_id() -> None:
    assert latency_trace.key("0f3a-9b7c") == "0f3a"
    assert latency_trace.key("plain") == "plain"


def test_each_stamp_pairs_with_the_latest_earlier_stamp() -> None:
    # Steps every 100 units; the response of step 300 was held back (no stamp), the rest arrive 7 later.
    steps = [100, 200, 300, 400]
    sent = [107, 207, 407]
    assert _gaps(steps, sent) == [7, 7, 7]
    assert _gaps(steps, [50]) == []  # nothing before it
