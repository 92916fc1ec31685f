#!/usr/bin/env bash
# Issue 24: what recreating the engine's context in the other KV layout costs (tools/probe_relayout.py): the
# peer's sizes (163,840 cells, 32 slots, n_batch 2048, micro-batch 512, flash attention on) on the Qwen2.5-7B shape
# ($MODELS/qwen2.5-7b.gguf): llama_free and llama_init_from_model of each layout with llama.cpp's log lines
# stamped, the first decodes after a creation against the next, and a creation with the other context alive.
# Budget ~40 s (model load ~10 s, 7 creations and 16 short decodes). Writes $RESULTS/relayout/{probe.json,probe.log}.
set -uo pipefail
out="${RESULTS:-/tmp/kvrt-results}/relayout"
MODEL="${MODELS:-/tmp/kvrt-models}/qwen2.5-7b.gguf"
mkdir -p "$out"
[ -f "$MODEL" ] || { echo "missing $MODEL"; exit 1; }
timeout "${RELAYOUT_TIMEOUT:-120}" python3 tools/probe_relayout.py "$MODEL" --rounds 3 --out "$out/probe.json" 2>&1 \
  | tee "$out/probe.log"
