#!/usr/bin/env bash
# Build llama.cpp's own llama-server and llama-batched-bench on this (CPU) machine from the llama.cpp vendored in
# llama-cpp-python's sdist, the peer arm of `kvrt bench peer`. Usage:
#   bash tools/build_llama_server.sh [SDIST_DIR] [BUILD_DIR]
# SDIST_DIR: an unpacked llama-cpp-python sdist (default: downloads LLAMA_VERSION, default 0.3.36, with pip);
# BUILD_DIR: default $HOME/.cache/kvrt/llama-server-<version>. JOBS (default: nproc) compile jobs.
# The binaries are linked with shared libllama/libggml of the same source; run them with
#   LD_LIBRARY_PATH=<venv>/lib/python3.X/site-packages/llama_cpp/lib
# (what `kvrt bench peer` does) so both arms load the one libllama that pip built for kvrt (same SONAMEs).
# Prints the llama-server path last.
set -euo pipefail
LLAMA_VERSION=${LLAMA_VERSION:-0.3.36}
src=${1:-}
build=${2:-$HOME/.cache/kvrt/llama-server-$LLAMA_VERSION}
if [ -z "$src" ]; then
  dl=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$dl" "llama-cpp-python==$LLAMA_VERSION"
  tar -C "$dl" -xzf "$dl"/llama_cpp_python-*.tar.gz
  src=$(echo "$dl"/llama_cpp_python-*/)
fi
llama="$src/vendor/llama.cpp"
[ -f "$llama/tools/server/CMakeLists.txt" ] || { echo "no vendor/llama.cpp/tools/server under $src" >&2; exit 1; }
mkdir -p "$(dirname "$build")"  # the configure log goes beside the build folder (a fresh $HOME has no .cache/kvrt)
# LLAMA_BUILD_APP=OFF: the unified binary needs app/, which trimmed copies lack;
# LLAMA_USE_PREBUILT_UI=OFF: otherwise configure downloads the web UI; LLAMA_OPENSSL=OFF: no HTTPS needed.
cmake -S "$llama" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF ${LLAMA_CMAKE_EXTRA:-} > "$build.configure.log" 2>&1 \
  || { tail -n 30 "$build.configure.log" >&2; exit 1; }
cmake --build "$build" -j "${JOBS:-$(nproc)}" --target llama-server llama-batched-bench
ls -l "$build/bin/llama-batched-bench" >&2
echo "$build/bin/llama-server"
