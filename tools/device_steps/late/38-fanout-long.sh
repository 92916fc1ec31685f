#!/usr/bin/env bash
# Fan-out at 32,000 tokens (issue 13), Qwen2.5-7B shape: FANOUT_LONG (default 4 branches) with the warm baseline
# measured (4 full prefills a round), kvrt isolated and shared, the ideal; 3 rounds. Budget ~70 s.
# Writes $RESULTS/fanout-long/fanout/.
set -uo pipefail
OUTDIR="$RESULTS/fanout-long"
MODEL="${FANOUT_MODEL:-$MODELS/qwen2.5-7b.gguf}"
mkdir -p "$OUTDIR"
[ -f "$MODEL" ] || { echo "missing $MODEL"; exit 1; }
python3 -m kvrt.cli bench fanout --model "$MODEL" --out "$OUTDIR" --skip-headline --trials 3 --max-tokens 6 \
  --n-batch "${N_BATCH:-2048}" --flash-attn "${FLASH_ATTN:-off}" --ideal-decode "${IDEAL_DECODE:-batched}" \
  --sweep-docs "${FANOUT_LONG:-32000:4}" \
  --sweep-arms baseline,isolated,shared,ideal 2>&1 | tr '\r' '\n' | grep -v ': prefill ' | tee "$OUTDIR/bench_fanout.txt"
