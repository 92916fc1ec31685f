#!/usr/bin/env bash
# kvrt's OpenAI server vs llama.cpp's own llama-server (issue 24) on the H200, same GGUF, same libllama (the one
# CUDA build: tools/device_run.sh installs its libraries into llama_cpp/lib and llama-server runs against them),
# same 163,840 KV cells, flash attention on. Model: $MODELS/qwen2.5-7b.gguf (Qwen2.5-7B shape, F16, random
# weights). Writes $RESULTS/peer/n<N>/peer/ (peer.json, peer.csv, requests.csv, peer.png, server logs).
# Workloads (kvrt bench peer --preset h200): fanout (8,192-token shared document + 32-token question, 1 turn),
# swarm (4,096 shared + 64-token task, 4 turns, +128 new tokens a turn), private (4,096-token own history, 2 turns,
# +64 new tokens), 64 output tokens a turn; ideal: llama-batched-bench of the same build.
# One run per N (PEER_AGENTS, default "8 32 64"), each under PEER_N_TIMEOUT_S (default 240) so a cut-off N
# keeps the earlier ones' results; llama-server skips a workload whose agents' histories do not fit its slots'
# share of the cells (cells / N a slot: fanout from N = 20 on, swarm from N = 35, private from N = 39), and
# llama-server-roomy (--roomy) runs exactly those with N x the history's cells (N = 32 fanout: 265,216).
# Budget: ~PEER_N_TIMEOUT_S per N; give the step STEP_TIMEOUT to match (e.g. ONLY_STEP=80-peer STEP_TIMEOUT=560).
# PEER_PROFILE_S=60: py-spy (carried as a wheel by tools/prepare_device.sh) samples kvrt's server of each N for that
# long, every thread, raw stacks in n<N>/pyspy-kvrt.txt (the kvrt arm runs first).
# Each kvrt run writes its engine steps (kvrt bench peer --step-trace; PEER_STEP_TRACE=0: not) to
# n<N>/peer/steps/n<N>-r<round>-<workload>.jsonl: python3 tools/step_trace_summary.py FILE says which step shapes
# (decode rows, prompt chunks, llama.cpp micro-batches) took the time.
# PEER_ARGS: more options (e.g. "--kv-unified", '--kvrt-args "--kv-layout auto"', "--rounds 2").
# PEER_VARIANTS="pads-off=--pad-gaps off;unified=--kv-layout unified": then kvrt alone again at each N of
# PEER_VARIANT_N (default 32) with each variant's kvrt options (';' between variants, NAME=OPTIONS), step trace as
# above, for an A/B inside one run (gap padding, the choice of layout: DEVELOPING.md); written to
# $RESULTS/peer/n<N>-<NAME>/.
# What to check: lost_tokens == 0 in every row, retokenized_requests (llama-server turns whose ids came from
# /tokenize), summary's kvrt_over_llama_server_wall per workload, ideal_over_kvrt_wall, both arms' libllama
# SHA-256 equal (peer.json "libraries").
set -uo pipefail
OUT_DIR="${RESULTS:-/tmp/kvrt-results}/peer"
QWEN="$MODELS/qwen2.5-7b.gguf"
SERVER=${KVRT_LLAMA_SERVER:-/tmp/llama-build/bin/llama-server}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
[ -f "$QWEN" ] || { echo "missing $QWEN"; exit 1; }
[ -x "$SERVER" ] || { echo "missing $SERVER (tools/device_run.sh builds it)"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
kvrt_server_pid() {  # from /proc: the device image has no pgrep
  local p
  for p in /proc/[0-9]*; do
    tr '\0' ' ' < "$p/cmdline" 2> /dev/null | grep -q "kvrt.cli serve --http" && { echo "${p#/proc/}"; return; }
  done
}
profile_kvrt() {  # PEER_PROFILE_S: sample the kvrt server of this N with py-spy (if carried) for its whole life
  local out=$1 pid="" i
  for i in $(seq 600); do pid=$(kvrt_server_pid); [ -n "$pid" ] && break; sleep 0.1; done
  echo "kvrt server pid: ${pid:-not found in 60 s}" > "$out.log"
  [ -n "$pid" ] && py-spy record --pid "$pid" --threads --idle --nonblocking -r 100 -f raw -o "$out" \
    --duration "$PEER_PROFILE_S" >> "$out.log" 2>&1
}
trace=(--step-trace); [ "${PEER_STEP_TRACE:-1}" = 0 ] && trace=()
for n in ${PEER_AGENTS:-8 32 64}; do
  t=$SECONDS
  if [ -n "${PEER_PROFILE_S:-}" ]; then
    mkdir -p "$OUT_DIR/n$n"
    if command -v py-spy > /dev/null; then profile_kvrt "$OUT_DIR/n$n/pyspy-kvrt.txt" &
    else echo "PEER_PROFILE_S set but py-spy is not on PATH" > "$OUT_DIR/n$n/pyspy-kvrt.txt.log"; fi
  fi
  # shellcheck disable=SC2086  # PEER_ARGS is a list of options
  eval timeout "${PEER_N_TIMEOUT_S:-240}" python3 -m kvrt.cli bench peer --out "$OUT_DIR/n$n" --preset h200 \
    --model "$QWEN" --agents "$n" --llama-server "$SERVER" --roomy "${trace[@]}" ${PEER_ARGS:-} > "$OUT_DIR/peer-n$n.log" 2>&1
  echo "peer N=$n: rc=$? in $((SECONDS - t)) s"
  grep -E '^ +(kvrt|llama-server|ideal)' "$OUT_DIR/peer-n$n.log" | cut -c1-160
  for f in "$OUT_DIR/n$n"/peer/steps/*.jsonl; do [ -e "$f" ] && python3 tools/step_trace_summary.py "$f"; done
done
IFS=';' read -r -a variants <<< "${PEER_VARIANTS:-}"
for variant in "${variants[@]}"; do
  name=${variant%%=*}; options=${variant#*=}
  for n in ${PEER_VARIANT_N:-32}; do
    t=$SECONDS
    # shellcheck disable=SC2086
    eval timeout "${PEER_N_TIMEOUT_S:-240}" python3 -m kvrt.cli bench peer --out "$OUT_DIR/n$n-$name" --preset h200 \
      --model "$QWEN" --agents "$n" --arms kvrt --kvrt-args "'$options'" --llama-server "$SERVER" "${trace[@]}" \
      ${PEER_ARGS:-} > "$OUT_DIR/peer-n$n-$name.log" 2>&1
    echo "peer N=$n kvrt $options: rc=$? in $((SECONDS - t)) s"
    grep -E '^ +(kvrt|ideal)' "$OUT_DIR/peer-n$n-$name.log" | cut -c1-160
    for f in "$OUT_DIR/n$n-$name"/peer/steps/*.jsonl; do [ -e "$f" ] && python3 tools/step_trace_summary.py "$f"; done
  done
done
