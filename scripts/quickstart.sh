#!/usr/bin/env bash
# Set up, compile the default model for this machine's CPU, and stream a short chat answer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/mobilec compile --model default --target host --quant q0f32 --output build/smollm2-host --overwrite
.venv/bin/mobilec generate build/smollm2-host --chat --max-new-tokens 64 \
  --prompt "${1:-What is the capital of France? Answer in one sentence.}"
