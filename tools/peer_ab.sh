#!/usr/bin/env bash
# kvrt's peer run, A/B on one GPU machine: this tree's kvrt/ against another commit's, alternating, kvrt's arm alone.
# GPU machines differ from one loan to the next, so a change is judged only against a base run beside it.
#   here:       bash tools/peer_ab.sh prepare REV      # REV's kvrt/ into .ab-base/kvrt (ignored; carry it)
#   GPU machine: bash tools/peer_ab.sh run [ROUNDS]    # after `tools/device_run.sh early|all` built llama.cpp there
# The run takes ROUNDS (default 2) pairs, head first, each `tools/device_run.sh late` with only step 80-peer and
# the peer's knobs from the environment (defaults: PEER_AGENTS=32, PEER_ARGS="--arms kvrt --workloads private",
# PEER_N_TIMEOUT_S=110). It swaps kvrt/ for .ab-base/kvrt and back
# (device_run.sh installs the tree's kvrt each call; bindings/ and kernels/ stay this tree's), packs
# $OUT/ab.tgz with ab/{head,base}-I/ (the peer's log, peer.json, the step traces) and the runs' logs, and prints
# each run's kvrt and ideal lines. Call it with carry [".gpu-carry", ".ab-base"], and move bench/results out of
# the tree for the call (the carry's 64 MiB).
set -uo pipefail
mode=${1:?usage: peer_ab.sh prepare REV | run [ROUNDS]}
case $mode in
  prepare)
    rev=${2:?usage: peer_ab.sh prepare REV}
    rm -rf .ab-base && mkdir -p .ab-base && git archive "$rev" kvrt | tar -x -C .ab-base \
      && echo "$rev" > .ab-base/REV && echo "kvrt/ of $(git rev-parse --short "$rev") in .ab-base/kvrt"
    ;;
  run)
    [ -d .ab-base/kvrt ] || { echo "no .ab-base/kvrt: run 'peer_ab.sh prepare REV' here and carry .ab-base" >&2; exit 2; }
    OUT=${OUT:-/tmp/kvrt-out}
    RESULTS=${RESULTS:-/tmp/kvrt-results}
    export PEER_AGENTS=${PEER_AGENTS:-32} PEER_ARGS=${PEER_ARGS:---arms kvrt --workloads private}
    export PEER_N_TIMEOUT_S=${PEER_N_TIMEOUT_S:-110}
    mkdir -p "$OUT/ab" /tmp/peer-ab && rm -rf /tmp/peer-ab/head && cp -r kvrt /tmp/peer-ab/head
    trap 'rm -rf kvrt && cp -r /tmp/peer-ab/head kvrt' EXIT  # the tree's own kvrt/ back, whatever happens
    echo "head: this tree; base: $(cat .ab-base/REV); N=$PEER_AGENTS; $PEER_ARGS" | tee "$OUT/ab/README.txt"
    for i in $(seq 1 "${2:-2}"); do
      for side in head base; do
        rm -rf kvrt "$RESULTS/peer"
        if [ "$side" = base ]; then cp -r .ab-base/kvrt kvrt; else cp -r /tmp/peer-ab/head kvrt; fi
        SKIP_BASICS=1 ONLY_STEP=80-peer STEP_TIMEOUT=$((PEER_N_TIMEOUT_S + 20)) \
          DEADLINE_S=$((PEER_N_TIMEOUT_S + 40)) bash tools/device_run.sh late > "$OUT/ab/$side-$i.run.log" 2>&1
        mkdir -p "$OUT/ab/$side-$i"
        for n in $PEER_AGENTS; do
          cp "$RESULTS/peer/peer-n$n.log" "$OUT/ab/$side-$i/" 2>/dev/null
          cp -r "$RESULTS/peer/n$n/peer/peer.json" "$RESULTS/peer/n$n/peer/steps" "$OUT/ab/$side-$i/" 2>/dev/null
          rm -rf "$OUT/ab/$side-$i/steps/server"
          grep -hE '^ +(kvrt|ideal) ' "$OUT/ab/$side-$i/peer-n$n.log" | sed "s/^/$side-$i n$n /" | cut -c1-200
        done
      done
    done
    tar -czf "$OUT/ab.tgz" -C "$OUT" ab && rm -rf "$OUT/ab"  # one file: a call returns at most 8
    ;;
  *) echo "usage: peer_ab.sh prepare REV | run [ROUNDS]" >&2; exit 2 ;;
esac
