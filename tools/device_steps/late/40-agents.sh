#!/usr/bin/env bash
# Admission control and time-slicing (issue 4, seed 003's lmxd) on the H200. Models: $MODELS/qwen2.5-7b.gguf
# (Qwen2.5-7B shape, F16, random weights), $MODELS/llama3.2-1b.gguf, and a wide-KV small shape written here
# (kvrt_bench.agents.WIDE_KV: 32 layers, tiny weights, 32 KiB of KV per token).
# Writes $RESULTS/agents/. Budget: ~120 s of wall time. Measures, in this order (each with its own timeout;
# the swap round trip is step 35-swap):
#   1. 50 agents over the three models, closed loop, ledger budget = weights + 6 live contexts (so agents
#      swap), vs the same requests back to back in one context per model, nothing swapped.
#      --rounds 3 (median and spread; the run fails if time-slicing beats back to back, its bound).
#                                                                    -> timeslice/agents/agents.json, latency CDF
#   2. co-residence: each model asks for a context whose KV is 60% of the ledger cap (90% of the H200), at
#      most 2M cells (qwen ~1.3M cells / 76 GB, the other two 2M cells / 68 GB):
#      naive independent model+context per agent, all alive (later ones should fail in cudaMalloc), then
#      kvrt registering all three, refusing a fourth that cannot fit (ERR VRAM_LEDGER_DENY with its numbers),
#      and decoding each of the three twice.                          -> coresidence/agents/agents.json
#   3. the issue-4 tests (AGENT_PARTS=tests) on this machine: with CUDA hidden (CPU semantics, Python 3.12) and the gpu-marked
#      ones on the real device (NVML ledger).                         -> pytest-*.log
# What to check: timeslice: throughput_ratio (median of the rounds)
# >= 0.90 and p99_over_p50 <= 3; coresidence: naive.agents_ok < 3 and kvrt_agents_admitted == 3, the
# too-big step refused with ERR VRAM_LEDGER_DENY, every second-round DECODE restored=true; pytest logs passed.
set -uo pipefail
OUT_DIR="${RESULTS:-/tmp/kvrt-results}/agents"
QWEN="$MODELS/qwen2.5-7b.gguf"
LLAMA="$MODELS/llama3.2-1b.gguf"
WIDE="$OUT_DIR/wide-kv.gguf"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci
for m in "$QWEN" "$LLAMA"; do [ -f "$m" ] || { echo "missing $m"; exit 1; }; done
python3 -c "import sys; from kvrt_bench.agents import WIDE_KV; from kvrt.modelfiles.testmodels import write_model; \
write_model(sys.argv[1], WIDE_KV)" "$WIDE" || { echo "cannot write $WIDE"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT_DIR/gpu.txt"

AGENT_PARTS=${AGENT_PARTS:-timeslice coresidence}   # a subset re-runs only those
wanted() { case " $AGENT_PARTS " in *" $1 "*) return 0 ;; *) echo "agents $1: skipped (AGENT_PARTS)"; return 1 ;; esac; }
part() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local t=$SECONDS
  timeout "$limit" python3 -m kvrt.cli bench agents --out "$OUT_DIR/$name" --parts "$name" "$@" \
    > "$OUT_DIR/$name.log" 2>&1
  echo "agents $name: rc=$? in $((SECONDS - t)) s"
  grep -v '^[ {}]' "$OUT_DIR/$name.log" | tail -n 8
}
part timeslice 90 --models "$QWEN,$LLAMA,$WIDE" --agents 50 --requests 3 --gen-tokens 12 --live 6 --agent-ctx 1024 \
  --rounds 3
part coresidence 30 --models "$QWEN,$LLAMA,$WIDE" --huge-fraction 0.6

wanted tests || exit 0
t=$SECONDS
CUDA_VISIBLE_DEVICES= timeout 25 python3 tools/pytest_llama_first.py -p no:cacheprovider -q -x \
  tests/test_ledger.py tests/test_daemon.py tests/test_scheduler.py bench/bench_ledger.py --benchmark-disable \
  > "$OUT_DIR/pytest-cpu.log" 2>&1
echo "pytest issue-4 (CUDA hidden): rc=$? in $((SECONDS - t)) s: $(tail -n 1 "$OUT_DIR/pytest-cpu.log")"
timeout 10 python3 tools/pytest_llama_first.py -p no:cacheprovider -q -m gpu -rs tests/test_ledger.py \
  > "$OUT_DIR/pytest-gpu.log" 2>&1
echo "pytest issue-4 -m gpu: rc=$? $(tail -n 1 "$OUT_DIR/pytest-gpu.log")"
echo "agents step done in $SECONDS s"
