#!/usr/bin/env bash
# The whole GPU run, on the GPU machine, from the repo root, with .gpu-carry/ carried
# (made by tools/prepare_device.sh). Usage:  bash tools/device_run.sh [early|late|all]
#   early: install kvrt, build llama.cpp with CUDA in the background (standalone CMake: libllama, llama-server,
#          llama-batched-bench; llama-cpp-python's pure-Python llama_cpp/ installed with those libraries in its
#          lib/, so kvrt and llama-server run the same libllama), generate the benchmark models, run the steps
#          that need no llama.cpp (tools/device_steps/early/)
#   late:  wait for the build, run the llama.cpp GPU tests and tools/device_steps/late/
#          (the streamer, elastic and ledger GPU tests run inside their own step scripts)
# A machine kept warm between two calls keeps /tmp, so `early` then `late` build once.
# Everything lands in $RESULTS and is packed into $OUT/results.tgz (+ $OUT/summary.txt).
# Knobs: DEADLINE_S=N (seconds from the start): every step's time limit is cut to what is left before it
# (minus PACK_MARGIN_S, default 15), steps with no time left are skipped, so results.tgz is always written
# inside the call's limit. SKIP_STEP="name ..." skips those step scripts, ONLY_STEP="name ..." runs only those,
# SKIP_STEPS=1 none of them, SKIP_BASICS=1 the
# import-order probe and the llama.cpp GPU tests (GPU_TESTS: their files; GPU_MARK= runs all of their tests,
# not only -m gpu). GPU_SUITE=1 also runs the whole test suite (logs suite-llama.log, suite-kernels.log).
# MODEL_PRESETS: the benchmark models to generate (default "llama3.2-1b qwen2.5-7b"; the peer needs qwen2.5-7b).
# The CUDA build takes 300-420 s there; tools/prebuild_llama_cuda.sh makes it here instead (sm_90 code only, which
# xz packs small enough to carry), and build_llama unpacks that when it runs there. Built there, a cold machine
# runs `all` within one call's 600 s only with steps trimmed (SKIP_STEP, AGENT_PARTS, FORK_SWEEP_N).
set -uo pipefail
phase=${1:-all}
ROOT=$(pwd)
OUT=${OUT:-/tmp/kvrt-out}
export RESULTS=${RESULTS:-/tmp/kvrt-results} MODELS=${MODELS:-/tmp/kvrt-models}
SITE=/tmp/kvrt-site
LLAMA_BUILD=/tmp/llama-build
export KVRT_LLAMA_SERVER=${KVRT_LLAMA_SERVER:-$LLAMA_BUILD/bin/llama-server}   # for `kvrt bench peer` (80-peer)
TOOLS=/tmp/kvrt-tools  # command-line tools carried as wheels (py-spy): a target of their own, see below
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 PYTHONSAFEPATH=1 PATH=$TOOLS/bin:$SITE/bin:$PATH
mkdir -p "$OUT" "$RESULTS" "$MODELS" "$SITE"
summary="$RESULTS/summary.txt"
note() { echo "[$(date +%T)] $*" | tee -a "$summary"; }

