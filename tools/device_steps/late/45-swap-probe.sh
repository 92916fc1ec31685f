#!/usr/bin/env bash
# Issue 4: where a 32k-token 7B-shaped swap-in spends the time beyond its pinned transfer
# (tools/probe_swap_in.py: restore vs one-copy H2D vs llama.cpp's per-tensor synchronous copies at the
# blob's own offsets, aligned, unsynchronised; metadata alone; pinned memory per NUMA node).
# Budget ~60 s (model load ~10 s, 32k prefill ~2 s, 8 timed series of 5). Writes $RESULTS/swap-probe/.
set -uo pipefail
out="${RESULTS:-/tmp/kvrt-results}/swap-probe"
mkdir -p "$out"
timeout 120 python3 tools/probe_swap_in.py "${MODELS:-/tmp/kvrt-models}/qwen2.5-7b.gguf" --tokens 32768 --reps 5 \
  --out "$out/probe.json" 2>&1 | grep -v '^llama\|^load\|^print_info' | tee "$out/probe.log"
