#!/usr/bin/env python3
"""Stream a chat completion from `pagedllm serve --openai-port 9000` with the official ``openai`` client.

    pagedllm serve --model Qwen/Qwen2.5-0.5B-Instruct --openai-port 9000   # a model with a chat template
    python client_examples/openai_chat_stream.py "Write a haiku about paged attention." --model Qwen/Qwen2.5-0.5B-Instruct

The prompt is rendered by the model's own chat template on the server; a model
without one (such as the embedded default model) answers 400, so use
``openai_completions.py`` there. Needs only ``pip install openai``.
"""
from __future__ import annotations

import argparse
import sys

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("message", nargs="?", default="Write a Python function that reverses a string.")
    parser.add_argument("--base-url", default="http://localhost:9000/v1")
    parser.add_argument("--model", default="llm", help="a name from GET /v1/models")
    parser.add_argument("--system", default="You are a helpful assistant.")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="unused")
    stream = client.chat.completions.create(
        model=args.model,
        messages=[{"role": "system", "content": args.system}, {"role": "user", "content": args.message}],
        max_tokens=args.max_tokens, temperature=args.temperature, stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            sys.stdout.write(chunk.choices[0].delta.content)
            sys.stdout.flush()
        if chunk.usage is not None:
            print(f"\n--- {chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens")


if __name__ == "__main__":
    main()
