"""Python's cyclic garbage collector, tuned for an engine that steps for hours.

Two costs, both seen on the host path (``pagedllm bench overhead``'s engine, tiny model;
measured: RESULTS.md, "Figures behind the code's choices"):

- A step allocates a few short-lived records per running sequence (scheduled chunks,
  sampled tokens, deltas, outputs), which reference counting frees. At CPython's
  default threshold of 700 new containers the youngest generation is collected every
  step or two at 256 running sequences, a visible share of the host path's step. A
  higher threshold collects as much, less often.
- After start-up hundreds of thousands of objects are alive (model modules, tokenizer,
  KV block pool) that never become garbage, and a collection of the oldest generation
  walks all of them: a stall of every stream. ``gc.freeze()`` takes them out of the
  collector's sight, as vLLM's EngineCore does after its start-up. Frozen objects are
  never collected, so only a process that holds one engine for its whole life freezes.

The freeze is undone at exit: the interpreter's last collection skips frozen objects, so
cycles through triton's modules would outlive it, and nanobind then reports dozens of
"leaked" libtriton types and functions as the process ends (what ``pagedllm serve``
printed at every Ctrl-C).
"""
from __future__ import annotations

import atexit
import gc

YOUNG_THRESHOLD = 20_000


def collect_young_less_often() -> None:
    """Raise the youngest generation's threshold (never lower one a user has raised further)."""
    young, middle, old = gc.get_threshold()
    if young < YOUNG_THRESHOLD:
        gc.set_threshold(YOUNG_THRESHOLD, middle, old)


def freeze_startup_heap() -> None:
    """Collect once, then move every surviving object out of the collector's sight.

    For processes whose whole life is one engine (the engine core child, a Triton backend
    stub), called once the engine is built.
    """
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this is called
    atexit.register(gc.unfreeze)
