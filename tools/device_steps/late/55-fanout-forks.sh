#!/usr/bin/env bash
# Issue 3: shared mode's two forks side by side in one step, Qwen2.5-7B shape ($MODELS/qwen2.5-7b.gguf):
#   during_prefill  seq_cp of each prefill chunk to every branch right after its llama_decode returns,
#                   while the GPU still computes the chunk (the default);
#   after_prefill   seq_cp of the whole document to every branch once the prefill is done.
# Same points for both: N in {1, 8, 50} (FORK_SWEEP_N; N=1 is the prefill an overlapped fork is held
# against) x document in {3501, 32000} tokens, 6 greedy tokens per branch.
# Compare in $RESULTS/fanout-forks/<fork>/fanout/summary.csv (Arm shared): Fork_Ms_Per_Branch (host time of the fork),
# Fork_Exposed_Ms_Per_Branch (what of it the clock saw: ~0 when hidden under the prefill), Kvrt_Prefill_Ms,
# Kvrt_End_To_End_Ms and E2E_Speedup (target at N=50 x 32000: >= 40x).
# Budget: the warm baseline is measured at every point (50 x 32,000 tokens: ~105 s a round), so trim
# FORK_SWEEP_N; not part of the default run (SKIP_STEP=55-fanout-forks).
set -uo pipefail
OUTDIR="$RESULTS/fanout-forks"
MODEL="$MODELS/qwen2.5-7b.gguf"
mkdir -p "$OUTDIR"
[ -f "$MODEL" ] || { echo "missing $MODEL"; exit 1; }
for fork in during_prefill after_prefill; do
  timeout 100 python3 -m kvrt.cli bench fanout --model "$MODEL" --out "$OUTDIR/$fork" --skip-headline --fork "$fork" \
    --max-tokens 6 --n-batch 2048 --sweep-n "${FORK_SWEEP_N:-1,8,50}" --sweep-docs 3501,32000 \
    --sweep-arms baseline,shared,ideal --flash-attn off 2>&1 | tr '\r' '\n' | grep -v ': prefill ' | tee "$OUTDIR/$fork.txt"
done
