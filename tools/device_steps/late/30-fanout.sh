#!/usr/bin/env bash
# Fan-out (issue 13) on the H200, Qwen2.5-7B-shaped F16 preset ($MODELS/qwen2.5-7b.gguf, random weights:
# timings depend on shape and type, not on the values). One `kvrt bench fanout` process:
#   headline  3,501-token fox document x 2 branches x 6 greedy tokens, every arm side by side (the seed's
#             naive baseline, the warm pooled baseline, llama-cpp-python Llama + LlamaRAMCache / LlamaDiskCache,
#             kvrt isolated / isolated-cold / shared, the ideal = one prefill + one batched decode), 3 rounds;
#   sweep     3,501 tokens x N in FANOUT_SWEEP (default 8 and 50 branches), the baseline measured at every point,
#             the peer up to N = 8 (its per-branch state saves would dominate beyond).
# Flash attention off in every arm (exact tokens; FLASH_ATTN=on to change: with it off llama.cpp keeps V
# transposed and a state capture/restore costs ~130 ms on the H200 whatever its size, bench/RESULTS.md);
# n_batch 2048; the ideal's decode batched (--ideal-decode). The run fails (rc 3) when a ratio passes its
# bound (speed-up over the warm baseline > N, fraction of the ideal > 1). Writes $RESULTS/fanout/fanout/.
# Budget ~110 s (model + peer loads ~25 s, headline ~30 s, sweep ~55 s). Sizes can be shrunk for a CPU dry run.
set -uo pipefail
OUTDIR="$RESULTS/fanout"
MODEL="${FANOUT_MODEL:-$MODELS/qwen2.5-7b.gguf}"
mkdir -p "$OUTDIR"
[ -f "$MODEL" ] || { echo "missing $MODEL"; exit 1; }
python3 -m kvrt.cli bench fanout --model "$MODEL" --out "$OUTDIR" --doc-tokens "${FANOUT_DOC:-3501}" --trials 3 \
  --max-tokens 6 --n-batch "${N_BATCH:-2048}" --flash-attn "${FLASH_ATTN:-off}" --ideal-decode "${IDEAL_DECODE:-batched}" \
  --sweep-docs "${FANOUT_SWEEP:-3501:8/50}" \
  --sweep-arms baseline,peer-ram,isolated,shared,ideal --peer-max-n 8 ${FANOUT_EXTRA:-} \
  2>&1 | tr '\r' '\n' | grep -v ': prefill \|LlamaDiskCache' | tee "$OUTDIR/bench_fanout.txt"
