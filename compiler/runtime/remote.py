"""The device a benchmark runs on (this process, an RPC server, or one a tracker hands out) and putting an
artifact there: files uploaded once and skipped by sha256 afterwards, weights loaded by the device itself.

TVM's RPC servers give each session a fresh work directory and delete it when the session ends; they offer
upload, download and remove but no mkdir. Files that must outlive a session therefore sit next to that
directory (`../mobilec-<artifact>-<hash>.<file>`), and a manifest there records the sha256 of each one.

Weights are loaded on the device by `vm.builtin.tensor_cache.load`, which reads shards described by a
`tensor-cache.json` (TVM's tvmjs format). Our shards fit that format as they are (raw little-endian bytes at
recorded offsets), so the JSON is generated from params/index.json, with data paths pointing at the shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tvm
from tqdm import tqdm
from tvm import rpc

from .. import rpc_peers, validate
from ..target import host
from ..artifacts.artifact import PARAMS_DIR, Artifact
from ..errors import MobilecError
from ..rpc_peers import check_key, deadline, last_line, open_tracker
from ..target.cpu_check import Cpu, check_cpu, this_cpu
from ..target.isa import arch_of_triple

TENSOR_CACHE_JSON = "tensor-cache.json"  # the file name vm.builtin.tensor_cache.load reads in its directory
# A key no server accepts (TVM's clients send "client:..."): a TVM RPC server answers it with RPC_CODE_MISMATCH
# at once, without starting a session. The line end makes an HTTP server answer too (with an error page).
_PROBE_KEY = b"mobilec:probe\r\n"
SESSION_MARGIN_S = 1.0  # what a loop leaves of its session, besides twice its step, to close it cleanly
_RPC_CODES = {rpc.base.RPC_CODE_SUCCESS, rpc.base.RPC_CODE_DUPLICATE, rpc.base.RPC_CODE_MISMATCH}


@dataclasses.dataclass
class Staged:
    """An artifact's files as the device sees them, and what staging them cost."""

    library: str  # what load_module takes on the device
    tensor_cache_dir: str  # the directory holding tensor-cache.json, as a path on the device
    uploaded: list[str]
    skipped: list[str]
    upload_bytes: int


