#!/usr/bin/env bash
# Issue 24: what kvrt's engine does with the peer's workloads without the HTTP front (tools/probe_engine_alone.py):
# the same engine as the peer's kvrt arm (its `kvrt serve` argv at --preset h200 and N = ENGINE_ALONE_AGENTS, default
# 32: 163,840 cells, n_batch 2048, prefill chunk 512, flash attention on, all CPU threads), loaded as the server loads
# it, driven in-process by one thread, closed loop, greedy, 64 tokens a turn, no token lost. Read its wall times
# against 80-peer's kvrt rows of the same N (same machine): the difference is what the front (one GIL with the
# engine's worker) costs. Model: $MODELS/qwen2.5-7b.gguf. ENGINE_ALONE_WORKLOADS (default fanout,swarm,private, as 80-peer),
# ENGINE_ALONE_ROUNDS (default 2, each on a fresh engine, as the peer restarts its server), ENGINE_ALONE_ARGS: more
# probe options (e.g. '--kvrt-args "--hold-s 0.2"'). The workloads run in the order given, on one engine, and
# what one leaves cached (and its KV layout) meets the next, so a run compares row for row with 80-peer only
# in the same order.
# Budget ~100 s at the defaults (a model load ~10 s and ~16 s of workloads a round), under ENGINE_ALONE_TIMEOUT
# (default 200). Writes $RESULTS/engine-alone/{probe.json,probe.log} and the engine's steps of each workload in
# steps/engine-n<N>-r<round>-<workload>.jsonl, each summed up by tools/step_trace_summary.py into summary.txt.
set -uo pipefail
out="${RESULTS:-/tmp/kvrt-results}/engine-alone"
MODEL="${MODELS:-/tmp/kvrt-models}/qwen2.5-7b.gguf"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
[ -f "$MODEL" ] || { echo "missing $MODEL"; exit 1; }
# shellcheck disable=SC2086  # ENGINE_ALONE_ARGS is a list of options
eval timeout "${ENGINE_ALONE_TIMEOUT:-200}" python3 tools/probe_engine_alone.py --model "$MODEL" --preset h200 \
  --agents "${ENGINE_ALONE_AGENTS:-32}" --workloads "${ENGINE_ALONE_WORKLOADS:-fanout,swarm,private}" \
  --rounds "${ENGINE_ALONE_ROUNDS:-2}" --step-trace "$out/steps" --out "$out/probe.json" ${ENGINE_ALONE_ARGS:-} 2>&1 \
  | grep -v '^llama\|^load\|^print_info' | tee "$out/probe.log"
echo "engine alone: rc=${PIPESTATUS[0]}"
for f in "$out"/steps/engine-*.jsonl; do
  [ -e "$f" ] && python3 tools/step_trace_summary.py "$f"
done | tee "$out/summary.txt"
