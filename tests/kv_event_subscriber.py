"""A KV cache event subscriber for tests: collects [topic, seq, payload] from a pagedllm (or vLLM) publisher,
replays from its ROUTER socket, and rebuilds the set of cached block hashes the events describe.

Run as a script with vLLM's Python (``python kv_event_subscriber.py frames.json``) it decodes the
frames with ``vllm.distributed.kv_events.KVEventBatch`` and prints the rebuilt hashes (hex) as
JSON: the check that vLLM's own decoder reads our stream.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import zmq

END_SEQ = -1


def apply(events: Iterable[Any], held: set[bytes]) -> None:
    """Apply decoded events (vLLM's or ours: the same classes by name) to ``held``, as a router's index would."""
    for event in events:
        kind = type(event).__name__
        if kind == "BlockStored":
            held.update(event.block_hashes)
        elif kind == "BlockRemoved":
            held.difference_update(event.block_hashes)
        elif kind == "AllBlocksCleared":
            held.clear()
        else:
            raise AssertionError(f"unknown event {kind}")


class Subscriber:
    """A SUB socket on ``endpoint``. With ``follow``, a thread reads it all along, as a router's event loop does:
    a SUB socket nobody reads while its publisher restarts received none of the new publisher's batches in our
    runs, while one read between the lives received both (our reading: libzmq finishes a reconnection when
    the application calls into the socket), so a subscriber read only at the end is not what a router sees."""

    def __init__(self, endpoint: str, topic: bytes = b"", follow: bool = False) -> None:
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self.frames: list[tuple[bytes, int, bytes]] = []
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._follow, daemon=True) if follow else None
        if self._reader is not None:
            self._reader.start()

    def _receive(self, wait_s: float) -> bool:
        if not self._sub.poll(int(wait_s * 1000)):
            return False
        topic, seq, payload = self._sub.recv_multipart()
        self.frames.append((topic, int.from_bytes(seq, "big", signed=True), payload))
        return True

    def _follow(self) -> None:
        while not self._stop.is_set():
            self._receive(0.02)

    def drain(self, quiet_s: float = 0.5, timeout_s: float = 30.0) -> None:
        """Receive until nothing came for ``quiet_s``."""
        deadline = time.monotonic() + timeout_s
        if self._reader is None:
            while time.monotonic() < deadline and self._receive(quiet_s):
                pass
            return
        seen = -1
        while time.monotonic() < deadline and seen != len(self.frames):
            seen = len(self.frames)
            time.sleep(quiet_s)

    def close(self) -> None:
        self._stop.set()
        if self._reader is not None:
            self._reader.join()
        self._sub.close(linger=0)
        self._context.term()


def replay(endpoint: str, start: int, timeout_s: float = 10.0) -> list[tuple[bytes, int, bytes]]:
    """Every buffered batch from ``start`` on, through the ROUTER socket at ``endpoint`` (a DEALER client)."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        frames = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and dealer.poll(int(timeout_s * 1000)):
            _, topic, seq, payload = dealer.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == END_SEQ:
                return frames
            frames.append((topic, number, payload))
        raise AssertionError("the replay did not end with the end marker")
    finally:
        dealer.close(linger=0)
        context.term()


def _decode_with_vllm(path: str) -> None:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    held: set[bytes] = set()
    batches = 0
    for payload_hex in json.loads(open(path).read()):
        batch = decoder.decode(bytes.fromhex(payload_hex))
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        apply(batch.events, held)
        batches += 1
    print(json.dumps({"batches": batches, "held": sorted(h.hex() for h in held)}))


if __name__ == "__main__":
    _decode_with_vllm(sys.argv[1])
