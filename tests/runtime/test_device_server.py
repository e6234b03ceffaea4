"""`mobilec device-server` (compiler/device_server.py) on this machine: registered with a tracker, its sessions have
our OpenCL device on PoCL and its first line says so; without the library it serves the CPU only and says why (a
session there has no OpenCL device: the negative control). Bad input and an unreachable tracker are one line each.
`mobilec board-folder` writes what a board needs. The board's own run (aarch64, under qemu) is
tests/targets/test_board_opencl_on_emulated_arm.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading

import pytest
from click.testing import CliRunner
from tvm import rpc

from compiler import board_folder, device_server
from compiler.commands.cli import main
from compiler.testing.local_rpc import HOST, LocalProcess, free_port, start_tracker, wait_until_free
from tests.helpers.pocl_device import NEEDS_OPENCL
from tests.test_thread_count import physical_cores_by_lscpu

KEY = "device-server-test"


@pytest.fixture(scope="module")
def tracker_port(tmp_path_factory):
    process, port = start_tracker(tmp_path_factory.mktemp("tracker") / "tracker.log")
    yield port
    process.kill()


def _serve(tmp_path, tracker_port: int, key: str, *extra: str) -> LocalProcess:
    """`mobilec device-server` on loopback, once the tracker offers it."""
    port = free_port()
    server = LocalProcess(["compiler", "device-server", "--tracker", f"{HOST}:{tracker_port}", "--key", key, "--host",
                           HOST, "--port", str(port), "--port-end", str(port + 1), *extra], tmp_path / f"{key}.log")
    server.wait_for(rf"listening on {HOST}:{port} for key '{key}'")
    wait_until_free(tracker_port, {key: 1}, [server])
    return server


def _session_has_opencl(tracker_port: int, key: str) -> bool:
    session = rpc.connect_tracker(HOST, tracker_port).request(key, session_timeout=60)
    return bool(session.cl(0).exist)


@NEEDS_OPENCL
def test_the_server_loads_the_opencl_device_and_says_which(tmp_path, tracker_port):
    server = _serve(tmp_path, tracker_port, KEY)
    try:
        first = server.text().splitlines()[0]
        assert first.startswith("device-server: OpenCL device ") and "Portable Computing Language" in first, first
        assert _session_has_opencl(tracker_port, KEY)
    finally:
        server.kill()


def test_without_the_library_it_serves_the_cpu_and_says_why(tmp_path, tracker_port):
    missing = tmp_path / "libmobilec_opencl.so"
    server = _serve(tmp_path, tracker_port, f"{KEY}-cpu", "--opencl-library", str(missing))
    try:
        first = server.text().splitlines()[0]
        assert first == f"device-server: serving the CPU only: {missing} is missing (mobilec board-folder writes it)"
        assert not _session_has_opencl(tracker_port, f"{KEY}-cpu")
    finally:
        server.kill()


def test_the_servers_default_thread_count_is_its_physical_cores(tmp_path, tracker_port, monkeypatch):
    """Without TVM_NUM_THREADS the server sets one thread per physical core: TVM's own default halves an x86
    machine's CPUs whether or not they are SMT siblings (1 on a 2-core VM), and a client's --threads cannot size the
    pool past it."""
    for variable in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(variable, raising=False)
    server = _serve(tmp_path, tracker_port, f"{KEY}-threads", "--opencl-library", str(tmp_path / "absent.so"))
    try:
        session = rpc.connect_tracker(HOST, tracker_port).request(f"{KEY}-threads", session_timeout=60)
        assert session.get_function("runtime.NumThreads")() == physical_cores_by_lscpu()
    finally:
        server.kill()


def _refused(args: list[str]) -> str:
    before = os.environ.get("TVM_USE_RUNTIME_LIB")
    result = CliRunner().invoke(main, ["device-server", *args])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.output
    # a refused start leaves this process's environment alone: with TVM_USE_RUNTIME_LIB=1 inherited, every later
    # `mobilec` subprocess of the test worker would load TVM's runtime library only and fail to compile
    assert os.environ.get("TVM_USE_RUNTIME_LIB") == before
    return lines[0]


def test_an_unreachable_tracker_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(device_server, "CONNECT_TIMEOUT_S", 1.0)  # how long a refusing tracker is retried
    port = free_port()
    line = _refused(["--tracker", f"{HOST}:{port}", "--key", KEY])
    assert f"cannot reach the tracker at {HOST}:{port}" in line and "tvm.exec.rpc_tracker" in line


def _answer_http(listener: socket.socket) -> None:
    connection, _ = listener.accept()
    with connection:
        connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")


def test_a_peer_that_is_not_a_tracker_is_refused():
    with socket.socket() as listener:  # a web server, say: it answers, not with TVM's tracker handshake
        listener.bind((HOST, 0))
        listener.listen(1)
        peer = threading.Thread(target=_answer_http, args=(listener,), daemon=True)
        peer.start()
        line = _refused(["--tracker", f"{HOST}:{listener.getsockname()[1]}", "--key", KEY])
        peer.join()
    assert "did not answer as a TVM RPC tracker" in line


@pytest.mark.parametrize("args, needle", [
    (["--port", "9300", "--port-end", "9200"], "--port-end must be above --port"),
    (["--key", KEY], "--tracker and --key go together"),
    (["--tracker", "nohost", "--key", KEY], "is not HOST:PORT"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_options_are_one_line(args, needle):
    assert needle in _refused(args)


def test_board_folder_holds_the_server_the_aarch64_library_and_the_pins(tmp_path):
    result = CliRunner().invoke(main, ["board-folder", str(tmp_path / "board"), "--json"])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "board"
    assert sorted(p.name for p in folder.iterdir()) == ["device_server.py", "libmobilec_opencl.so", "requirements.txt"]
    header = (folder / "libmobilec_opencl.so").read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64
    dynamic = subprocess.run(["readelf", "-d", str(folder / "libmobilec_opencl.so")], capture_output=True, text=True,
                             check=True).stdout
    # What a board has once TVM's wheels are installed: nothing of this machine's, no rpath into it.
    assert set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^]]+)\]", dynamic)) == {
        "libtvm_runtime.so", "libtvm_ffi.so", "libOpenCL.so.1", "libstdc++.so.6", "libgcc_s.so.1", "libc.so.6"}
    assert "RPATH" not in dynamic and "RUNPATH" not in dynamic
    pins = (folder / "requirements.txt").read_text().split()
    assert any(pin.startswith("apache-tvm==") for pin in pins) and any(p.startswith("apache-tvm-ffi==") for p in pins)


def test_tvm_versions_other_than_the_librarys_are_refused(tmp_path):
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(board_folder.requirements())
    device_server.check_tvm(requirements)  # this machine's own versions pass
    requirements.write_text(board_folder.requirements().replace("apache-tvm-ffi==", "apache-tvm-ffi==0.0.1-was-"))
    with pytest.raises(device_server.ServerError, match=r"apache-tvm-ffi \S+ is installed, the OpenCL device here was "
                                                        r"built for 0\.0\.1-was-"):
        device_server.check_tvm(requirements)
