#!/usr/bin/env bash
# Fan-out (issue 3) on the H200 with the Qwen2.5-7B-shaped F16 preset ($MODELS/qwen2.5-7b.gguf,
# random weights: timings depend on shape and type, not on the values). Writes $RESULTS/fanout/.
#   1. bench/bench_snapshot.py on a 3501-token document: capture into the pinned host pool,
#      restore into a pooled context, device-tier restore, fork of 8 sequences by seq_cp,
#      disk round trip (pytest-benchmark JSON: bench_snapshot.json).
#   2. `kvrt bench fanout`: the seed's two-branch table on the 3501-token fox document,
#      baseline (two fresh contexts, each prefilling) vs isolated vs shared, best of 3 by
#      2*TTFT_pct + E2E_pct (best_run.json, all_trials.csv, plots/), then the sweep
#      N in {1,2,8,32,50} x document in {3501, 32000} tokens, both modes (sweep.csv); the
#      baseline there is one measured fresh branch per length, scaled by N (column says so).
# What to check: best_run.json isolated Kvrt_Branch2_Activation_Ms <= 10 ms (3501 tokens; it includes the
# prompt decode and first sample, Kvrt_Branch2_Restore_Ms is the lease + restore alone);
# sweep.csv isolated Mean_Activation_Ms / Mean_Restore_Ms at 32000 <= 60 ms; shared N=50 x 32000 E2E_Speedup >= 40;
# E2E_Speedup >= 1.9 in best_run.json; Fork_Ms_Per_Branch flat across 3501 vs 32000;
# host pool pinned (bench_snapshot.json runs on a GPU machine: HostPool() pins when CuPy sees it).
# Budget: ~150 s of wall time.
set -uo pipefail
OUTDIR="$RESULTS/fanout"
MODEL="$MODELS/qwen2.5-7b.gguf"
mkdir -p "$OUTDIR"
[ -f "$MODEL" ] || { echo "missing $MODEL"; exit 1; }
python3 -c "from kvrt.hostpool import HostPool; print('host pool pinned:', HostPool().pinned)" \
  2>&1 | tee "$OUTDIR/hostpool.txt"

KVRT_BENCH_MODEL="$MODEL" KVRT_BENCH_DOC_TOKENS=3501 timeout 45 python3 tools/pytest_llama_first.py bench/bench_snapshot.py -q \
  -p no:cacheprovider --benchmark-enable --benchmark-min-rounds=5 --benchmark-max-time=0.3 \
  --benchmark-columns=min,median,max,rounds --benchmark-json "$OUTDIR/bench_snapshot.json" \
  2>&1 | tail -n 20 | tee "$OUTDIR/bench_snapshot.txt"

timeout 170 python3 -m kvrt.cli bench fanout --model "$MODEL" --out "$RESULTS" --doc-tokens 3501 --trials 3 \
  --max-tokens 6 --n-batch 2048 --sweep-n 1,2,8,32,50 --sweep-docs 3501,32000 --baseline-branches 1 \
  2>&1 | tr '\r' '\n' | grep -v ': prefill ' | tee "$OUTDIR/bench_fanout.txt"
