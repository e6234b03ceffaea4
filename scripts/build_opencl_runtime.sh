#!/usr/bin/env bash
# Build the OpenCL device for TVM's runtime (native/opencl/*.cc) against the venv's TVM headers. Quick when the
# library is up to date. Load it with compiler.runtime.opencl_device.load() before tvm.runtime.load_module of an
# OpenCL artifact, or into an RPC server (mobilec device-server).
#   (no option)     this machine: build/native/libmobilec_opencl.so, linked to the venv's TVM libraries and the
#                   system's OpenCL ICD loader.
#   --arch aarch64  an arm64 Linux board (RK3588 and the like): build/native/aarch64/libmobilec_opencl.so, with
#                   Debian's cross compiler, linked to the aarch64 wheels of the venv's apache-tvm and apache-tvm-ffi
#                   (pip download) and Debian arm64's ICD loader (apt-get download into a private apt state), all
#                   kept in build/native/aarch64/sysroot. No rpath: the board's `import tvm` has loaded both TVM
#                   libraries (by soname) before the server loads this one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
arch=host
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arch=${2:-}; shift 2 || { echo "build_opencl_runtime.sh: --arch needs a value (aarch64)" >&2; exit 2; } ;;
    *) echo "build_opencl_runtime.sh: unknown argument $1; usage: build_opencl_runtime.sh [--arch aarch64]" >&2
       exit 2 ;;
  esac
done
if [ "$arch" != host ] && [ "$arch" != aarch64 ]; then
  echo "build_opencl_runtime.sh: --arch $arch is not supported; use --arch aarch64 or no option (this machine)" >&2
  exit 2
fi
sources=(native/opencl/opencl_device.cc native/opencl/opencl_common.h native/opencl/opencl_module.cc)
compiled=(native/opencl/opencl_device.cc native/opencl/opencl_module.cc)

site=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null) || {
  echo "build_opencl_runtime.sh: no Python at $PYTHON: run scripts/setup.sh first" >&2; exit 2; }
tvm_dir=$site/tvm
ffi_dir=$site/tvm_ffi
if [ ! -f "$tvm_dir/include/tvm/runtime/device_api.h" ] || [ ! -f "$ffi_dir/lib/libtvm_ffi.so" ]; then
  echo "build_opencl_runtime.sh: apache-tvm is not installed in $site: run scripts/setup.sh first" >&2
  exit 2
fi

if [ "$arch" = host ]; then
  CXX=${CXX:-g++}
  out=build/native/libmobilec_opencl.so
  lib_dirs=("$tvm_dir/lib" "$ffi_dir/lib")
  links=("$tvm_dir/lib/libtvm_runtime.so" "$ffi_dir/lib/libtvm_ffi.so")
  rpaths=(-Wl,-rpath,"$tvm_dir/lib" -Wl,-rpath,"$ffi_dir/lib")
  opencl=-lOpenCL
else
  CXX=${CXX:-aarch64-linux-gnu-g++}
  out=build/native/aarch64/libmobilec_opencl.so
  sysroot=build/native/aarch64/sysroot
  lib_dirs=("$sysroot")
  links=("$sysroot/libtvm_runtime.so" "$sysroot/libtvm_ffi.so" "$sysroot/libOpenCL.so.1")
  rpaths=()
  opencl=-l:libOpenCL.so.1
fi

# One build at a time (test workers start emulated boards together): a second waits, then finds it up to date.
mkdir -p build/native
exec 9>build/native/.build_opencl_runtime.lock
flock 9

# Up to date: newer than its sources, this script and the libraries it links.
if [ -f "$out" ]; then
  stale=0
  for f in "${sources[@]}" "$0" "${links[@]}"; do
    if [ ! -e "$f" ] || [ "$f" -nt "$out" ]; then stale=1; fi
  done
  if [ $stale = 0 ]; then echo "$out is up to date"; exit 0; fi
fi

if ! command -v "$CXX" >/dev/null; then
  package=$([ "$arch" = host ] && echo g++ || echo g++-aarch64-linux-gnu)
  echo "build_opencl_runtime.sh: $CXX is missing: apt-get install $package" >&2
  exit 2
fi
if [ ! -f /usr/include/CL/cl.h ]; then
  echo "build_opencl_runtime.sh: /usr/include/CL/cl.h is missing: apt-get install opencl-c-headers ocl-icd-opencl-dev" >&2
  exit 2
