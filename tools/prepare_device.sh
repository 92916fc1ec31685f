#!/usr/bin/env bash
# Prepare .gpu-carry/ on a machine with network, for a GPU machine without one:
#   - llama-cpp-python's source, trimmed to what a CUDA build needs (the full sdist is
#     over the 64 MiB that travels with a run);
#   - wheels of the Python packages kvrt needs that the GPU machine's image lacks.
# Then run tools/device_run.sh there with .gpu-carry carried along.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_VERSION=${LLAMA_VERSION:-0.3.36}
PY=${DEVICE_PYTHON_VERSION:-3.12}
carry=.gpu-carry
mkdir -p "$carry/wheels"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ ! -f "$carry/llama-cpp-python.tar.gz" ]; then
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$work" "llama-cpp-python==$LLAMA_VERSION"
  tar -C "$work" -xzf "$work"/llama_cpp_python-*.tar.gz
  src=$(echo "$work"/llama_cpp_python-*/)
  rm -rf "$src"/{.git,docs,examples,tests,docker}
  v="$src/vendor/llama.cpp"
  rm -rf "$v"/{models,docs,media,.github,benches,tests,examples,pocs,gguf-py,conversion,scripts,.devops,app,requirements}
  find "$v/tools" -mindepth 1 -maxdepth 1 ! -name mtmd ! -name CMakeLists.txt -exec rm -rf {} +
  tar -C "$src" -czf "$carry/llama-cpp-python.tar.gz" .
fi

platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for req in "cffi>=1.16" "pycparser" "gguf==0.19.0" "diskcache==5.6.3"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    "${platforms[@]}" --platform any -d "$carry/wheels" "$req"
done
du -sh "$carry"/* | sed 's/^/  /'