class Device:
    """This process (session None) or a TVM RPC session, behind one interface."""

    def __init__(self, session: rpc.RPCSession | None, description: dict[str, Any], session_timeout_s: float):
        self.session = session
        self.description = description
        self.session_timeout_s = session_timeout_s
        self.started = time.monotonic()
        self._last_step: float | None = None  # when step_inside_session last ran
        self.dev = session.cpu() if session else tvm.cpu()
        self._work_dir: tempfile.TemporaryDirectory | None = None
        with self.bounded(), self.errors("asking what the device is"):
            triple = self._triple()
            total = self.dev.total_global_memory  # RAM for a CPU; None or -1 when the device cannot tell
            self.cpu = self._cpu(triple)
        self.description["triple"] = triple
        # Without a triple, the arch is learnt when the device loads a library (note_loaded).
        self.description["arch"] = self.cpu.arch
        self.description["arch_from"] = "its LLVM target triple" if triple else None
        self.description["cpu_features_from"] = (
            "this machine's CPU (LLVM's name for it, features cut to /proc/cpuinfo's flags)" if session is None else
            "LLVM's host CPU features on the device" if self.cpu.features is not None else None)
        self.description["total_ram_mb"] = round(total / 2**20) if total and total > 0 else None
        self.description["kernels_on"] = "cpu"  # until use_device_of picks the artifact's device
        self.description["opencl"] = None  # the OpenCL platform and device, once use_device_of picks OpenCL

    def _triple(self) -> str | None:
        """The device's target triple, when its TVM has LLVM (a runtime-only build, as on phones, does not)."""
        try:
            return self.function("tvm.codegen.llvm.GetProcessTriple")()
        except (AttributeError, ValueError):  # how a missing function shows over RPC, and locally
            return None

    def _cpu(self, triple: str | None) -> Cpu:
        """The device's CPU as far as it can tell: this machine's, or over RPC the triple's architecture and the
        features LLVM finds there (cpuid, hwcaps) when the device's TVM has LLVM; a runtime-only build (the RPC
        app on phones, TVM_USE_RUNTIME_LIB servers) reports neither, and RPC cannot read /proc/cpuinfo (the
        server's download sizes files by seeking, and /proc files have no size)."""
        if self.session is None:
            return this_cpu()
        arch = None
        if triple:
            arch = arch_of_triple(triple)
            arch = triple.split("-")[0] if arch == "other" else arch
        try:
            # A Map cannot cross RPC (it comes back as a handle): the device prints it and it is parsed here.
            text = str(self.function("ffi.ReprPrint")(self.function("tvm.codegen.llvm.GetHostCPUFeatures")()))
        except (AttributeError, ValueError):  # a runtime without LLVM
            text = ""
        features = frozenset(re.findall(r'"([^"]+)":\s*(?:T\.bool\()?(?:True|1)\b', text))
        return Cpu(self.description["name"], arch, features or None)

    def use_device_of(self, artifact: Artifact) -> None:
        """Run the artifact's kernels where its target puts them: the CPU, or OpenCL (this process loads our
        OpenCL device, runtime/opencl_device.py; an RPC server must have been started with it: `mobilec
        device-server`, or on a board the device_server.py that `mobilec board-folder` writes)."""
        kind = artifact.config["target"]["tvm_target"]["kind"]
        if kind == "hexagon" and self.session is not None:
            raise MobilecError(f"{artifact.path} runs its NPU kernels on the emulated Hexagon DSP of this machine, "
                               f"which an RPC device cannot reach; run it here, without --rpc or --tracker")
        if kind == "hexagon":
            self.description["kernels_on"] = "cpu and the emulated hexagon dsp"
        if kind != "opencl":
            return
        from . import opencl_device  # pylint: disable=import-outside-toplevel

        if self.session is None:
            opencl_device.load()
            dev = tvm.opencl(0)
        else:
            dev = self.session.cl(0)
        with self.bounded(), self.errors("asking for its OpenCL device"):
            exists = dev.exist
        if not exists:
            where = ("this machine has no OpenCL device: apt-get install pocl-opencl-icd (or the GPU's driver)"
                     if self.session is None else
                     f"{self.description['name']} has no OpenCL device: serve it with `mobilec device-server` (on a "
                     f"board, from the folder `mobilec board-folder` writes; its first line names the OpenCL device "
                     f"or why there is none), or use the TVM RPC app on a phone")
            raise MobilecError(f"{artifact.library.name} runs its kernels on OpenCL, but {where}")
        with self.bounded(), self.errors("asking for its OpenCL platform"):
            opencl = opencl_device.describe(self.function)
        if opencl is not None and artifact.config["compute_dtype"] == "float16" and not opencl["fp16"]:
            raise MobilecError(
                f"{artifact.library.name} computes in float16, but OpenCL device {opencl['device']} "
                f"({opencl['platform']}) has no cl_khr_fp16: pick a platform that has it with "
                f"{opencl_device.PLATFORM_VARIABLE} (here `intel`, Intel's CPU runtime that scripts/setup.sh "
                f"installs), or compile with --compute-dtype float32")
        self.dev = dev
        self.description["kernels_on"] = "opencl"
        self.description["opencl"] = opencl

    @property
    def devices(self) -> list:
        """The VM's devices: the one its kernels run on, then the CPU for its shape computations."""
        cpu = self.session.cpu() if self.session else tvm.cpu()
        return [self.dev] if self.dev.dlpack_device_type() == cpu.dlpack_device_type() else [self.dev, cpu]

    @property
    def device_type(self) -> int:
        """The DLPack device type as the device itself knows it (without the RPC session mask)."""
        return self.dev.dlpack_device_type() % rpc.base.RPC_SESS_MASK

    def note_loaded(self, artifact: Artifact) -> None:
        """The device loaded the artifact's library: it runs that architecture, if nothing said so before."""
        if self.description["arch"] is None:
            self.description["arch"] = artifact_arch(artifact)
            self.description["arch_from"] = f"it loaded {artifact.library.name} built for that"

    def function(self, name: str):
        """A global function of the device's runtime."""
        if self.session is None:
            return tvm.get_global_func(name)
        return self.session.get_function(name)

    def shape(self, *dims: int):
        """A Shape made on the device: RPC cannot send a Shape object, only a handle to a remote one."""
        return self.function("ffi.Shape")(*dims)

    def load_library(self, artifact: Artifact, staged: Staged):
        """The artifact's compiled library, loaded on the device (its files were checked by load_artifact)."""
        if self.session is None:
            try:
                return tvm.runtime.load_module(staged.library)
            except Exception as err:  # noqa: BLE001  TVM reports a bad .so as a generic error
                raise MobilecError(f"cannot load {artifact.library}: {str(err).splitlines()[0]}; recompile the "
                                   f"artifact") from None
        try:
            lib = self.session.load_module(staged.library)
        except RuntimeError as err:
            if "ELF" not in str(err) and "shared object" not in str(err):
                raise
            # The loader rejects a library made for another architecture (not detectable beforehand when the
            # device's TVM has no LLVM to report its triple).
            target = artifact.config["target"]
            raise MobilecError(f"{self.description['name']} cannot load {artifact.library.name} built for "
                               f"{target['name']} ({target['tvm_target'].get('mtriple', '')}): {last_line(err)}; "
                               f"compile it with a --target for that device") from None
        self.note_loaded(artifact)
        return lib

    def set_threads(self, threads: int | None) -> None:
        """Size the device's thread pool; None: this process's default (host.set_threads), a remote device's own."""
        if self.session is None:
            # this process: TVM_NUM_THREADS too, as generate and profile size it. TVM runs a parallel kernel on one
            # thread when that variable's count is 1, whatever the pool was sized to.
            host.set_threads(threads)
            return
        if threads is None:
            return
        # mode 0: the placement the device's TVM made (its CPUs are not known here); its TVM_NUM_THREADS still caps it
        self.function("runtime.config_threadpool")(0, threads)

    def stage(self, artifact: Artifact, progress: bool) -> Staged:
        """Make the artifact's library and shards available on the device; uploads only what it lacks."""
        if self.session is None:
            # Nothing to copy: the JSON goes to a temporary directory and points at the artifact's own shards.
            self._work_dir = tempfile.TemporaryDirectory(prefix="mobilec-bench-")
            work = Path(self._work_dir.name)
            params = (artifact.path / PARAMS_DIR).resolve()
            paths = {s["file"]: os.path.relpath(params / s["file"], work) for s in artifact.index["shards"]}
            (work / TENSOR_CACHE_JSON).write_text(tensor_cache_json(artifact, paths))
            return Staged(str(artifact.library), str(work), [], [], 0)
        with self.errors("uploading the artifact"):
            return _stage_remote(self.session, artifact, progress)

    def load_params(self, staged: Staged, artifact: Artifact):
        """The parameters, read from the shards by the device itself, in the order the compiled functions take
        them (params/index.json's order, as Artifact.load_params)."""
        self.function("vm.builtin.tensor_cache.load")(staged.tensor_cache_dir, self.device_type, self.dev.index)
        names = [t["name"] for t in artifact.index["tensors"]]
        # RPC cannot send an Array of names, so the unpacked variant takes them as separate arguments.
        params = self.function("vm.builtin.param_array_from_cache_by_name_unpacked")(*names)
        # The array holds the tensors; the global cache need not (in this process it would outlive the bench).
        self.function("vm.builtin.tensor_cache.clear")()
        return params

    def bounded(self):
        """A deadline for work in the session: what is left of --session-timeout, plus a grace for the server to
        end it. Past that the device or the network is gone (a dead peer sends nothing, so a read would wait
        forever). Nothing for this process."""
        if self.session is None:
            return contextlib.nullcontext()
        grace = rpc_peers.SESSION_GRACE_S
        left = self.session_timeout_s - (time.monotonic() - self.started) + grace
        return deadline(max(left, 1.0), f"the session on {self.description['name']} ran past --session-timeout "
                                        f"{self.session_timeout_s:g} s (+{grace:g} s) and the device did not end it: "
                                        f"the device or the network is gone; check them, then rerun")

    def step_inside_session(self, doing: str) -> None:
        """Called before each step of a long loop on the device: refuses the step when the last one, taken again,
        might not finish inside --session-timeout. The server ends a session by closing its socket, and TVM's
        client, cut off mid-reply, can abort the whole process (std::length_error) instead of raising; so the
        bench stops itself first and closes the session cleanly. Nothing for this process."""
        if self.session is None:
            return
        now = time.monotonic()
        step_s = now - self._last_step if self._last_step is not None else 0.0
        self._last_step = now
        if self.session_timeout_s - (now - self.started) < SESSION_MARGIN_S + 2 * step_s:
            raise MobilecError(self._timed_out(doing))

    def close(self) -> None:
        """End the session now (the server serves one at a time; handles left in a traceback would keep this
        one open until its timeout) and remove local staging files."""
        if self.session is not None:
            # the connection may be gone already, or the peer silent
            with contextlib.suppress(RuntimeError, MobilecError), deadline(rpc_peers.CONNECT_TIMEOUT_S, "closing"):
                self.session.get_function("CloseRPCConnection")()
            self.session = None
        if self._work_dir is not None:
            self._work_dir.cleanup()
            self._work_dir = None

    @contextlib.contextmanager
    def errors(self, doing: str) -> Iterator[None]:
        """Turn a failure on the device into one line that says what was happening and what to do."""
        try:
            yield
        except RuntimeError as err:  # TVM raises its errors (RPC ones included) as RuntimeError subclasses
            raise MobilecError(self._explain(err, doing)) from None
        except TypeError as err:
            # a call into a session the server has just ended can return None where a value was due (tvm_ffi:
            # "Cannot convert from type `None` to `int`"): the timeout, when the session was due to end
            if not self._expired(err):
                raise
            raise MobilecError(self._explain(err, doing)) from None

    def _expired(self, err: Exception) -> bool:
        """Whether `err` came from the session's end: the server's timeout message may arrive cut short, or as a
        bare reset (it closes the socket with requests unread), so any failure when it was due counts."""
        return self.session is not None and (
            "SessionTimeout" in str(err) or time.monotonic() - self.started >= 0.95 * self.session_timeout_s)

    def _timed_out(self, doing: str) -> str:
        return (f"the session on {self.description['name']} ran past --session-timeout {self.session_timeout_s:g} s "
                f"while {doing}; raise --session-timeout or bench less (--repeat, --gen-len, --sustained)")

    def _explain(self, err: Exception, doing: str) -> str:
        where = self.description["name"]
        first = last_line(err)
        remote = self.session is not None
        expired = self._expired(err)
        # A server killed mid-transfer can also surface as the client's protocol check on the reply it expected
        # (`HandleUntilReturnEvent(...) == RPCCode::kCopyAck` failed): the stream broke, not the device's code.
        lost = remote and ("kShutdown" in first or "Socket" in first or "connection" in first.lower()
                           or "RPCCode::" in first)
        if expired:
            return self._timed_out(doing)
        if lost:
            return (f"lost the connection to {where} while {doing} ({first}); check that the device's RPC server "
                    f"is still running, then rerun")
        return f"{where} failed while {doing}: {first}"


