"""Serve a device (a board, this machine) to mobilec over TVM RPC, with its GPU through our OpenCL device.

One self-contained file, Python's standard library and TVM's wheels only, because mobilec itself (the compiler:
torch, transformers, an x86 toolchain) is not what a board should install: `mobilec board-folder DIR` writes this
file beside the board's build of the OpenCL device and a requirements.txt; copy DIR to the board and run
`python3 DIR/device_server.py --tracker HOST:9190 --key rk3588` there. On this machine `mobilec device-server` runs
the same file with this machine's OpenCL device.

It registers with a tracker under a key (or, without --tracker, listens for `mobilec bench --rpc`), binds the first
free port in [--port, --port-end), loads the OpenCL device where an OpenCL platform exists and says in one line
which platform and device (or that it serves the CPU only, and why), and loads TVM's libtvm_runtime_extra.so
(random_fill_for_measure, which MetaSchedule's RPC runner needs). Bad input and an unreachable tracker end it in one
line with exit code 2.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import os
import socket
import struct
import sys
import time
from pathlib import Path

OPENCL_LIBRARY = "libmobilec_opencl.so"
REQUIREMENTS = "requirements.txt"
CONNECT_TIMEOUT_S = 10.0
DEFAULT_PORT = 9090
# Ports tried after --port when it is taken (TVM's own server ends its range at 9199).
PORT_RANGE = 100
HERE = Path(__file__).resolve().parent


class ServerError(Exception):
    """Bad input or an unusable environment: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ServerError(f"{message} (see {self.prog} --help)")


