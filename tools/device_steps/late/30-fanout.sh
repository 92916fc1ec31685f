#!/usr/bin/env bash
# Fan-out (issue 3) on the H200 with the Qwen2.5-7B-shaped F16 preset ($MODELS/qwen2.5-7b.gguf,
# random weights: timings depend on shape and type, not on the values). Writes $RESULTS/fanout/.
#   1. bench/bench_snapshot.py on a 3501-token document: capture into the pinned host pool,
#      restore into a pooled context, device-tier restore, fork of 8 sequences by seq_cp,
#      disk round trip (pytest-benchmark JSON: bench_snapshot.json).
#   2. `kvrt bench fanout`: the seed's two-branch table on the 3501-token fox document,
#      baseline vs isolated vs shared, best of 3 by 2*TTFT_pct + E2E_pct (best_run.json,
#      all_trials.csv, plots/). On the clock: baseline (the seed's, unchanged) = per branch a
#      fresh context created, prefilling the whole document, decoding, freed; kvrt = one prefill
#      into an already-created pooled context (isolated: one-sequence pool; shared: unified pool
#      with n_seq_max >= branches), then capture + restore, or seq_cp chunk by chunk during the prefill, then the branches. Pools and
#      the pinned snapshot buffer come from one untimed warm-up run per mode before the trials.
#      Then the sweep N in {1,2,8,32,50} x document in {3501, 32000} tokens, both modes
#      (sweep.csv). SWEEP BASELINE: not run per point - one fresh-context branch measured once per
#      length, multiplied by N (columns Baseline_Per_Branch_Ms, Baseline_Measured_Branches=1).
# What to check: best_run.json Kvrt_Contexts_Created == 0 in both modes (no context creation on the clock);
# shared E2E_Speedup >= 1.9 (3501 tokens, 2 branches); isolated Kvrt_Branch2_Activation_Ms <= 10 ms (it
# includes the prompt decode and first sample, Kvrt_Branch2_Restore_Ms is the lease + restore alone);
# sweep.csv isolated Mean_Activation_Ms / Mean_Restore_Ms (branches 2..N, the restored ones) at 32000 <= 60 ms;
# shared N=50 x 32000 E2E_Speedup >= 40; Fork_Ms_Per_Branch flat across 3501 vs 32000; Kvrt_Contexts_Created 0;
# host pool pinned (bench_snapshot.json runs on a GPU machine: HostPool() pins when CuPy sees it).
# Budget (H200 estimate, prefill 3501 ~0.12-0.16 s, 32000 ~2.1 s, ~60 ms of decode per isolated branch):
#   model load (~15 GB) + headline ~4 s (3 x (baseline 0.4 + isolated 0.24 + shared 0.2) + 2 warm-up runs)
#   + sweep 3501 ~9 s + sweep 32000 ~40 s (baseline 2.3, isolated warm-up 2.5 incl. pinning 1.8 GB,
#   isolated 5 prefills + 93 branches (88 restored) x ~60-105 ms ~20 s, shared 5 x ~2.4 s) + plots: well inside 170 s.
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