def _recv_some(sock: socket.socket, n: int) -> bytes:
    """Up to n bytes, fewer only when the peer closes."""
    data = b""
    while len(data) < n:
        block = sock.recv(n - len(data))
        if not block:
            break
        data += block
    return data


# How to start a server for `--rpc HOST:PORT`: TVM's own refuses a --port above its default --port-end (9199).
_SERVER_HINT = ("mobilec device-server --port {port} --port-end {port_end}, or python -m tvm.exec.rpc_server "
                "--host 0.0.0.0 --port {port} --port-end {port_end}")


def check_rpc_server(host: str, port: int) -> None:
    """That a TVM RPC server listens at host:port, within CONNECT_TIMEOUT_S (rpc_peers): TVM's own connect waits
    forever on a socket that accepts and never answers (a busy server, or something else listening there)."""
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=rpc_peers.CONNECT_TIMEOUT_S)
    except OSError as err:
        raise MobilecError(f"cannot connect to the RPC server at {where} ({err.strerror or err}); start one there "
                           f"({_SERVER_HINT.format(port=port, port_end=port + 1)}) or fix --rpc") from None
    with sock:
        try:
            sock.sendall(struct.pack("<ii", rpc.base.RPC_MAGIC, len(_PROBE_KEY)) + _PROBE_KEY)
            reply = _recv_some(sock, 4)
        except TimeoutError:
            raise MobilecError(f"{where} accepts connections but did not answer TVM RPC's handshake within "
                               f"{rpc_peers.CONNECT_TIMEOUT_S:g} s: it is not a TVM RPC server, or one busy with "
                               f"another session; check --rpc (a tracker's address goes to --tracker)") from None
        except OSError:  # reset: a peer that drops unknown handshakes, as a TVM RPC proxy does; TVM's connect decides
            return
    if len(reply) == 4 and struct.unpack("<i", reply)[0] in _RPC_CODES:
        return
    if reply:
        raise MobilecError(f"{where} answers, but not as a TVM RPC server (it sent {reply!r}); check --rpc (a "
                           f"tracker's address goes to --tracker)")


