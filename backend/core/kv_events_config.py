"""``kv_events_config``: vLLM's ``KVEventsConfig`` keys, validated (``vllm/config/kv_events.py``).

Given as the engine argument ``kv_events_config`` (a JSON object in ``model.json``, or
``pagedllm serve --kv-events-config '<json>'``). Defaults are vLLM's; as in vLLM, an
``endpoint`` with ``*``, ``::``, ``ipc://`` or ``inproc://`` is bound, any other is connected
to (a relay's address), and ``replay_endpoint`` is always bound. ``buffer_steps`` batches are
kept for replay; ``hwm`` bounds the PUB socket's queue and the queue between the engine's step
and the publishing thread (``max_queue_size`` is accepted for vLLM's sake and bounds it too).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null" (vLLM's rule)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        _require(isinstance(self.enable_kv_cache_events, bool), "enable_kv_cache_events", self.enable_kv_cache_events,
                 "true or false")
        _require(self.publisher is None or self.publisher in _PUBLISHERS, "publisher", self.publisher,
                 f"one of {', '.join(_PUBLISHERS)}")
        _require(isinstance(self.endpoint, str) and self.endpoint.startswith(("tcp://", "ipc://", "inproc://")),
                 "endpoint", self.endpoint, "a ZMQ endpoint (tcp://, ipc:// or inproc://)")
        _require(self.replay_endpoint is None or (isinstance(self.replay_endpoint, str) and self.replay_endpoint
                                                  .startswith(("tcp://", "ipc://", "inproc://"))),
                 "replay_endpoint", self.replay_endpoint, "null or a ZMQ endpoint")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, value,
                     "a positive integer")
        _require(isinstance(self.topic, str), "topic", self.topic, "a string")

    @property
    def publishes(self) -> bool:
        """Whether events go out over ZMQ (enabled, and the publisher is not ``null``)."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @property
    def queue_size(self) -> int:
        return min(self.hwm, self.max_queue_size)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> KVEventsConfig:
        if not isinstance(values, Mapping):
            raise ValueError(f"kv_events_config must be a JSON object, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {unknown}; allowed: {sorted(known)}")
        return cls(**values)


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"kv_events_config.{name}={value!r} is invalid: expected {rule}")
