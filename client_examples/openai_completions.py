#!/usr/bin/env python3
"""A completion from `pagedllm serve --openai-port 9000` with the official ``openai`` client.

    python client_examples/openai_completions.py "def fibonacci(n):" --max-tokens 48

Works with any model, chat template or not (the embedded default model has none).
Needs only ``pip install openai``; the API key is not checked.
"""
from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="?", default="def fibonacci(n):")
    parser.add_argument("--base-url", default="http://localhost:9000/v1")
    parser.add_argument("--model", default="llm", help="a name from GET /v1/models")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("-n", type=int, default=1, help="completions to sample for the one prompt")
    parser.add_argument("--stop", action="append", default=None, help="a stop string; repeatable")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key="unused")
    completion = client.completions.create(
        model=args.model, prompt=args.prompt, max_tokens=args.max_tokens, temperature=args.temperature, n=args.n,
        stop=args.stop,
        extra_body={"repetition_penalty": 1.3},  # a vLLM extra; keeps the small embedded model out of loops
    )
    for choice in completion.choices:
        print(f"--- choice {choice.index} (finish_reason={choice.finish_reason})\n{args.prompt}{choice.text}")
    usage = completion.usage
    print(f"--- usage: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens")


if __name__ == "__main__":
    main()