def _request_from_tracker(host: str, port: int, key: str, timeout: int, wait_s: float) -> rpc.RPCSession:
    """A session on a device with `key` from the tracker at host:port; every step has a deadline."""
    where = f"{host}:{port}"
    tracker, keys = open_tracker(host, port)
    with contextlib.closing(tracker):
        check_key(host, port, key, keys)
        try:
            with deadline(wait_s, f"the tracker at {where} gave no {key!r} device within {wait_s:g} s (all busy, or "
                                  f"the device's RPC server does not answer); check the device, then rerun"):
                return tracker.request(key, session_timeout=timeout, max_retry=2)
        except RuntimeError as err:
            raise MobilecError(f"the tracker at {where} could not give a {key!r} device "
                               f"({last_line(err)}); check the device's RPC server, then rerun") from None


def local_device() -> Device:
    """This process, as a Device."""
    return Device(None, {"kind": "local", "name": "this process"}, math.inf)


def check_device_options(device: str | None, rpc_address: str | None, tracker_address: str | None,
                         key: str | None, session_timeout_s: float) -> None:
    """The options that pick the device (bench, profile): one of --device local, --rpc and --tracker (with
    --key), each address well formed."""
    if sum(x is not None for x in (device, rpc_address, tracker_address)) > 1:
        raise MobilecError("pass only one of --device local, --rpc HOST:PORT and --tracker HOST:PORT")
    if (tracker_address is None) != (key is None):
        raise MobilecError("--tracker and --key go together: pass the tracker's address and the device's key")
    validate.seconds(session_timeout_s, "--session-timeout")
    for address, option in ((rpc_address, "--rpc"), (tracker_address, "--tracker")):
        if address is not None:
            validate.address(address, option)
    if key is not None:
        validate.device_key(key)


