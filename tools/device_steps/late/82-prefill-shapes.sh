#!/usr/bin/env bash
# Issue 24: which batch shape prefills private prompts fastest with a KV stream per slot, what waiting after every
# step costs, and what a bare decode step of every slot costs (tools/probe_prefill_shapes.py): 16 slots x 4,096
# tokens of the Qwen2.5-7B shape ($MODELS/qwen2.5-7b.gguf) in steps of 4 x 512 (kvrt's H200 preset: n_batch 2048,
# micro-batch 512), flash attention on, each variant twice, interleaved; then llama-batched-bench of the same build
# on the same sizes (-npp 4096 -ntg 64 -npl 16), the reference both are read against.
# Budget ~70 s (two model loads ~10 s each, 11 prefills of ~2.8 s, batched-bench ~4 s of work).
# Writes $RESULTS/prefill-shapes/{probe.json,probe.log,batched-bench.jsonl}.
set -uo pipefail
out="${RESULTS:-/tmp/kvrt-results}/prefill-shapes"
MODEL="${MODELS:-/tmp/kvrt-models}/qwen2.5-7b.gguf"
BENCH="${LLAMA_BUILD:-/tmp/llama-build}/bin/llama-batched-bench"
mkdir -p "$out"
[ -f "$MODEL" ] || { echo "missing $MODEL"; exit 1; }
timeout "${PREFILL_SHAPES_TIMEOUT:-90}" python3 tools/probe_prefill_shapes.py "$MODEL" --slots 16 --prompt 4096 \
  --chunk 512 --chunks 4 --rounds 2 --out "$out/probe.json" 2>&1 | grep -v '^llama\|^load\|^print_info' | tee "$out/probe.log"
[ -x "$BENCH" ] && timeout 60 "$BENCH" -m "$MODEL" -c 163840 -b 2048 -ub 512 -fa on -ngl all -npp 4096 -ntg 64 -npl 16 \
  --output-format jsonl -t "$(nproc)" 2> "$out/batched-bench.log" | tee "$out/batched-bench.jsonl"
