#!/usr/bin/env bash
# KV prefetch (issue 15) on the H200, Qwen2.5-7B shape ($MODELS/qwen2.5-7b.gguf, F16, random weights):
# `kvrt bench prefetch`: agents with 8k-32k-token histories (1.9 GB of state at 32k) served round robin, one turn
# of 4 greedy tokens each, 3 rounds, under a ledger cap of the weights + 2 staging contexts, three arms
# interleaved round by round: sync (restore and capture on the decode path, today's scheduler), prefetch
# (kvrt.state.staging.KVStager: the next agent restored on a copy thread while the current one decodes),
# resident (every agent in a context of its own: the yardstick). Ideal = a pinned host-to-device copy of the
# same bytes through CuPy, measured in the same run.
#   flash attention on:  PREFETCH_AGENTS (50) agents, at most PREFETCH_TIMEOUT_ON (230) s -> $RESULTS/prefetch/fa-on/
#   flash attention off: only with PREFETCH_FA_OFF=1: PREFETCH_AGENTS_OFF (12) agents, at most PREFETCH_TIMEOUT_OFF
#                        (100) s -> .../fa-off/ (llama.cpp moves V one row at a time then: 170-200 ms a restore
#                        whatever its size on the H200, 2026-12-03; nothing to hide it under)
# A turn decodes PREFETCH_DECODE (16) greedy tokens: the time a prefetch has to hide the next agent's copy.
# Budget ~240 s (model load ~10 s, pinning ~57 GB of host memory for 50 agents' states in the first round).
# What to check (prefetch.json, modes[0].goals): prefetch_exposed_over_ideal <= 0.10, sync_swap_in_over_ideal
# <= 1.05, staging_fraction_of_ideal_bandwidth >= 0.90, prefetch_throughput_fraction_of_resident >= 0.90;
# tokens_identical_to_resident all true. rc 3: a bound failed (a fraction of an ideal above 1); rc 4: an arm's
# tokens differ from the resident arm's; rc 124: the timeout.
set -uo pipefail
OUT_DIR="${RESULTS:-/tmp/kvrt-results}/prefetch"
MODEL="${PREFETCH_MODEL:-${MODELS:-/tmp/kvrt-models}/qwen2.5-7b.gguf}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
[ -f "$MODEL" ] || { echo "missing $MODEL"; exit 1; }
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader | sed 's/^/prefetch: GPU memory before: /'
free -g | sed -n 2p | sed 's/^/prefetch: host memory (GiB): /'
status=0
run_mode() {  # run_mode FLASH AGENTS LIMIT_S
  local flash=$1 agents=$2 limit=$3 rc t0=$SECONDS
  echo "prefetch: flash_attn=$flash, $agents agents, ${PREFETCH_TOKENS:-8192-32768} tokens, limit ${limit} s"
  timeout --kill-after=10 "$limit" python3 -m kvrt.cli bench prefetch --model "$MODEL" --out "$OUT_DIR/fa-$flash" \
    --agents "$agents" --tokens "${PREFETCH_TOKENS:-8192-32768}" --decode-tokens "${PREFETCH_DECODE:-16}" \
    --rounds "${PREFETCH_ROUNDS:-3}" --staging-contexts 2 --prefill-batch 2048 --flash-attn "$flash" 2>&1 \
    | grep --line-buffered -v '^llama\|^load\|^print_info\|^\.*$' | tee "$OUT_DIR/fa-$flash.log"
  rc=${PIPESTATUS[0]}
  echo "prefetch: flash_attn=$flash rc=$rc in $((SECONDS - t0)) s$([ "$rc" = 124 ] && echo ' (TIMEOUT)')"
  [ "$rc" = 0 ] || status=$rc
}
run_mode on "${PREFETCH_AGENTS:-50}" "${PREFETCH_TIMEOUT_ON:-230}"
[ -z "${PREFETCH_FA_OFF:-}" ] || run_mode off "${PREFETCH_AGENTS_OFF:-12}" "${PREFETCH_TIMEOUT_OFF:-100}"
exit "$status"