install_python_deps() {
  # pip --target --upgrade replaces a whole top-level folder, bin/ included: kvrt's own install below would delete
  # the tools' scripts from $SITE/bin, so the tools get their own target
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$TOOLS" .gpu-carry/wheels/py_spy-*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" \
    $(ls .gpu-carry/wheels/*.whl | grep -v /py_spy-)
  # kvrt itself, reinstalled on every call so a warm machine runs the code just sent
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target "$SITE" . \
    && note "kvrt installed into $SITE"
}

build_llama() {  # llama.cpp with CUDA, standalone: libllama + llama-server + llama-batched-bench, one build
  if python3 -c "import llama_cpp" 2>/dev/null && [ -f "$SITE/.llama-cuda" ] && [ -x "$LLAMA_BUILD/bin/llama-server" ]; then
    note "llama.cpp (CUDA) already built"; return 0
  fi
  rm -rf /tmp/llama-src && mkdir -p /tmp/llama-src && tar -C /tmp/llama-src -xzf .gpu-carry/llama-cpp-python.tar.gz
  local t0=$SECONDS
  if unpack_prebuilt; then
    install_llama_cpp && note "llama.cpp CUDA: the prebuilt pack of this source runs here, unpacked in $((SECONDS - t0)) s"
    return
  fi
  { cmake -S /tmp/llama-src/vendor/llama.cpp -B "$LLAMA_BUILD" -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_BUILD_TYPE=Release \
      ${LLAMA_CMAKE_EXTRA:-} \
    && cmake --build "$LLAMA_BUILD" -j "$(( $(nproc) - 1 ))" --target llama llama-server llama-batched-bench \
    && install_llama_cpp; } > "$RESULTS/llama-build.log" 2>&1 \
    && note "llama.cpp CUDA build (libllama, llama-server, llama-batched-bench) ok in $((SECONDS - t0)) s" \
    || note "llama.cpp CUDA build FAILED after $((SECONDS - t0)) s (see llama-build.log)"
}

install_llama_cpp() {  # llama-cpp-python's pure-Python llama_cpp/ with the built shared libraries in its lib/:
  # `import llama_cpp` and kvrt's bindings load that libllama, and llama-server links the same files (no pip build)
  rm -rf "$SITE/llama_cpp" && cp -r /tmp/llama-src/llama_cpp "$SITE/llama_cpp" && mkdir -p "$SITE/llama_cpp/lib" \
    && cp -a "$LLAMA_BUILD"/bin/*.so* "$SITE/llama_cpp/lib/" && touch "$SITE/.llama-cuda"
}

unpack_prebuilt() {  # .gpu-carry/llama-cuda-prebuilt.tar.xz (tools/prebuild_llama_cuda.sh) into $LLAMA_BUILD/bin, when
  # it was built from the carried source and runs on this machine; else nothing is left of it and build_llama builds
  local pack=.gpu-carry/llama-cuda-prebuilt.tar.xz why=
  [ -f "$pack" ] || return 1
  rm -rf "$LLAMA_BUILD" && mkdir -p "$LLAMA_BUILD" && tar -C "$LLAMA_BUILD" -xJf "$pack"
  if [ "$(cat "$LLAMA_BUILD/source.sha256" 2>/dev/null)" != "$(sha256sum .gpu-carry/llama-cpp-python.tar.gz | cut -d' ' -f1)" ]; then
    why="built from another source"
  elif ! "$LLAMA_BUILD/bin/llama-server" --list-devices > "$RESULTS/llama-prebuilt.log" 2>&1 \
      || ! grep -q CUDA0 "$RESULTS/llama-prebuilt.log"; then
    why="does not run here or sees no GPU (llama-prebuilt.log)"
  fi
  [ -z "$why" ] && return 0
  note "llama.cpp CUDA: the prebuilt pack $why; building"
  rm -rf "$LLAMA_BUILD"
  return 1
}

make_models() {
  for preset in ${MODEL_PRESETS:-llama3.2-1b qwen2.5-7b}; do  # the peer's steps need qwen2.5-7b alone
    [ -f "$MODELS/$preset.gguf" ] || KVRT_NO_PRELOAD=1 python3 tools/make_test_model.py --preset "$preset" --out "$MODELS/$preset.gguf" \
      > "$RESULTS/model-$preset.log" 2>&1 || note "model $preset FAILED"
  done
  note "models: $(ls -sh "$MODELS" | tr '\n' ' ')"
}

step_limit() {  # seconds the next step may run: STEP_TIMEOUT, cut to what DEADLINE_S leaves
  local limit=${STEP_TIMEOUT:-260}
  if [ -n "${DEADLINE_S:-}" ]; then
    local left=$(( DEADLINE_S - SECONDS - ${PACK_MARGIN_S:-15} ))
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "$limit"
}

run_steps() {  # every script in tools/device_steps/$1, each with its own log and time limit
  local dir="tools/device_steps/$1" step name t0 limit
  for step in "$dir"/*.sh; do
    [ -e "$step" ] || continue
    name=$(basename "$step" .sh); t0=$SECONDS
    case " ${SKIP_STEP:-} " in *" $name "*) note "step $name: skipped (SKIP_STEP)"; continue ;; esac
    if [ -n "${ONLY_STEP:-}" ]; then
      case " $ONLY_STEP " in *" $name "*) ;; *) continue ;; esac
    fi
    limit=$(step_limit)
    [ "$limit" -gt 5 ] || { note "step $name: skipped (DEADLINE_S: ${limit} s left)"; continue; }
    timeout "$limit" bash "$step" > "$RESULTS/step-$name.log" 2>&1
    note "step $name: rc=$? in $((SECONDS - t0)) s; tail:"; tail -n 8 "$RESULTS/step-$name.log" | sed 's/^/    /' | tee -a "$summary"
  done
}

pack() {
  cp "$summary" "$OUT/summary.txt"
  tar -C "$RESULTS" --exclude='*.gguf' -czf "$OUT/results.tgz" . && note "packed $(du -sh "$OUT/results.tgz" | cut -f1)"
}

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader | tee -a "$summary"
install_python_deps
case "$phase" in
  early|all)
    build_llama &
    [ -n "${SKIP_MODELS:-}" ] || { make_models & }
    [ -n "${SKIP_STEPS:-}" ] || run_steps early
    wait   # the build and the model files
    [ "$phase" = all ] || { pack; exit 0; } ;;
  late)
    build_llama ;;
esac
if [ -z "${SKIP_BASICS:-}" ]; then   # import-order probe and the llama.cpp GPU tests
  python3 tools/probe_import_order.py > "$RESULTS/import-order.log" 2>&1; note "import-order probe: $(tail -n 3 "$RESULTS/import-order.log" | tr '\n' ' ')"
  marks=(-m "${GPU_MARK-gpu}"); [ -n "${GPU_MARK-gpu}" ] || marks=()   # GPU_MARK= runs every test of GPU_TESTS
  timeout "$(step_limit)" python3 tools/pytest_llama_first.py "${marks[@]}" -p no:cacheprovider --continue-on-collection-errors -q -rs ${GPU_TESTS:-tests/test_gpu_foundation.py tests/test_snapshot.py} > "$RESULTS/pytest-gpu.log" 2>&1
  note "pytest ${marks[*]}: rc=$? $(tail -n 1 "$RESULTS/pytest-gpu.log")"
fi
if [ -n "${GPU_SUITE:-}" ]; then   # the whole test suite: ~180 s of llama.cpp tests, then the numba-cuda kernels
  kernels=(tests/test_kernels.py tests/test_layer.py tests/test_elastic_kv.py tests/test_streamer.py)
  # one process with llama.cpp mapped first (-v: a cut-off run still names every test it finished; no xdist: its
  # workers do not start through that script), then the kernels in a process without llama.cpp (DEVELOPING.md)
  timeout "$(step_limit)" python3 tools/pytest_llama_first.py -p no:cacheprovider -p no:xdist -v --tb=short tests \
    "${kernels[@]/#/--ignore=}" > "$RESULTS/suite-llama.log" 2>&1
  note "whole suite (llama.cpp): rc=$? $(tail -n 1 "$RESULTS/suite-llama.log")"
  KVRT_NO_PRELOAD=1 timeout "$(step_limit)" python3 -m pytest -p no:cacheprovider -q -rfs "${kernels[@]}" \
    > "$RESULTS/suite-kernels.log" 2>&1
  note "whole suite (kernels): rc=$? $(tail -n 1 "$RESULTS/suite-kernels.log")"
fi
[ -n "${SKIP_STEPS:-}" ] || run_steps late
pack
