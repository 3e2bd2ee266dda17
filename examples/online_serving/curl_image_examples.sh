#!/usr/bin/env bash
# curl against `vllm serve <diffusers-dir> --omni` (image pipelines). Set BASE_URL, MODEL and
# ADAPTER_PATH (a PEFT folder or .safetensors file inside the server's --lora-dirs), and
# IMAGE (a PNG for /v1/images/edits). Each command prints one JSON document on one line.
set -euo pipefail
BASE_URL=${BASE_URL:-http://localhost:8000}
MODEL=${MODEL:-z-image}
ADAPTER_PATH=${ADAPTER_PATH:-/srv/loras/style}
IMAGE=${IMAGE:-input.png}

curl -sS "$BASE_URL/v1/images/generations" -H "Content-Type: application/json" \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"a red fox\", \"size\": \"64x64\", \"n\": 1, \"num_inference_steps\": 2, \"guidance_scale\": 0.0, \"seed\": 0, \"lora\": [{\"name\": \"style\", \"path\": \"$ADAPTER_PATH\", \"scale\": 0.8}]}"; echo

curl -sS "$BASE_URL/v1/chat/completions" -H "Content-Type: application/json" \
  -d "{\"model\": \"$MODEL\", \"messages\": [{\"role\": \"user\", \"content\": \"a red fox\"}], \"height\": 64, \"width\": 64, \"num_inference_steps\": 2, \"guidance_scale\": 0.0, \"seed\": 0}"; echo

curl -sS "$BASE_URL/v1/images/edits" -F "image=@$IMAGE" -F "prompt=a red fox" -F "size=64x64" \
  -F "num_inference_steps=2" -F "guidance_scale=0.0" -F "seed=0" \
  -F "lora={\"name\": \"style\", \"path\": \"$ADAPTER_PATH\"}"; echo
