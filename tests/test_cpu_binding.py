"""CPU binding of the engine core process: how CPUs are split, what is refused, and that a served
engine child really runs on its CPUs while the stub's threads move to the rest."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedllm.core.config import EngineConfig
from pagedllm.platform.cpu_binding import CpuSplit, parse_cpu_list, split_cpus


def test_cpu_lists_parse_like_taskset_and_bad_ones_are_refused() -> None:
    assert parse_cpu_list("0,2-4") == {0, 2, 3, 4}
    assert parse_cpu_list(" 7 ") == {7}
    for bad in ("", "a", "1-", "-1", "3-1", "1,,2", "1.5", "0-1000000000000", "8192"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    with pytest.raises(ValueError, match="cpu_bind='0-x' is invalid: expected auto, off or a CPU list"):
        EngineConfig(cpu_bind="0-x")


def test_auto_gives_the_engine_the_last_cpus_only_when_some_are_left_for_serving() -> None:
    assert split_cpus("auto", {0, 1, 2, 3}, 2) == CpuSplit(frozenset({2, 3}), frozenset({0, 1}), explicit=False)
    assert split_cpus("auto", {0, 1}, 1) == CpuSplit(frozenset({1}), frozenset({0}), explicit=False)
    assert split_cpus("auto", {0, 1}, 2) is None
    assert split_cpus("auto", {0, 1}, 1, other_engines=1) is None  # they would all pick CPU 1
    assert split_cpus("off", {0, 1, 2, 3}, 1) is None


def test_a_cpu_list_is_taken_as_given_and_must_be_allowed() -> None:
    assert split_cpus("1", {0, 1}, 2) == CpuSplit(frozenset({1}), frozenset({0}), explicit=True)
    assert split_cpus("0-1", {0, 1}, 1) == CpuSplit(frozenset({0, 1}), frozenset(), explicit=True)
    with pytest.raises(ValueError, match=r"cpu_bind='1-3' names CPUs \[2, 3\] outside .*: \[0, 1\]"):
        split_cpus("1-3", {0, 1}, 1)


SERVE_TWICE = textwrap.dedent("""
    import json, os, sys
    import torch
    from pagedllm.core.config import EngineConfig
    from pagedllm.engine.core_process import EngineCoreProcess
    from pagedllm.core.sampling_params import SamplingParams

    config = EngineConfig(**json.loads(sys.argv[1]))
    first = EngineCoreProcess(config, bind_caller=True)
    first.add_request("r", "def f(x):", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    tokens = []
    while first.has_unfinished_requests():
        tokens += [t for out in first.step() for sample in out.outputs for t in sample.token_ids]
    bound = sorted(os.sched_getaffinity(first._process.pid))
    first._process.kill()
    first._process.wait()
    first.add_request("again", "def g(y):", SamplingParams(max_tokens=2))  # starts a fresh child
    second = EngineCoreProcess(config)
    print(json.dumps({
        "caller": sorted(os.sched_getaffinity(0)),
        "first": bound,
        "restarted": sorted(os.sched_getaffinity(first._process.pid)),
        "second": sorted(os.sched_getaffinity(second._process.pid)),
        "second_split": second.cpu_split is not None,
        "tokens": len(tokens),
    }))
    first.close()
    second.close()
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs two CPUs")
def test_served_engine_child_runs_on_its_cpus_and_the_caller_on_the_rest_also_after_a_restart(
    tiny_model_dir: Callable[[str], Path]
) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    config = {"model": str(tiny_model_dir("llama")), "dtype": "float32", "device": "cpu", "max_model_len": 128,
              "num_kv_blocks": 32, "cpu_bind": "auto"}
    # A fresh interpreter: pinning this test process would slow the rest of the suite.
    done = subprocess.run([sys.executable, "-c", SERVE_TWICE, json.dumps(config)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["first"] == seen["restarted"] == allowed[-1:]  # a restarted child splits the same CPUs
    assert seen["caller"] == allowed[:-1]
    assert seen["tokens"] == 4
    # The second engine starts while the first runs: it binds nothing (auto would pick CPU {last} again)
    # and runs on the CPUs its caller had when it started it.
    assert not seen["second_split"] and seen["second"] == seen["caller"]
