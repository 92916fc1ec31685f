#!/usr/bin/env bash
# Elastic llama.cpp contexts (issue 6, bench elastic part c) with CUDA llama.cpp and the
# Llama-3.2-1B-shaped F16 model (random weights; budget ~80 s): the same two-turn greedy agent
# (1,950-token prompt, 128 generated, then 5,850 more prompt tokens, 128 generated) in an
# ElasticContext (max_ctx 8192, starts at 256 cells) and in a fixed 8192-cell context, with three
# elastic arms (--arms):
#   spare           registration (construction, off the request path) creates the 256-cell context
#                   plus a spare sized for the first request (expected_tokens = 1,950 + 128 -> 4096
#                   cells); turn 1's growth moves into it (nothing carried: no context created on the
#                   path); between the turns grow_ahead(0.5) moves the 2,078-token state 4096 -> 8192
#                   (off the path), then prepare() (nothing: at max_ctx). The headline arm.
#   spare-no-ahead  the same spare at registration; between the turns only prepare(): an 8192-cell
#                   spare is created off the path and turn 2 moves its state into it ON the path
#                   (state out + state in + close old, no creation).
#   cold            no spares (the previous behaviour): turn 1 creates its 4096-cell context on the
#                   path (the H200's 13.4 ms of 14.7 ms = 12.3 % of the prefill); grow_ahead(0.5).
# Look for: "tokens equal: True" (every arm); per arm "ON the critical path ... = X% of the fixed
# prefill (target < 5%)" and "of it context creation"; "OFF the path" (spare creation, moves ahead);
# the spares' MB (ledger charge), how long each was held and whether it was used; the per-move split
# (state out / create context / state in / close old); and "elastic prefill incl. growth" against
# the fixed prefill (a fresh context's first decode on CUDA may cost more: that would show there).
# Also the CPU-run tests of token equality and of the spares, on the GPU build.
# Writes everything under $RESULTS/elastic/.
set -uo pipefail
out="${RESULTS:-/tmp/kvrt-results}/elastic"
mkdir -p "$out"
timeout 30 python3 tools/pytest_llama_first.py -q -p no:cacheprovider tests/test_elastic_context.py > "$out/pytest-elastic-context.log" 2>&1
echo "pytest elastic context: rc=$? $(tail -n 1 "$out/pytest-elastic-context.log")"
timeout 60 python3 -m kvrt.cli bench elastic --part c --model "${MODELS:-/tmp/kvrt-models}/llama3.2-1b.gguf" \
  --prompt-tokens 7800 --gen-tokens 128 --repeats "${ELASTIC_REPEATS:-3}" --grow-ahead 0.5 --arms spare,spare-no-ahead,cold \
  --out "$out" 2>&1 | tee "$out/part-c.log"
