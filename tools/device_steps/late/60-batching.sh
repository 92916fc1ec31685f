#!/usr/bin/env bash
# Continuous batching of agents (issue 14) on the H200. Model: $MODELS/qwen2.5-7b.gguf (Qwen2.5-7B shape, F16,
# random weights). Writes $RESULTS/batching/. Budget: ~240 s of wall time.
# 50 agents, 3 turns each (a shared preamble, a role, a question per turn), 16 greedy tokens a turn, closed loop;
# 3 rounds of: the same turns one at a time through the per-agent Scheduler (contexts created before the clock)
# vs all agents at once through BatchedScheduler (one llama_decode per step for every agent); then the batched
# ideal: bare decode steps of one batch of 50 sequences holding an agent's mid-run history each.
# Per batched round the log has the engine's steps, ms a step and the share in llama_decode.
# What to check (issue 14's goals): speedup.median >= 8, batched.ttft_p99_over_p50.median <= 2,
# lost_or_mixed_tokens == 0 in both arms, fraction_of_ideal (reported; its bound is 1), bounds.json violated == 0.
set -uo pipefail
OUT_DIR="${RESULTS:-/tmp/kvrt-results}/batching"
QWEN="$MODELS/qwen2.5-7b.gguf"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
[ -f "$QWEN" ] || { echo "missing $QWEN"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
t=$SECONDS
timeout "${BATCHING_TIMEOUT_S:-240}" python3 -m kvrt.cli bench batching --out "$RESULTS" --model "$QWEN" \
  --agents "${BATCHING_AGENTS:-50}" --turns 3 --gen-tokens 16 --rounds 3 --slots 64 --n-batch 2048 > "$OUT_DIR/batching.log" 2>&1
echo "batching: rc=$? in $((SECONDS - t)) s"
grep -v '^[ {}]' "$OUT_DIR/batching.log" | tail -n 12
