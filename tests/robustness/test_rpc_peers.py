"""Every RPC connection and handshake has a deadline: `bench --rpc/--tracker` against something that listens but is
not a TVM RPC server (a silent socket, an HTTP server, a server that never starts the session) ends in one line
naming the address, quickly; a real TVM RPC server still works, and the identity check costs it nothing."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from tvm import rpc

from compiler import rpc_peers
from compiler.errors import MobilecError
from compiler.runtime import remote
from compiler.testing.processes import kill_group, spawn
from tests.robustness.conftest import one_line_error, run_cli, run_subprocess

BENCH = ["--prompt-len", "4", "--gen-len", "2", "--repeat", "1"]


@pytest.fixture
def short_deadlines(monkeypatch):
    monkeypatch.setattr(rpc_peers, "CONNECT_TIMEOUT_S", 2.0)
    monkeypatch.setattr(rpc_peers, "SESSION_START_TIMEOUT_S", 3.0)


@contextlib.contextmanager
def _serving(handler) -> Iterator[str]:
    """A TCP server on loopback whose connections `handler(conn)` handles in threads; yields HOST:PORT."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    conns: list[socket.socket] = []

    def loop():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conns.append(conn)
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()
        for conn in conns:
            conn.close()


@contextlib.contextmanager
def _silent_socket() -> Iterator[str]:
    """Listens (the kernel completes connections from its backlog) and never reads or answers."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=16)
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


class _QuietHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the CLI's stderr is what the test reads
        pass


@contextlib.contextmanager
def _http_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _QuietHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _answers_the_probe_then_stalls(conn: socket.socket) -> None:
    """Like a TVM RPC server for the identity check (RPC_CODE_MISMATCH to an unknown key), then silent for a real
    client: a server that never starts the session."""
    with contextlib.suppress(OSError):
        _magic, keylen = struct.unpack("<ii", remote._recv_some(conn, 8))
        key = remote._recv_some(conn, keylen)
        if key.startswith(b"mobilec:"):
            conn.sendall(struct.pack("<i", rpc.base.RPC_CODE_MISMATCH))
            conn.close()
            return
        time.sleep(60)


def _hangs_up(conn: socket.socket) -> None:
    conn.close()


def test_silent_socket_ends_with_one_line_within_the_deadline(tiny_artifact):
    """The real command, as the issue ran it: --session-timeout 30 used to wait forever."""
    with _silent_socket() as address:
        started = time.monotonic()
        result = run_subprocess(["bench", tiny_artifact, "--rpc", address, "--session-timeout", "30", *BENCH],
                                timeout=90)
        elapsed = time.monotonic() - started
    one_line_error(result, address, "did not answer TVM RPC's handshake", "not a TVM RPC server")
    assert elapsed < rpc_peers.CONNECT_TIMEOUT_S + 30  # the deadline, plus this machine's start-up of the CLI


@pytest.mark.parametrize("peer, needles", [
    (_http_server, ["answers, but not as a TVM RPC server"]),
    (_silent_socket, ["did not answer TVM RPC's handshake within 2 s"]),
    (lambda: _serving(_answers_the_probe_then_stalls), ["started no session within 3 s"]),
    (lambda: _serving(_hangs_up), ["cannot connect to the RPC server"]),
])
def test_peers_that_are_not_rpc_servers(tiny_artifact, short_deadlines, peer, needles):
    with peer() as address:
        started = time.monotonic()
        result = run_cli(["bench", tiny_artifact, "--rpc", address, *BENCH])
        assert time.monotonic() - started < 20
    one_line_error(result, address, *needles)


@pytest.mark.parametrize("peer", [_silent_socket, _http_server])
def test_trackers_that_do_not_answer(tiny_artifact, short_deadlines, peer):
    with peer() as address:
        started = time.monotonic()
        result = run_cli(["bench", tiny_artifact, "--tracker", address, "--key", "phone", *BENCH])
        assert time.monotonic() - started < 20
    one_line_error(result, address, "did not answer as an RPC tracker")


@pytest.mark.parametrize("address, needle", [("127.0.0.1:0", "a port from 1 to 65535"),
                                             ("127.0.0.1:70000", "a port from 1 to 65535"),
                                             ("localhost", "is not HOST:PORT"), (":9090", "is not HOST:PORT")])
def test_bad_addresses_are_refused_before_anything(tiny_artifact, address, needle):
    one_line_error(run_cli(["bench", tiny_artifact, "--rpc", address]), "--rpc", needle)


def test_a_real_rpc_server_passes_the_check_and_keeps_serving(tmp_path):
    """Negative control: the identity check answers at once on a TVM RPC server, which then serves sessions."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = spawn([sys.executable, "-m", "tvm.exec.rpc_server", "--host", "127.0.0.1", "--port", str(port),
                    "--port-end", str(port + 1)], tmp_path / "server.log", env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        while f"bind to 127.0.0.1:{port}" not in (tmp_path / "server.log").read_text(errors="replace"):
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.2)
        started = time.monotonic()
        remote.check_rpc_server("127.0.0.1", port)
        assert time.monotonic() - started < 2
        for _ in range(2):  # the probe left the server serving
            device = remote.connect(f"127.0.0.1:{port}", None, None, 60)
            try:
                assert device.description["triple"].startswith("x86_64")
            finally:
                device.close()
    finally:
        kill_group(server)


