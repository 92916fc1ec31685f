#!/usr/bin/env bash
# Agent switching (issue 13) on the H200, Qwen2.5-7B shape: `kvrt bench agents --parts swap` at 4,096 and
# 32,768 tokens, 3 trials: re-prefill (the baseline), kvrt swap-out / swap-in (kept and fresh context) / switch,
# the ideal = the pinned host-to-device copy of the same bytes at the measured PCIe speed (CuPy, CUDA events),
# and llama-cpp-python's Llama save_state/load_state through LlamaRAMCache (both lengths) and LlamaDiskCache
# (4,096 only: it pickles 2 GB per trial at 32k). Fails (rc 3) when a swap-in beats its ideal. Budget ~60 s.
# Writes $RESULTS/swap/agents/.
set -uo pipefail
OUT_DIR="${RESULTS:-/tmp/kvrt-results}/swap"
MODEL="${SWAP_MODEL:-$MODELS/qwen2.5-7b.gguf}"
mkdir -p "$OUT_DIR"
[ -f "$MODEL" ] || { echo "missing $MODEL"; exit 1; }
python3 -m kvrt.cli bench agents --out "$OUT_DIR" --parts swap --swap-model "$MODEL" --models "$MODEL,$MODEL,$MODEL" \
  --swap-docs "${SWAP_DOCS:-4096,32768}" --trials 3 --swap-peers ram,disk --peer-disk-max-tokens 8192 \
  --flash-attn "${FLASH_ATTN:-off}" 2>&1 | grep -v 'LlamaDiskCache\|^ *["{}]\|^ *\[\|^ *\]' | tee "$OUT_DIR/swap.log"
