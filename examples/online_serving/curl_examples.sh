#!/usr/bin/env bash
# curl against `vllm serve <model> --omni`. Set BASE_URL (default http://localhost:8000),
# MODEL (the served model name) and, for the request-time adapter, ADAPTER_PATH (inside --lora-dirs).
# Each command prints one JSON document on one line.
set -euo pipefail
BASE_URL=${BASE_URL:-http://localhost:8000}
MODEL=${MODEL:-tiny}
ADAPTER_PATH=${ADAPTER_PATH:-/srv/loras/style}

curl -sS "$BASE_URL/v1/models"; echo

curl -sS "$BASE_URL/v1/chat/completions" -H "Content-Type: application/json" \
  -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"hello\"}], \"max_tokens\": 8}"; echo

curl -sS "$BASE_URL/v1/chat/completions" -H "Content-Type: application/json" \
  -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"hello\"}], \"max_tokens\": 8, \"lora\": {\"name\": \"style\", \"path\": \"$ADAPTER_PATH\"}}"; echo

curl -sS "$BASE_URL/v1/completions" -H "Content-Type: application/json" \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"hello world\", \"max_tokens\": 8, \"lora\": [{\"name\": \"style\", \"path\": \"$ADAPTER_PATH\", \"scale\": 1.0}]}"; echo
