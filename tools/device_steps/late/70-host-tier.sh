#!/usr/bin/env bash
# The batched server's host tier on the H200 (bench/bench_host_tier.py), Qwen2.5-7B shape, flash attention on:
# an evicted history of 8,192 and of 32,768 tokens restored from the tier's arena (pinned here, taken once), from a
# NumPy (pageable) copy, and prefilled again; the ideal is one pinned host-to-device copy of the same bytes (CuPy).
# Budget ~70 s (model load ~10 s each, 6 prefills of each length). Writes $RESULTS/host-tier/doc-N.{json,log}.
set -uo pipefail
out="${RESULTS:-/tmp/kvrt-results}/host-tier"
MODEL="${MODELS:-/tmp/kvrt-models}/qwen2.5-7b.gguf"
mkdir -p "$out"
[ -f "$MODEL" ] || { echo "missing $MODEL"; exit 1; }
for n in ${HOST_TIER_DOCS:-8192 32768}; do
  KVRT_BENCH_MODEL="$MODEL" KVRT_BENCH_DOC_TOKENS=$n KVRT_BENCH_FLASH_ATTN=on timeout 100 \
    python3 tools/pytest_llama_first.py bench/bench_host_tier.py -p no:cacheprovider -q --benchmark-enable \
    --benchmark-json="$out/doc-$n.json" --benchmark-columns=min,median,max 2>&1 | grep -v '^llama\|^load\|^print_info' \
    | tee "$out/doc-$n.log"
done
