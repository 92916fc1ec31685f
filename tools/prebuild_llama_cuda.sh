#!/usr/bin/env bash
# Build llama.cpp with CUDA (sm_90) here, on a machine with nvcc but no GPU, and pack it into
# .gpu-carry/llama-cuda-prebuilt.tar.xz, so a cold GPU machine skips its 300-420 s build
# (tools/device_run.sh uses the pack when it loads and runs there, else builds as before).
# Same sources and CMake options as device_run.sh's build_llama, except CUDA code for sm_90 only (no PTX:
# the GPU machine is an H100/H200, and the pack must stay under what a call carries).
# Needs: nvcc 13 (the GPU machine's major version), cmake, ninja, network for pip (cuBLAS's headers and
# libraries, which this machine's toolkit lacks) and .gpu-carry/llama-cpp-python.tar.gz (prepare_device.sh).
# The driver library libcuda.so.1 is a stub made here with the driver functions ggml-cuda calls; the real one
# is the GPU machine's. The binaries look for their libraries beside themselves, then in the GPU machine's
# /usr/local/cuda/lib64 (cudart, cuBLAS). Takes ~25 min on 2 cores.  Usage: bash tools/prebuild_llama_cuda.sh
set -euo pipefail
cd "$(dirname "$0")/.."
carry=.gpu-carry
tarball="$carry/llama-cpp-python.tar.gz"
[ -f "$tarball" ] || { echo "missing $tarball: run tools/prepare_device.sh first" >&2; exit 1; }
work=${PREBUILD_DIR:-/tmp/kvrt-prebuild}
mkdir -p "$work"
src="$work/src" build="$work/build" cublas="$work/cublas" stub="$work/stub"

rm -rf "$src" && mkdir -p "$src" && tar -C "$src" -xzf "$tarball"
if [ ! -f "$cublas/nvidia/cu13/lib/libcublas.so.13" ]; then
  rm -rf "$cublas" && mkdir -p "$cublas"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$cublas" "nvidia-cublas>=13,<14"
  python3 -m zipfile -e "$cublas"/nvidia_cublas-*.whl "$cublas" && rm "$cublas"/nvidia_cublas-*.whl
fi
cb="$cublas/nvidia/cu13"
ln -sf libcublas.so.13 "$cb/lib/libcublas.so" && ln -sf libcublasLt.so.13 "$cb/lib/libcublasLt.so"

# the driver API functions ggml-cuda calls (its VMM pool), as do-nothing stubs: enough to link against
mkdir -p "$stub"
grep -ho '\bcu[A-Z][A-Za-z]*\s*(' "$src"/vendor/llama.cpp/ggml/src/ggml-cuda/*.cu* | sed 's/\s*($//' \
  | grep -v '^cuBLAS' | sort -u | sed 's/.*/int &(void) { return 0; }/' > "$stub/libcuda.c"
gcc -shared -fPIC -o "$stub/libcuda.so" -Wl,-soname,libcuda.so.1 "$stub/libcuda.c"
ln -sf libcuda.so "$stub/libcuda.so.1"  # the name the linker looks for behind libggml-cuda's DT_NEEDED

cmake -S "$src/vendor/llama.cpp" -B "$build" -G Ninja -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90-real \
  -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH="\$ORIGIN:/usr/local/cuda/lib64" \
  -DCUDA_cuda_driver_LIBRARY="$stub/libcuda.so" -DCUDA_cublas_LIBRARY="$cb/lib/libcublas.so" \
  -DCUDA_cublasLt_LIBRARY="$cb/lib/libcublasLt.so" -DCMAKE_CUDA_FLAGS="-I$cb/include" \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$cb/lib:$stub" -DCMAKE_SHARED_LINKER_FLAGS="-Wl,-rpath-link,$cb/lib:$stub"
cmake --build "$build" -j "$(nproc)" --target llama llama-server llama-batched-bench

# the pack: bin/ (the two tools and every shared library they load) and the source tarball's digest, which
# device_run.sh checks so a pack never outlives the source it was built from
stage="$work/stage" && rm -rf "$stage" && mkdir -p "$stage/bin"
cp -a "$build"/bin/llama-server "$build"/bin/llama-batched-bench "$build"/bin/*.so* "$stage/bin/"
sha256sum "$tarball" | cut -d' ' -f1 > "$stage/source.sha256"
tar -C "$stage" -cf - . | xz -T0 -6 > "$carry/llama-cuda-prebuilt.tar.xz"
du -sh "$carry/llama-cuda-prebuilt.tar.xz" "$carry"
