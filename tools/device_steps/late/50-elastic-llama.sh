#!/usr/bin/env bash
# Elastic llama.cpp contexts (issue 6, bench elastic part c) with CUDA llama.cpp and the
# Llama-3.2-1B-shaped F16 model (random weights; budget ~60 s): the same two-turn greedy agent
# (1,950-token prompt, 128 generated, then 5,850 more prompt tokens, 128 generated) in an
# ElasticContext that starts at 256 cells, and in a fixed 8192-cell context. generate() now
# grows once, before the prefill, to the bucket holding prompt + max_tokens (turn 1:
# 256 -> 4096 carrying nothing, on the critical path; no move in the middle of decoding any
# more -- that move was inside the old "ms/token"); between the turns grow_ahead(0.5) moves
# the 2,078-token state 4096 -> 8192 on the agent's idle time (2078/4096 = 51% >= 0.5), so
# turn 2 (needs 8,056 cells) should find its room there: no move on its path.
# Look for: "tokens equal: True"; the ms/token ratio elastic/fixed (target within 2%); the
# growth "on the critical path" as a share of the prefill (target < 5%), and separately the
# "off the path" move; the per-move lines (from -> to, tokens carried, ms, on path or ahead, and
# the split: state out / create context / state in -- which part dominates on CUDA is not known yet).
# Also the CPU-run test of token equality, on the GPU build.
# Writes everything under $RESULTS/elastic/.
set -uo pipefail
out="${RESULTS:-/tmp/kvrt-results}/elastic"
mkdir -p "$out"
timeout 20 python3 tools/pytest_llama_first.py -q -p no:cacheprovider tests/test_elastic_context.py > "$out/pytest-elastic-context.log" 2>&1
echo "pytest elastic context: rc=$? $(tail -n 1 "$out/pytest-elastic-context.log")"
timeout 40 python3 -m kvrt.cli bench elastic --part c --model "${MODELS:-/tmp/kvrt-models}/llama3.2-1b.gguf" \
  --prompt-tokens 7800 --gen-tokens 128 --repeats 3 --grow-ahead 0.5 --out "$out" 2>&1 | tee "$out/part-c.log"
