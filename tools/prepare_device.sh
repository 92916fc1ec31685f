#!/usr/bin/env bash
# Prepare .gpu-carry/ on a machine with network, for a GPU machine without one:
#   - llama-cpp-python's source, trimmed to what a CUDA build of llama.cpp with llama-server and
#     llama-batched-bench needs (the full sdist is over the 64 MiB that travels with a run): its
#     pure-Python llama_cpp/ package and vendor/llama.cpp less models, docs, tests, examples and the
#     like, keeping tools/ (server, batched-bench, ui and the tools/CMakeLists.txt that adds them all)
#     and scripts/*.cmake (ui-assets.cmake); about 10 MB;
#   - wheels of the Python packages kvrt needs that the GPU machine's image lacks (the serve extra's too,
#     prometheus-client included, for `kvrt serve --http` in `kvrt bench peer`, and uvloop and httptools, the
#     event loop and HTTP parser uvicorn takes where they are installed, as the serve extra installs them), and
#     py-spy (a sampling profiler, for 80-peer's PEER_PROFILE_S).
# Then (optional, ~25 min) tools/prebuild_llama_cuda.sh makes the CUDA build here, so the GPU machine skips its own;
# and run tools/device_run.sh there with .gpu-carry carried along.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_VERSION=${LLAMA_VERSION:-0.3.36}
PY=${DEVICE_PYTHON_VERSION:-3.12}
carry=.gpu-carry
mkdir -p "$carry"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

tarball="$carry/llama-cpp-python.tar.gz"
# a tarball from before llama-server was built there lacks tools/server: make it again (grep -c reads the whole
# listing: grep -q would stop early, tar die of SIGPIPE, and pipefail make the tarball anew on every run, which
# also orphans tools/prebuild_llama_cuda.sh's pack, keyed by the tarball's SHA-256)
if [ ! -f "$tarball" ] || ! tar -tzf "$tarball" | grep -c 'vendor/llama.cpp/tools/server/CMakeLists.txt$' > /dev/null; then
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$work" "llama-cpp-python==$LLAMA_VERSION"
  tar -C "$work" -xzf "$work"/llama_cpp_python-*.tar.gz
  src=$(echo "$work"/llama_cpp_python-*/)
  rm -rf "$src"/{.git,docs,examples,tests,docker}
  v="$src/vendor/llama.cpp"
  rm -rf "$v"/{models,docs,media,.github,benches,tests,examples,pocs,gguf-py,conversion,.devops,app,requirements}
  find "$v/scripts" -mindepth 1 -maxdepth 1 ! -name '*.cmake' -exec rm -rf {} +
  tar -C "$src" -czf "$tarball" .
fi

platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
serve=("fastapi==0.165.0" "starlette==1.10.0" "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types"
       "annotated-doc" "typing-inspection" "typing-extensions>=4.16" "uvicorn==0.55.0" "opentelemetry-api" "h11"
       "click" "anyio" "idna" "sniffio" "prometheus-client" "uvloop" "httptools")
# into a new folder that then replaces the old one: a package released since the last run would
# otherwise leave two versions of itself there (two idna wheels made the device's pip refuse both)
mkdir -p "$work/wheels"
for req in "cffi>=1.16" "pycparser" "gguf==0.19.0" "diskcache==5.6.3" "${serve[@]}" "py-spy"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    "${platforms[@]}" --platform any -d "$work/wheels" "$req"
done
rm -rf "$carry/wheels"
mv "$work/wheels" "$carry/wheels"
du -sh "$carry"/* | sed 's/^/  /'
