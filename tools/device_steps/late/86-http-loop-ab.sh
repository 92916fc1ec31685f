#!/usr/bin/env bash
# Issue 24: what the HTTP front's event loop and parser cost on the GPU machine. kvrt alone, N = 32 private (the
# peer's h200 preset, step trace on), alternating uvloop + httptools (the serve extra's, carried as wheels) with
# asyncio's own loop + h11 (both made unimportable by a sitecustomize on PYTHONPATH: what uvicorn runs on where
# they are not installed, as on this machine before the wheels were carried). The server's log says which it ran on.
# LOOP_AB_ROUNDS (default 2) pairs, ~25 s a run. Writes $RESULTS/http-loop-ab/{uvloop,asyncio}-<round>/ (peer.json,
# steps) and ab.txt (each run's kvrt row).
set -uo pipefail
out="${RESULTS:-/tmp/kvrt-results}/http-loop-ab"
QWEN="$MODELS/qwen2.5-7b.gguf"
[ -f "$QWEN" ] || { echo "missing $QWEN"; exit 1; }
mkdir -p "$out/no-uvloop-site"
printf 'import sys\nsys.modules["uvloop"] = None\nsys.modules["httptools"] = None\n' \
  > "$out/no-uvloop-site/sitecustomize.py"
for r in $(seq "${LOOP_AB_ROUNDS:-2}"); do
  for v in uvloop asyncio; do
    site=""; [ "$v" = asyncio ] && site="$out/no-uvloop-site:"
    PYTHONPATH="$site${PYTHONPATH:-}" timeout "${LOOP_AB_RUN_TIMEOUT_S:-120}" python3 -m kvrt.cli bench peer \
      --out "$out/$v-$r" --preset h200 --model "$QWEN" --agents 32 --arms kvrt --workloads private --step-trace \
      > "$out/$v-$r.log" 2>&1
    echo "$v round $r: rc=$? $(grep -ho 'on [a-z0-9]* + [a-z0-9]*' "$out/$v-$r"/peer/logs/kvrt-*.log | head -1)" \
      | tee -a "$out/ab.txt"
    grep -A1 -E '^ +kvrt +private' "$out/$v-$r.log" | cut -c1-240 | tee -a "$out/ab.txt"
  done
done
