#!/usr/bin/env bash
# The OpenAI-compatible API of `pagedllm serve --openai-port 9000` with curl.
#   ./client_examples/openai_curl.sh "def hello():"
# MODEL is a name from /v1/models; chat needs a model with a chat template (CHAT=0 skips it,
# as for the embedded default model, which has none).
set -euo pipefail
URL="${URL:-http://localhost:9000}"
MODEL="${MODEL:-llm}"
PROMPT=$(python3 -c 'import json, sys; print(json.dumps(sys.argv[1]))' "${1:-def fibonacci(n):}")  # JSON-quoted

echo "== GET /v1/models"
curl -sS "$URL/v1/models"
echo

echo "== POST /v1/completions (one JSON body, with usage)"
curl -sS "$URL/v1/completions" -H "Content-Type: application/json" \
  -d "{\"model\": \"$MODEL\", \"prompt\": $PROMPT, \"max_tokens\": 32, \"temperature\": 0}"
echo

echo "== POST /v1/completions, streamed (SSE data: chunks, then data: [DONE])"
curl -sS -N "$URL/v1/completions" -H "Content-Type: application/json" \
  -d "{\"model\": \"$MODEL\", \"prompt\": $PROMPT, \"max_tokens\": 16, \"temperature\": 0, \"stream\": true}"

if [ "${CHAT:-1}" = "1" ]; then
  echo "== POST /v1/chat/completions, streamed, usage in the last chunk"
  curl -sS -N "$URL/v1/chat/completions" -H "Content-Type: application/json" \
    -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": $PROMPT}], \"max_tokens\": 32,
         \"stream\": true, \"stream_options\": {\"include_usage\": true}}"
fi
