#!/usr/bin/env bash
# The CPU column of the README's results: every benchmark behind it, on this machine, into
# bench/results/cpu-<date>/ (then: python tools/readme_tables.py --write, with CPU= set to that folder).
# Usage: bash tools/cpu_results.sh [part ...]   parts: fanout fanout-sweep swap timeslice multimodel elastic
#        batching prefetch
#        (none given: all of them; about 40 minutes on a quiet 2-core machine). One thread per context.
# A part that violates a physical bound exits 3 and is reported; the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/cpu-$(date +%F)}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(fanout fanout-sweep swap timeslice multimodel elastic batching prefetch)
mkdir -p "$OUT"
status=0

run() {  # run NAME CMD...: the command's output into $OUT/NAME.log as well as the terminal
  local name=$1; shift
  echo "== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "== $name: exit $rc"; status=1; }
}

for part in "${parts[@]}"; do
  case "$part" in
    fanout)  # two branches over a 3,501-token document: every arm, the peer, the ideal
      run fanout kvrt bench fanout --out "$OUT" --doc-tokens 3501 --trials 3 --max-tokens 6 --threads 1 \
        --flash-attn off --sweep-n '' ;;
    fanout-sweep)  # N = 8 and 32 branches over 512 tokens; results land in $OUT/fanout-sweep
      tmp=$(mktemp -d)
      run fanout-sweep kvrt bench fanout --out "$tmp" --skip-headline --doc-tokens 512 --sweep-n 8,32 \
        --sweep-docs 512:8/32 --sweep-arms baseline,peer-ram,isolated,shared,ideal --trials 3 --max-tokens 6 \
        --threads 1 --flash-attn off
      rm -rf "$OUT/fanout-sweep" && mv "$tmp/fanout" "$OUT/fanout-sweep" && rm -rf "$tmp" ;;
    swap)
      run swap kvrt bench agents --parts swap --swap-docs 1024,4096 --trials 3 --threads 1 \
        --capacity-bytes 536870912 --out "$OUT/swap" ;;
    timeslice)
      run timeslice kvrt bench agents --parts timeslice --agents 50 --requests 4 --threads 1 --rounds 3 \
        --capacity-bytes 536870912 --out "$OUT/timeslice" ;;
    multimodel)
      run multimodel kvrt bench multimodel --duration-s 20 --repeats 3 --threads 1 --out "$OUT/multimodel" ;;
    elastic)  # part c measured (llama.cpp contexts grown on demand); part b is the simulation's harness check
      run elastic-c kvrt bench elastic --part c --repeats 5 --out "$OUT/elastic"
      run elastic-b kvrt bench elastic --part b --driver host --max-ctx 65536 --duration-s 300 \
        --loads 1,1.5,2,4 --prompt-tokens 3000 --repeats 3 --out "$OUT/elastic" ;;
    batching)  # 50 agents' turns in one batch per step vs one at a time
      run batching kvrt bench batching --out "$OUT" --agents 50 --turns 2 --gen-tokens 8 --rounds 3 --threads 1 ;;
    prefetch)  # the next agent's KV restored on a copy thread while the current one decodes
      run prefetch kvrt bench prefetch --agents 50 --tokens 200-400 --decode-tokens 4 --rounds 3 \
        --staging-contexts 2 --threads 1 --flash-attn off,on --out "$OUT/prefetch" ;;
    *) echo "unknown part $part (fanout fanout-sweep swap timeslice multimodel elastic batching prefetch)"; exit 2 ;;
  esac
done
exit $status