fi

if [ "$arch" = host ]; then
  if [ "$("$CXX" -print-file-name=libOpenCL.so)" = libOpenCL.so ]; then
    echo "build_opencl_runtime.sh: libOpenCL.so (the ICD loader) is missing: apt-get install ocl-icd-opencl-dev" >&2
    exit 2
  fi
else
  # The board's libraries, fetched once: the aarch64 wheels of the TVM versions installed here (what the board must
  # run), and Debian arm64's ICD loader.
  versions=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("apache-tvm"), m.version("apache-tvm-ffi"))')
  read -r tvm_version ffi_version <<< "$versions"
  stamp="$sysroot/versions"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$versions" ]; then
    rm -rf "$sysroot" && mkdir -p "$sysroot/wheels" "$sysroot/apt/lists/partial" "$sysroot/apt/archives/partial"
    "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
      --platform manylinux_2_28_aarch64 --python-version 3.11 --implementation cp -d "$sysroot/wheels" \
      "apache-tvm==$tvm_version" "apache-tvm-ffi==$ffi_version" || {
      echo "build_opencl_runtime.sh: pip could not download the aarch64 wheels of apache-tvm $tvm_version and" \
           "apache-tvm-ffi $ffi_version; check the network and rerun" >&2; exit 2; }
    "$PYTHON" - "$sysroot" <<'EOF'
import pathlib, sys, zipfile
sysroot = pathlib.Path(sys.argv[1])
wanted = {"tvm/lib/libtvm_runtime.so", "tvm_ffi/lib/libtvm_ffi.so"}
for wheel in (sysroot / "wheels").glob("*.whl"):
    with zipfile.ZipFile(wheel) as archive:
        for name in wanted & set(archive.namelist()):
            (sysroot / pathlib.PurePath(name).name).write_bytes(archive.read(name))
EOF
    # A private apt state that knows only arm64: the host's package lists and dpkg architectures stay untouched.
    apt_options=(-qq -o APT::Architecture=arm64 -o APT::Architectures::=arm64 -o Dir::State::status=/dev/null
                 -o Dir::State::Lists="$PWD/$sysroot/apt/lists" -o Dir::Cache="$PWD/$sysroot/apt"
                 -o Dir::Cache::archives="$PWD/$sysroot/apt/archives")
    (apt-get "${apt_options[@]}" update && cd "$sysroot/apt" && apt-get "${apt_options[@]}" download \
      ocl-icd-libopencl1) >/dev/null 2>&1 || {
      echo "build_opencl_runtime.sh: apt-get could not download Debian arm64's ocl-icd-libopencl1 (do this" \
           "machine's apt sources serve arm64?); check them and rerun" >&2; exit 2; }
    dpkg -x "$sysroot"/apt/ocl-icd-libopencl1_*_arm64.deb "$sysroot/deb"
    cp -L "$sysroot/deb/usr/lib/aarch64-linux-gnu/libOpenCL.so.1" "$sysroot/libOpenCL.so.1"
    rm -rf "$sysroot/wheels" "$sysroot/apt" "$sysroot/deb"
    echo "$versions" > "$stamp"
  fi
  for f in "${links[@]}"; do
    if [ ! -f "$f" ]; then
      echo "build_opencl_runtime.sh: $f is missing after the download; delete $sysroot and rerun" >&2; exit 2
    fi
  done
fi

mkdir -p "$(dirname "$out")"
tmp=$(mktemp "$(dirname "$out")/.libmobilec_opencl.XXXXXX")
trap 'rm -f "$tmp"' EXIT
# -z defs: every symbol must resolve in the libraries named here, so a library that would fail to load on the
# board fails to build instead.
"$CXX" -O2 -std=c++17 -fPIC -shared -fvisibility=hidden -Wall -Wno-unused-parameter -Wl,-z,defs \
  -I"$tvm_dir/include" -I"$ffi_dir/include" \
  "${compiled[@]}" -o "$tmp" \
  "${lib_dirs[@]/#/-L}" ${rpaths[@]+"${rpaths[@]}"} -ltvm_runtime -ltvm_ffi "$opencl"
mv "$tmp" "$out"
trap - EXIT
echo "built $out"