def test_deadline_interrupts_a_blocking_tvm_call_and_restores_an_outer_one():
    with _silent_socket() as address:
        host, port = address.rsplit(":", 1)
        started = time.monotonic()
        with (pytest.raises(MobilecError, match="inner"), rpc_peers.deadline(30, "outer"),
              rpc_peers.deadline(1, "inner")):
            rpc.connect(host, int(port))  # TVM's C++ handshake: blocks in recv, no timeout of its own
        assert time.monotonic() - started < 5
    with pytest.raises(MobilecError, match="outer"), rpc_peers.deadline(1, "outer"), rpc_peers.deadline(30, "inner"):
        time.sleep(5)


def test_deadline_in_another_thread_leaves_the_block_alone():
    """Signals reach the main thread only: elsewhere the socket timeouts bound the waits, and the block runs."""
    done = []

    def work():
        with rpc_peers.deadline(0.05, "x"):
            time.sleep(0.2)
            done.append(True)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert done == [True]


def _session(age_s: float = 0.0, timeout_s: float = 600.0) -> remote.Device:
    """A remote session's Device `age_s` old, without a connection: only what its error handling reads."""
    device = object.__new__(remote.Device)
    device.session, device.description = object(), {"name": "the RPC server at 10.0.0.2:9090"}
    device.started, device.session_timeout_s = time.monotonic() - age_s, timeout_s
    device._last_step = None  # pylint: disable=protected-access
    return device


def _explained(message: str) -> str:
    """What a remote session's Device says of a TVM error with this message (a fresh session)."""
    return _session()._explain(RuntimeError(message), "running the benchmark")  # pylint: disable=protected-access


def test_a_call_into_an_ended_session_that_returns_nothing_is_the_timeout():
    """A call into a session the server has just ended can return None where a value was due, and tvm_ffi raises
    TypeError (seen in a full test run, tests/test_bench_rpc.py::test_session_timeout_ends_the_bench); negative
    control: a TypeError in a session not due to end is not taken for the timeout."""
    with pytest.raises(MobilecError, match="ran past --session-timeout 5 s while running the benchmark"):
        with _session(age_s=10.0, timeout_s=5.0).errors("running the benchmark"):
            raise TypeError("Cannot convert from type `None` to `int`")
    with pytest.raises(TypeError, match="None"):
        with _session().errors("running the benchmark"):
            raise TypeError("Cannot convert from type `None` to `int`")


def test_a_loop_stops_before_its_session_ends():
    """The bench stops a step that might not finish inside the session (the server cutting a reply short can abort
    TVM's client: std::length_error, seen in CI on tests/test_bench_rpc.py::test_session_timeout_ends_the_bench);
    negative controls: steps with time to spare go on, and this process has no session to end."""
    device = _session(age_s=2.0, timeout_s=5.0)
    device.step_inside_session("decoding")  # 3 s left, no step timed yet
    device._last_step -= 1.5  # pylint: disable=protected-access  # a 1.5 s step: 3 s left < 1 + 2 x 1.5
    with pytest.raises(MobilecError, match="ran past --session-timeout 5 s while decoding; raise --session-timeout"):
        device.step_inside_session("decoding")
    roomy = _session(age_s=2.0, timeout_s=600.0)
    for _ in range(3):
        roomy.step_inside_session("decoding")
    local = _session(age_s=10.0, timeout_s=5.0)
    local.session = None
    local.step_inside_session("decoding")


@pytest.mark.parametrize("message", [
    "Socket SockChannel::Recv Error:Connection reset by peer",
    # a server killed while it sent a tensor back (seen in a full test run, tests/test_bench_rpc.py)
    "Check failed: (HandleUntilReturnEvent(true, [](ffi::PackedArgs) {}) == RPCCode::kCopyAck) is false:",
])
def test_a_broken_stream_is_a_lost_connection(message):
    assert _explained(message).startswith("lost the connection to the RPC server at 10.0.0.2:9090 while running")


def test_negative_control_an_error_of_the_devices_code_is_not_a_lost_connection():
    said = _explained("TVMError: Check failed: (n == 3) is false: bad shape")
    assert said.startswith("the RPC server at 10.0.0.2:9090 failed while running the benchmark: ")
