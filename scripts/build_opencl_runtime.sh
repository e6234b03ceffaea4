#!/usr/bin/env bash
# Build the OpenCL device for TVM's runtime (native/opencl/*.cc) into build/native/libmobilec_opencl.so, against
# the venv's TVM headers and libraries and the system's OpenCL ICD loader. Quick when the library is up to date.
# Load it with compiler.runtime.opencl_device.load() before tvm.runtime.load_module of an OpenCL artifact.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
CXX=${CXX:-g++}
out=build/native/libmobilec_opencl.so
sources=(native/opencl/opencl_device.cc native/opencl/opencl_module.cc)
headers=(native/opencl/opencl_common.h)

site=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null) || {
  echo "build_opencl_runtime.sh: no Python at $PYTHON: run scripts/setup.sh first" >&2; exit 2; }
tvm_dir=$site/tvm
ffi_dir=$site/tvm_ffi
if [ ! -f "$tvm_dir/include/tvm/runtime/device_api.h" ] || [ ! -f "$ffi_dir/lib/libtvm_ffi.so" ]; then
  echo "build_opencl_runtime.sh: apache-tvm is not installed in $site: run scripts/setup.sh first" >&2
  exit 2
fi

# Up to date: newer than its sources, this script and the TVM libraries it links.
if [ -f "$out" ]; then
  stale=0
  for f in "${sources[@]}" "${headers[@]}" "$0" "$tvm_dir/lib/libtvm_runtime.so" "$ffi_dir/lib/libtvm_ffi.so"; do
    if [ "$f" -nt "$out" ]; then stale=1; fi
  done
  if [ $stale = 0 ]; then echo "$out is up to date"; exit 0; fi
fi

if ! command -v "$CXX" >/dev/null; then
  echo "build_opencl_runtime.sh: $CXX is missing: apt-get install g++" >&2
  exit 2
fi
if [ ! -f /usr/include/CL/cl.h ]; then
  echo "build_opencl_runtime.sh: /usr/include/CL/cl.h is missing: apt-get install opencl-c-headers ocl-icd-opencl-dev" >&2
  exit 2
fi
if [ "$("$CXX" -print-file-name=libOpenCL.so)" = libOpenCL.so ]; then
  echo "build_opencl_runtime.sh: libOpenCL.so (the ICD loader) is missing: apt-get install ocl-icd-opencl-dev" >&2
  exit 2
fi

mkdir -p build/native
tmp=$(mktemp "build/native/.libmobilec_opencl.XXXXXX")
trap 'rm -f "$tmp"' EXIT
"$CXX" -O2 -std=c++17 -fPIC -shared -fvisibility=hidden -Wall -Wno-unused-parameter \
  -I"$tvm_dir/include" -I"$ffi_dir/include" \
  "${sources[@]}" -o "$tmp" \
  -L"$tvm_dir/lib" -L"$ffi_dir/lib" -Wl,-rpath,"$tvm_dir/lib" -Wl,-rpath,"$ffi_dir/lib" \
  -ltvm_runtime -ltvm_ffi -lOpenCL
mv "$tmp" "$out"
trap - EXIT
echo "built $out"
