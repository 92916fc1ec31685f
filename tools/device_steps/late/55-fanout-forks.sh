#!/usr/bin/env bash
# Issue 3: shared mode's two forks side by side in one run, Qwen2.5-7B shape ($MODELS/qwen2.5-7b.gguf):
#   seq_cp  prefill the document as sequence 0, then llama_memory_seq_cp to each branch (the default);
#   ids     prefill the document once with every branch's sequence id on each token, no fork step.
# Same points for both: N in {8, 50} (FORK_SWEEP_N) x document in {3501, 32000} tokens, 6 greedy tokens per branch.
# Compare in $RESULTS/fanout-forks/{seq_cp,ids}/sweep.csv: Fork_Ms_Per_Branch, Kvrt_Prefill_Ms and
# Kvrt_End_To_End_Ms per point (the ids path pays its per-branch cost inside the prefill).
# Budget ~120 s (each 32000-token point ~2.5 s per trial).
set -uo pipefail
OUTDIR="$RESULTS/fanout-forks"
MODEL="$MODELS/qwen2.5-7b.gguf"
mkdir -p "$OUTDIR"
[ -f "$MODEL" ] || { echo "missing $MODEL"; exit 1; }
for fork in seq_cp ids; do
  timeout 100 python3 -m kvrt.cli bench fanout --model "$MODEL" --out "$OUTDIR/$fork" --skip-headline --fork "$fork" \
    --max-tokens 6 --n-batch 2048 --sweep-n ${FORK_SWEEP_N:-8,50} --sweep-docs 3501,32000 --sweep-modes shared --baseline-branches 1 \
    2>&1 | tr '\r' '\n' | grep -v ': prefill ' | tee "$OUTDIR/$fork.txt"
done