def parse_args(argv: list[str] | None, default_opencl_library: Path, prog: str) -> argparse.Namespace:
    parser = _Parser(
        prog=prog,
        description="Serve this device to mobilec over TVM RPC: registered with a tracker under --key (or listening "
                    "for `mobilec bench --rpc HOST:PORT`), with the GPU through mobilec's OpenCL device where an "
                    "OpenCL platform exists (MOBILEC_OPENCL_PLATFORM picks one by a part of its name), else the "
                    "CPU only. Needs the apache-tvm and apache-tvm-ffi wheels mobilec was built with, plus tornado, "
                    "cloudpickle and psutil (requirements.txt beside this file).")
    parser.add_argument("--tracker", metavar="HOST:PORT",
                        help="the RPC tracker to register with (python -m tvm.exec.rpc_tracker --port 9190)")
    parser.add_argument("--key", help="the device's key in the tracker, what `mobilec bench --key` asks for")
    parser.add_argument("--host", default="0.0.0.0", help="the address to listen on (default: all)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"the first port to try (default {DEFAULT_PORT})")
    parser.add_argument("--port-end", type=int, default=None,
                        help=f"the end of the port range, exclusive (default --port + {PORT_RANGE}); give --port + 1 "
                             "for exactly --port")
    parser.add_argument("--opencl-library", type=Path, default=default_opencl_library,
                        help=f"mobilec's OpenCL device for this machine (default {default_opencl_library})")
    parser.add_argument("--no-opencl", action="store_true", help="serve the CPU only, even with an OpenCL platform")
    args = parser.parse_args(argv)
    if args.port_end is None:
        args.port_end = args.port + PORT_RANGE
    if not 0 < args.port < args.port_end <= 65536:
        raise ServerError(f"--port {args.port} --port-end {args.port_end} is no port range: --port-end must be "
                          f"above --port, both within 1-65535")
    if (args.tracker is None) != (args.key is None):
        raise ServerError("--tracker and --key go together: give both (registered with a tracker) or neither "
                          "(listening for `mobilec bench --rpc`)")
    if args.tracker is not None:
        host, _, port = args.tracker.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ServerError(f"--tracker {args.tracker} is not HOST:PORT; e.g. --tracker 192.168.1.10:9190")
        args.tracker = (host, int(port))
    return args


def check_tvm(requirements: Path) -> None:
    """Import TVM's runtime; where requirements.txt pins versions, they must be the installed ones (the OpenCL
    device is linked against exactly those libraries)."""
    try:
        import tvm  # pylint: disable=import-outside-toplevel,unused-import
        import tvm.rpc  # pylint: disable=import-outside-toplevel,unused-import
    except ImportError as err:
        raise ServerError(f"TVM's runtime does not import ({err}): pip install -r {requirements}") from None
    if not requirements.is_file():
        return
    for line in requirements.read_text().splitlines():
        name, _, wanted = line.partition("==")
        if not name.startswith("apache-tvm"):
            continue
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = "none"
        if installed != wanted:
            raise ServerError(f"{name} {installed} is installed, the OpenCL device here was built for {wanted}: "
                              f"pip install -r {requirements}")


def check_tracker(host: str, port: int) -> None:
    """That a TVM RPC tracker answers at host:port within CONNECT_TIMEOUT_S (one refusing connections is retried
    that long: a tracker started together with this server may not listen yet)."""
    from tvm.rpc.base import RPC_TRACKER_MAGIC  # pylint: disable=import-outside-toplevel

    where = f"{host}:{port}"
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
            break
        except ConnectionRefusedError:
            if time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            reason = "connection refused"
        except OSError as err:
            reason = err.strerror or str(err)
        raise ServerError(f"cannot reach the tracker at {where} ({reason}): start it there (python -m "
                          f"tvm.exec.rpc_tracker --host 0.0.0.0 --port {port}) or fix --tracker")
    with sock:
        try:
            sock.sendall(struct.pack("<i", RPC_TRACKER_MAGIC))
            reply = sock.recv(4)
        except OSError:  # reset, or silent past the timeout
            reply = b""
    if len(reply) != 4 or struct.unpack("<i", reply)[0] != RPC_TRACKER_MAGIC:
        raise ServerError(f"{where} accepts connections but did not answer as a TVM RPC tracker within "
                          f"{CONNECT_TIMEOUT_S:g} s: fix --tracker (an RPC server's address goes to `mobilec bench "
                          f"--rpc`)")


def load_opencl(library: Path) -> str:
    """Load the OpenCL device into this process to see what it finds; the line that says it."""
    import tvm  # pylint: disable=import-outside-toplevel

    try:
        ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    except OSError as err:
        detail = str(err).splitlines()[0]
        if "libOpenCL" in detail:
            detail = "no OpenCL ICD loader: apt-get install ocl-icd-libopencl1 and the GPU's OpenCL driver"
        raise ServerError(f"cannot load {library} ({detail})") from None
    if tvm.get_global_func("mobilec.opencl.num_devices")() == 0:
        raise ServerError(f"no OpenCL device ({tvm.get_global_func('mobilec.opencl.init_error')()}); "
                          f"install the GPU's OpenCL driver (its ICD file in /etc/OpenCL/vendors)")
    platform, device, version, fp16 = str(tvm.get_global_func("mobilec.opencl.describe")(0)).split("\t")
    return f"OpenCL device {device} on {platform} ({version}; {'float16' if fp16 == 'fp16' else 'no float16'})"


def libraries(args: argparse.Namespace) -> tuple[list[str], str]:
    """The libraries each session loads (absolute: the server loads them from its session's directory) and the
    line that says what the device serves."""
    import tvm  # pylint: disable=import-outside-toplevel

    loaded = []
    extra = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_extra.so"
    if extra.is_file():
        loaded.append(str(extra))
    if args.no_opencl:
        return loaded, "serving the CPU only (--no-opencl)"
    library = args.opencl_library.resolve()
    if not library.is_file():
        return loaded, f"serving the CPU only: {library} is missing (mobilec board-folder writes it)"
    try:
        said = load_opencl(library)
    except ServerError as err:
        return loaded, f"serving the CPU only: {err}"
    return [*loaded, str(library)], said


def core_of(cpu: int) -> str:
    """The physical core of CPU `cpu` (Linux's number), as the list of its SMT siblings; where Linux does not say, the
    CPU alone."""
    try:
        return Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return str(cpu)


def physical_cores(cpus) -> int:
    """The physical cores among `cpus` (Linux's CPU numbers): SMT siblings count once; where Linux does not say which
    are siblings, every CPU."""
    return len({core_of(cpu) for cpu in cpus})


def serve(args: argparse.Namespace) -> None:
    # TVM's default thread count halves an x86 device's CPUs whether or not they are SMT siblings (1 on a 2-core VM),
    # and a client's --threads only resizes the pool up to it
    if "TVM_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ and hasattr(os, "sched_getaffinity"):
        os.environ["TVM_NUM_THREADS"] = str(physical_cores(os.sched_getaffinity(0)))
    import tvm.rpc  # pylint: disable=import-outside-toplevel

    if args.tracker is not None:
        check_tracker(*args.tracker)
    loaded, said = libraries(args)
    print(f"device-server: {said}", flush=True)
    # The server's processes load TVM's runtime library alone (set here, not on import: `mobilec device-server`
    # runs in a process that may go on using the compiler after a refused start)
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    try:
        server = tvm.rpc.Server(args.host, args.port, args.port_end, tracker_addr=args.tracker, key=args.key or "",
                                load_library=":".join(loaded))
    except Exception as err:  # pylint: disable=broad-except  # the server's process reports any failure as itself
        message = str(err).strip().splitlines()
        raise ServerError(f"the RPC server did not start ({message[-1] if message else type(err).__name__}); "
                          f"check --host and the port range [{args.port}, {args.port_end})") from None
    address = "THIS-DEVICE" if args.host == "0.0.0.0" else args.host
    where = f"key {args.key!r} at the tracker {args.tracker[0]}:{args.tracker[1]}" if args.tracker else \
        f"mobilec bench --rpc {address}:{server.port}"
    print(f"device-server: listening on {args.host}:{server.port} for {where} (Ctrl-C stops)", flush=True)
    try:
        server.proc.join()
    finally:
        server.terminate()


def run(argv: list[str] | None, default_opencl_library: Path, prog: str) -> None:
    """Serve until the server ends or Ctrl-C; ServerError for bad input or an unusable environment."""
    args = parse_args(argv, default_opencl_library, prog)
    check_tvm(HERE / REQUIREMENTS)
    serve(args)


def main() -> int:
    # Before TVM is imported: the runtime library alone (a board has no use for the compiler's, and it is slower).
    os.environ.setdefault("TVM_USE_RUNTIME_LIB", "1")
    try:
        run(None, HERE / OPENCL_LIBRARY, Path(sys.argv[0]).name)
    except ServerError as err:
        print(f"device-server: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
