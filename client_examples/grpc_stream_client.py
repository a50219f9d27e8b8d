#!/usr/bin/env python3
"""Stream one completion from a pagedllm (or vLLM-backend) Triton model over gRPC and print it as it arrives.

    python client_examples/grpc_stream_client.py "def fibonacci(n):" --max-tokens 64

Needs only ``tritonclient[grpc]``. ``stream_generate`` is importable (the load client uses it).
"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc as grpcclient


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One streamed response: the new text, how many tokens it carries, and when it arrived."""

    text: str
    num_tokens: int
    arrived: float  # time.perf_counter()
    finish_reason: str | None


def build_inputs(prompt: str, sampling: dict[str, object], stream: bool = True) -> list[grpcclient.InferInput]:
    def tensor(name: str, value: np.ndarray, dtype: str) -> grpcclient.InferInput:
        item = grpcclient.InferInput(name, list(value.shape), dtype)
        item.set_data_from_numpy(value)
        return item

    return [
        tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        tensor("stream", np.array([stream]), "BOOL"),
        tensor("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
        tensor("exclude_input_in_output", np.array([True]), "BOOL"),
        tensor("return_num_output_tokens", np.array([True]), "BOOL"),
        tensor("return_finish_reason", np.array([True]), "BOOL"),
    ]


def stream_generate(client: grpcclient.InferenceServerClient, model: str, prompt: str,
                    sampling: dict[str, object], timeout_s: float = 600.0) -> Iterator[StreamEvent]:
    """Yield the responses of one streamed request; raises ``RuntimeError`` with the server's error."""
    responses: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer(model, build_inputs(prompt, sampling), request_id=uuid.uuid4().hex,
                                  enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=timeout_s)
            arrived = time.perf_counter()
            if error is not None:
                raise RuntimeError(str(error))
            text = result.as_numpy("text_output")
            if text is not None:
                tokens = result.as_numpy("num_output_tokens")
                reason = result.as_numpy("finish_reason")
                finish = reason[0].decode() if reason is not None else "None"
                yield StreamEvent(text[0].decode(), int(tokens[0]) if tokens is not None else 0, arrived,
                                  None if finish == "None" else finish)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return
    finally:
        client.stop_stream()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC address")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="> 1 discourages loops; 1.3 suits the small embedded model")
    args = parser.parse_args()
    sampling: dict[str, object] = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                                   "repetition_penalty": args.repetition_penalty}
    if args.seed is not None:
        sampling["seed"] = args.seed
    client = grpcclient.InferenceServerClient(args.url)
    start = time.perf_counter()
    tokens = 0
    finish = None
    print(args.prompt, end="", flush=True)
    try:
        for event in stream_generate(client, args.model, args.prompt, sampling):
            print(event.text, end="", flush=True)
            tokens += event.num_tokens
            finish = event.finish_reason or finish
    except RuntimeError as error:
        print(f"\nerror: {error}", file=sys.stderr)
        return 1
    finally:
        client.close()
    elapsed = time.perf_counter() - start
    print(f"\n\n[{tokens} tokens in {elapsed:.2f} s, finish_reason={finish}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
