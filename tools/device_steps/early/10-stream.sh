#!/usr/bin/env bash
# Layer streaming on the GPU (issue 5; seed 003's layer_stream_demo). Needs kvrt importable, not llama.cpp.
# Measures, all in one process each, same pinned pool and slots for serial / overlapped / transfer-only:
#   1. (STREAM_TESTS=1) correctness on the GPU: Numba kernels vs float64 (tests/test_kernels.py, real device), serial ==
#      overlapped bit for bit, the poisoned-slot test, real layers vs NumPy float32, the microbenchmarks
#   2. the seed's default config (8 layers x 64 MiB x 64 FMA iters; transfer-bound here, ideal ~1.3x)
#      and (STREAM_ALL=1) its 16-layer config
#   3. FMA sweeps of compute_iters at 32 (and, STREAM_ALL=1, 8) layers x 64 MiB (transfer-bound -> balanced -> compute-bound,
#      plus the interpolated balanced point T = C)
#   4. real Qwen2.5-7B-shaped layers (466 MB fp16 each), 16 layers, prefill chunk B swept + balanced point
# Output: $RESULTS/stream/<run>/stream-*.{json,csv,png}, one log per run, and a summary table at the end
# (speedup, ideal (T+C)/max(T,C), the bound for these n layers, efficiency against both, H2D vs peak).
# Time limits add up to 150 s (expected ~70 s); a run that hits its limit prints rc=124 and is skipped.
set -uo pipefail
# No llama.cpp in these processes: it is not built yet when the early steps run, and with a CUDA build mapped
# the streamer's CuPy/Numba work segfaulted (2026-12-03); `import kvrt` skips mapping it with this set.
export KVRT_NO_PRELOAD=1
OUT_DIR="${RESULTS:-/tmp/kvrt-results}/stream"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
python3 -c "import cupy, numba, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'numba', numba.__version__)"

if [ -n "${STREAM_TESTS:-}" ]; then
  t0=$SECONDS
  timeout 90 python3 tools/pytest_llama_first.py -p no:cacheprovider -q -rs tests/test_kernels.py tests/test_streamer.py \
    tests/test_layer.py bench/bench_stream.py > "$OUT_DIR/pytest.log" 2>&1
  echo "pytest (kernels, streamer, layer, bench_stream): rc=$? in $((SECONDS - t0)) s: $(tail -n 1 "$OUT_DIR/pytest.log")"
fi

bench() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  local t=$SECONDS
  timeout "$limit" python3 -m kvrt.cli bench stream --out "$OUT_DIR/$name" "$@" > "$OUT_DIR/$name.log" 2>&1
  echo "bench $name: rc=$? in $((SECONDS - t)) s: $(tail -n 1 "$OUT_DIR/$name.log")"
}
bench seed8 15                                    # seed defaults: --n-layers 8 --bytes-per-layer 67108864 --compute-iters 64
[ -z "${STREAM_ALL:-}" ] || bench seed16 15 --n-layers 16
[ -z "${STREAM_ALL:-}" ] || bench fma8 20 --n-layers 8 --sweep
bench fma32 40 --n-layers 32 --compute-iters 265 --sweep --sweep-values 128,256,512,1024
bench layer16 40 --mode layer --n-layers 16 --tokens 1024 --sweep --sweep-values 256,2048,4096,8192

python3 - "$OUT_DIR" <<'EOF'
import json, sys
from pathlib import Path
rows = []
for path in sorted(Path(sys.argv[1]).glob("*/stream-*.json")):
    for p in json.loads(path.read_text())["points"]:
        x = p.get("tokens", p.get("compute_iters"))
        rows.append((path.parent.name, p, x))
print(f"\n{'run':8} {'n':>3} {'x':>6} {'T ms':>7} {'C ms':>7} {'C/T':>6} {'speedup':>8} {'ideal':>6} {'bound':>6} "
      f"{'eff':>5} {'eff/bd':>6} {'H2D GB/s':>8} {'peak':>5} {'H2D%':>5}")
for run, p, x in rows:
    print(f"{run:8} {p['n_layers']:3d} {x:6d}{'*' if p['balanced'] else ' '}{p['transfer_ms']:7.3f} {p['compute_ms']:7.3f} "
          f"{p['compute_ms'] / p['transfer_ms']:6.2f} {p['speedup']:7.3f}x {p['ideal_speedup']:6.3f} "
          f"{p['pipeline_ideal_speedup']:6.3f} {p['efficiency']:5.3f} {p['pipeline_efficiency']:6.3f} "
          f"{p['h2d_gbps']:8.1f} {p['peak_h2d_gbps']:5.1f} {100 * p['h2d_fraction']:5.1f}")
print("(x = compute_iters in fma runs, tokens B in layer runs; * = interpolated balanced point; eff = speedup/ideal,"
      " eff/bd = speedup/bound for these n layers)")
balanced = {}
for run, p, x in rows:
    if p["balanced"]:
        balanced[run] = p["speedup"]
print("targets: eff>=0.95 (n>=8): worst eff %.3f, worst eff/bd %.3f; H2D>=90%%: worst %.1f%%; balanced speedups %s"
      % (min(p["efficiency"] for _, p, _ in rows), min(p["pipeline_efficiency"] for _, p, _ in rows),
         100 * min(p["h2d_fraction"] for _, p, _ in rows), {k: round(v, 3) for k, v in balanced.items()}))
EOF
for name in seed8 seed16; do [ -f "$OUT_DIR/$name.log" ] && grep -h "HEADLINE" "$OUT_DIR/$name.log" | sed "s/^/$name /"; done
grep -h "BOUND VIOLATED\|^bounds:" "$OUT_DIR"/*.log
echo "stream step done in $SECONDS s"
