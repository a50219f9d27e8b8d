#!/usr/bin/env bash
# Triton's HTTP generate endpoints with curl, against `pagedllm serve` (HTTP on :8000).
#   ./client_examples/http_generate.sh "def hello():"
# JSON keys that are not input tensors (max_tokens, temperature, ...) become request
# parameters, which pagedllm reads as sampling parameters (numbers may be strings).
set -euo pipefail
URL="${URL:-http://localhost:8000}"
MODEL="${MODEL:-llm}"
PROMPT="${1:-def fibonacci(n):}"
BODY=$(python3 -c 'import json, sys; print(json.dumps({"text_input": sys.argv[1], "max_tokens": 32, "temperature": 0}))' "$PROMPT")

echo "== generate (one response; the prompt is prepended unless exclude_input_in_output is true)"
curl -sS -X POST "$URL/v2/models/$MODEL/generate" -d "$BODY"
echo

echo "== generate_stream (server-sent events; each carries only new text)"
STREAM_BODY=$(python3 -c 'import json, sys; b = json.loads(sys.argv[1]); b["stream"] = True; print(json.dumps(b))' "$BODY")
curl -sS -N -X POST "$URL/v2/models/$MODEL/generate_stream" -d "$STREAM_BODY"
