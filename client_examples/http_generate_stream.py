#!/usr/bin/env python3
"""Stream a completion from Triton's HTTP ``generate_stream`` endpoint (server-sent events).

    python client_examples/http_generate_stream.py "import os" --max-tokens 48

Each event is ``data: {json}``; ``text_output`` holds only the new text. Needs ``requests``.
"""
from __future__ import annotations

import argparse
import json
import sys

import requests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    # Keys that are not input tensors ("max_tokens", "temperature") travel as request parameters.
    body = {"text_input": args.prompt, "stream": True, "max_tokens": args.max_tokens,
            "temperature": args.temperature}
    with requests.post(f"{args.url}/v2/models/{args.model}/generate_stream", json=body, stream=True,
                       timeout=600) as response:
        if response.status_code != 200:
            print(f"error {response.status_code}: {response.text}", file=sys.stderr)
            return 1
        print(args.prompt, end="", flush=True)
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[len(b"data: "):])
            if "error" in event:
                print(f"\nerror: {event['error']}", file=sys.stderr)
                return 1
            print(event["text_output"], end="", flush=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
