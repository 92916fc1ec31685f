#!/usr/bin/env bash
# Issue 15: a shared-mode fork (llama_memory_seq_cp of the whole document into a branch) at 3,501, 32,000 and
# 131,072 tokens of the Qwen2.5-7B shape ($MODELS/qwen2.5-7b.gguf), flash attention on, 8 branches, median of 5
# (tools/probe_fork_length.py: fork of one branch, fork of all 8 per branch, drop of one; ns per cell of each).
# Budget ~110 s (model load ~10 s, prefills ~0.2 + 2 + ~60 s: the 131k prefill is attention-bound).
# Writes $RESULTS/fork-length/{probe.json,probe.log}.
set -uo pipefail
out="${RESULTS:-/tmp/kvrt-results}/fork-length"
MODEL="${MODELS:-/tmp/kvrt-models}/qwen2.5-7b.gguf"
mkdir -p "$out"
[ -f "$MODEL" ] || { echo "missing $MODEL"; exit 1; }
timeout "${FORK_LENGTH_TIMEOUT:-150}" python3 tools/probe_fork_length.py "$MODEL" --docs "${FORK_LENGTH_DOCS:-3501,32000,131072}" \
  --branches 8 --reps 5 --flash-attn on --out "$out/probe.json" 2>&1 | grep -v '^llama\|^load\|^print_info' | tee "$out/probe.log"
