#!/usr/bin/env bash
# Issue 25 (5): several real-shaped models on one GPU under one KV cap, a bursty trace, static reservation vs
# kvrt's elastic contexts (`kvrt bench multimodel`: p99 TTFT, models co-resident, refusals, same greedy tokens).
# Models: the Qwen2.5-7B shape of tools/device_run.sh plus MULTI_SMALL (default 3) Llama-3.2-1B-shaped models of
# different weights (seeds 1..N, ~2.8 GB each, written here on first use, ~15 s each), F16, every layer on the GPU.
# MULTI_MAX_CTX (default 32768) cells a model at most; the cap is the bench's default (2.5 static maxima: two
# models' full contexts resident) unless MULTI_CAP_MIB; MULTI_DURATION_S (default 40) of arrivals, 3 repeats an
# arm; MULTI_GAP_S / MULTI_BURST_GAP_S (the bench's defaults 6 and 0.3) the mean idle gap between a model's bursts
# and the mean spacing within one (smaller: static reservation starts to queue behind its context re-creations).
# Budget: ~3 x 2 x duration + model loads (~60 s): give the step STEP_TIMEOUT=420 or so.
# Writes $RESULTS/multimodel/ (multimodel.json/.csv/.png and the log).
set -uo pipefail
out="${RESULTS:-/tmp/kvrt-results}/multimodel${MULTI_TAG:+-$MULTI_TAG}"
MODELS=${MODELS:-/tmp/kvrt-models}
mkdir -p "$out"
[ -f "$MODELS/qwen2.5-7b.gguf" ] || { echo "missing $MODELS/qwen2.5-7b.gguf (tools/device_run.sh makes it)"; exit 1; }
models="$MODELS/qwen2.5-7b.gguf"
for seed in $(seq "${MULTI_SMALL:-3}"); do
  path="$MODELS/llama3.2-1b-seed$seed.gguf"
  [ -f "$path" ] || KVRT_NO_PRELOAD=1 python3 tools/make_test_model.py --preset llama3.2-1b --seed "$seed" \
    --out "$path" > "$out/model-seed$seed.log" 2>&1 || { echo "model seed $seed FAILED"; exit 1; }
  models="$models,$path"
done
cap=()
[ -n "${MULTI_CAP_MIB:-}" ] && cap=(--cap-mib "$MULTI_CAP_MIB")
python3 -m kvrt.cli bench multimodel --models "$models" --max-ctx "${MULTI_MAX_CTX:-32768}" "${cap[@]}" \
  --duration-s "${MULTI_DURATION_S:-40}" --gap-s "${MULTI_GAP_S:-6}" --burst-gap-s "${MULTI_BURST_GAP_S:-0.3}" --repeats 3 --n-gpu-layers -1 --out "$out" 2>&1 | tee "$out/multimodel.log" \
  | grep -v '^llama\|^load\|^print_info' | tail -30
