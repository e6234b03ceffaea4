#!/usr/bin/env bash
# Set up, compile the default model for this machine's CPU on its default path, the fast one (a GGUF keeps its own
# blocks on the integer-dot kernels), stream a short chat answer, then say what was built and its decode speed against this
# machine's memory-bandwidth floor.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/mobilec compile --model default --target host --output build/smollm2-host --overwrite
.venv/bin/mobilec generate build/smollm2-host --chat --max-new-tokens 64 \
  --prompt "${1:-What is the capital of France? Answer in one sentence.}"
.venv/bin/mobilec bench build/smollm2-host --repeat 1