def connect(rpc_address: str | None, tracker_address: str | None, key: str | None,
            session_timeout_s: float) -> Device:
    """This process when neither address is given; else a session on a direct RPC server or one from a tracker.
    Reaching the peer, its handshake and the session's start each have a deadline: a peer that is not a TVM RPC
    server (or tracker), or never answers, ends this with one line naming its address."""
    validate.seconds(session_timeout_s, "--session-timeout")
    if rpc_address is None and tracker_address is None:
        return local_device()
    timeout = math.ceil(session_timeout_s)  # whole seconds, as the server's session option takes them
    # Starting the session is bounded by --session-timeout too, never below the handshake's own deadline.
    wait_s = max(rpc_peers.CONNECT_TIMEOUT_S, min(rpc_peers.SESSION_START_TIMEOUT_S, session_timeout_s))
    if rpc_address is not None:
        host, port = validate.address(rpc_address, "--rpc")
        description = {"kind": "rpc", "name": f"the RPC server at {host}:{port}", "address": f"{host}:{port}"}
        check_rpc_server(host, port)
        try:
            with deadline(wait_s, f"the RPC server at {host}:{port} answered the handshake but started no session "
                                  f"within {wait_s:g} s; check that it is still serving, then rerun"):
                session = rpc.connect(host, port, session_timeout=timeout)
        except RuntimeError as err:
            raise MobilecError(f"cannot connect to the RPC server at {host}:{port} ({last_line(err)}); "
                               f"start one there ({_SERVER_HINT.format(port=port, port_end=port + 1)}) or fix "
                               f"--rpc") from None
    else:
        host, port = validate.address(tracker_address, "--tracker")
        validate.device_key(key)
        description = {"kind": "tracker", "name": f"the device with key {key!r} from the tracker at {host}:{port}",
                       "address": f"{host}:{port}", "key": key}
        session = _request_from_tracker(host, port, key, timeout, wait_s)
    return Device(session, description, session_timeout_s)


# Hexagon: built with --host-target, its NPU kernels on the emulated DSP (check_cpu refuses one built without)
RUNNABLE_KINDS = ("llvm", "opencl", "hexagon")


def artifact_arch(artifact: Artifact) -> str:
    """The CPU architecture the artifact's library is built for ('' when its target names no triple)."""
    tvm_target = artifact.config["target"]["tvm_target"]
    cpu_side = tvm_target if tvm_target["kind"] == "llvm" else tvm_target.get("host", {})
    return cpu_side.get("mtriple", "").split("-")[0]


