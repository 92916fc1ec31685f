#!/usr/bin/env bash
# Issue 24: how fast the host picks greedy tokens from logits the GPU just copied into pinned memory, on 1-16
# threads and with kvrt's argmax_rows (tools/probe_host_argmax.py): 32 rows x 152,064 (Qwen2.5's vocabulary).
# Budget ~20 s (CuPy start, 7 pickers x 50 copies of 19.5 MB, alone and beside a busy Python thread). Writes $RESULTS/host-argmax/{probe.json,probe.log}.
set -uo pipefail
out="${RESULTS:-/tmp/kvrt-results}/host-argmax"
mkdir -p "$out"
timeout "${HOST_ARGMAX_TIMEOUT:-60}" python3 tools/probe_host_argmax.py --rows 32 --vocab 152064 --reps 50 \
  --out "$out/probe.json" 2>&1 | tee "$out/probe.log"