def check_runs_on(artifact: Artifact, device: Device) -> dict[str, Any]:
    """Refuse an artifact the device cannot run (another kind of code, another architecture, a CPU feature it
    lacks), as far as that can be told without uploading it; returns what was checked (bench's "cpu_check")."""
    target = artifact.config["target"]
    if target["tvm_target"]["kind"] not in RUNNABLE_KINDS:
        raise MobilecError(f"{artifact.path} is built for {target['name']} ({target['tvm_target']['kind']}); "
                           f"mobilec runs CPU (llvm), OpenCL and Hexagon artifacts: compile one with --target host, "
                           f"linux-arm64/android-arm64, android-adreno/android-mali or hexagon-npu")
    done = check_cpu(artifact.path, artifact.config, device.cpu)
    required = done["required"]
    notes = []
    if not done["arch_checked"]:
        notes.append("the device's architecture was not checked before upload (it does not report its triple)")
    if not done["features_checked"]:
        notes.append("the device's CPU features were not checked (its TVM runtime has no LLVM to report them): "
                     "code needing a feature it lacks dies there with an illegal instruction")
    return {"arch_checked": done["arch_checked"], "features_checked": done["features_checked"],
            "required_arch": required["arch"] if required else None,
            "required_features": required["required_features"] if required else None,
            "note": "; ".join(notes) or None}


def tensor_cache_json(artifact: Artifact, data_path: dict[str, str]) -> str:
    """TVM's tensor-cache.json for the artifact's shards; data_path maps a shard file to its path on the device
    (relative to the JSON's directory)."""
    records = []
    for shard in artifact.index["shards"]:
        tensors = [t for t in artifact.index["tensors"] if t["shard"] == shard["file"]]
        records.append({
            "dataPath": data_path[shard["file"]],
            "format": "raw-shard",
            "nbytes": shard["nbytes"],
            "records": [{"name": t["name"], "shape": t["shape"], "dtype": t["dtype"], "format": "raw-shape-dtype",
                         "nbytes": t["nbytes"], "byteOffset": t["offset"]} for t in tensors],
        })
    return json.dumps({"metadata": {}, "records": records})


def slot_name(artifact: Artifact) -> str:
    """Where an artifact's files live on a device: its name plus a hash of where it is on this machine, so a
    rebuilt artifact replaces its own files and two artifacts of the same name do not collide."""
    where = hashlib.sha256(str(artifact.path.resolve()).encode()).hexdigest()[:12]
    return f"mobilec-{artifact.path.resolve().name}-{where}"


def _download_manifest(session: rpc.RPCSession, path: str) -> dict[str, str]:
    try:
        return json.loads(bytes(session.download(path)))["files"]
    except (RuntimeError, ValueError, KeyError):  # first visit (no file yet) or a manifest cut short
        return {}


def _stage_remote(session: rpc.RPCSession, artifact: Artifact, progress: bool) -> Staged:
    slot = f"../{slot_name(artifact)}"  # beside the session's work directory, which the server deletes
    manifest_path = f"{slot}.manifest.json"
    files = {Path(artifact.config["library"]).name: (artifact.library,
                                                     artifact.config["files"][artifact.config["library"]]["sha256"])}
    for shard in artifact.index["shards"]:
        files[shard["file"]] = (artifact.path / PARAMS_DIR / shard["file"], shard["sha256"])
    on_device = _download_manifest(session, manifest_path)
    stale = [name for name, (_, digest) in files.items() if on_device.get(name) != digest]
    if stale:
        # Forget the files about to be replaced first: an upload cut short must not pass for the old file later.
        kept = {name: digest for name, digest in on_device.items() if name in files and name not in stale}
        session.upload(bytearray(json.dumps({"files": kept}).encode()), manifest_path)
    upload_bytes = sum(files[name][0].stat().st_size for name in stale)
    with tqdm(total=upload_bytes, desc="upload", unit="B", unit_scale=True, file=sys.stderr,
              disable=not progress or not stale) as bar:
        for name in stale:
            session.upload(str(files[name][0]), f"{slot}.{name}")
            bar.update(files[name][0].stat().st_size)
    if stale:
        manifest = {name: digest for name, (_, digest) in files.items()}
        session.upload(bytearray(json.dumps({"files": manifest}).encode()), manifest_path)
    paths = {s["file"]: f"{slot}.{s['file']}" for s in artifact.index["shards"]}
    session.upload(bytearray(tensor_cache_json(artifact, paths).encode()), TENSOR_CACHE_JSON)
    library = f"{slot}.{Path(artifact.config['library']).name}"
    skipped = [name for name in files if name not in stale]
    return Staged(library, session.get_function("tvm.rpc.server.workpath")(""), stale, skipped, upload_bytes)
