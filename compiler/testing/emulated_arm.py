"""An emulated arm64 Linux board for tests: a board's device server in a Debian arm64 chroot under qemu-user.

`build_image()` makes, once, a Debian bookworm arm64 root filesystem with a Python venv at /opt/tvm holding the
aarch64 wheels of the versions pinned in pyproject.toml, as a directory in emulated-arm64/ in mobilec's cache
(compiler/user_cache.py), named by a hash of the pins and the recipe. Nothing is emulated while building but the
final check: debootstrap's first stage downloads the packages, they are unpacked as they are (no maintainer
scripts: Python needs none), and the host's pip installs the aarch64 wheels into the venv's site-packages
(--platform --target): about a minute, where debootstrap's second stage and pip under qemu took 16.
`start_device()` mounts the image read-only at a temporary directory (with its own /proc and scratch /tmp),
starts an RPC tracker on loopback (host Python) and, inside that chroot (qemu-aarch64 through binfmt_misc), the
device server a board runs (compiler/device_server.py; with opencl=True, the aarch64 OpenCL device too, on the
image's PoCL, whose compiled kernels are kept beside the image), and returns a handle once the tracker offers
the server.
Clients then use `tvm.rpc.connect_tracker(device.tracker_host, device.tracker_port).request(device.key)`.

Needs root and `apt-get install qemu-user-static binfmt-support debootstrap`. qemu's default CPU advertises
dotprod, i8mm, sve and sve2, so code a real phone would reject still runs here; timings mean nothing,
correctness does.

CLI: `python -m compiler.testing.emulated_arm build` and `python -m compiler.testing.emulated_arm serve`.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

from .. import device_server
from ..board_folder import write_board_folder
from ..errors import MobilecError
from ..torch_hidden import worker_environ
from ..user_cache import cache_path
from . import processes
from .local_rpc import free_port

# Bump when the image recipe changes, so cached images are rebuilt.
RECIPE_VERSION = 3
DEBIAN_SUITE = "bookworm"
# PoCL, an OpenCL platform on the CPU, and the ICD loader, for the OpenCL device of a board (mobilec device-server).
DEBIAN_PACKAGES = ("python3", "pocl-opencl-icd", "ocl-icd-libopencl1")
# bookworm's Python; the wheels are downloaded for it.
REMOTE_PYTHON_VERSION = "3.11"
# Packages pinned in pyproject.toml that the device needs: the runtime and the RPC server's dependencies.
PINNED_PACKAGES = ("apache-tvm", "apache-tvm-ffi", "numpy", "tornado", "cloudpickle", "psutil")
# Unpinned dependencies that `import tvm` needs; the device gets the versions installed on this host.
IMPORT_DEPENDENCIES = ("ml_dtypes", "typing_extensions")
WHEEL_PLATFORMS = ("manylinux_2_28_aarch64", "manylinux2014_aarch64")
REMOTE_VENV = "/opt/tvm"
REMOTE_PYTHON = f"{REMOTE_VENV}/bin/python"
REMOTE_SITE_PACKAGES = f"{REMOTE_VENV}/lib/python{REMOTE_PYTHON_VERSION}/site-packages"
# Carries random_fill_for_measure, which MetaSchedule's RPC runner calls.
REMOTE_EXTRA_LIBRARY = f"{REMOTE_SITE_PACKAGES}/tvm/lib/libtvm_runtime_extra.so"
# PoCL keeps the kernels it compiles in $HOME/.cache, read-only here; this folder outlives the device instead.
REMOTE_POCL_CACHE = "/tmp/pocl-cache"
# PoCL compiles each kernel with LLVM under qemu, on first use: unoptimized, a tiny Llama's kernels build in 40% of
# the time (x86 PoCL: 15.8 -> 6.3 s to the first token), the same operations in the same order (no fast-math).
POCL_BUILD_OPTIONS = ("MOBILEC_OPENCL_BUILD_OPTIONS=-cl-opt-disable",)
# A clean environment for commands in the chroot: host PIP_* and PYTHON* variables must not leak in.
CHROOT_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8")
# Dropped from the image: not needed to run.
IMAGE_PRUNE = ("var/cache/apt", "var/lib/apt/lists", "usr/share/doc", "usr/share/man", "usr/share/locale",
               "usr/share/info", "root/.cache")
INSTALL_HINT = "apt-get install qemu-user-static binfmt-support debootstrap"
BINFMT_DIR = Path("/proc/sys/fs/binfmt_misc")
DEFAULT_KEY = "emulated-arm64"
REPO_ROOT = Path(__file__).resolve().parents[2]


def cache_dir() -> Path:
    """Where images are kept: emulated-arm64/ in mobilec's cache (user_cache.py)."""
    return cache_path("emulated-arm64")


def _pinned_versions(pyproject: Path = REPO_ROOT / "pyproject.toml") -> dict[str, str]:
    """`name==version` pins for PINNED_PACKAGES from pyproject.toml, plus this host's IMPORT_DEPENDENCIES."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    pins = {}
    for spec in dependencies:
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;]+)\s*", spec)
        if match:
            pins[match.group(1).lower()] = match.group(2)
    missing = [name for name in PINNED_PACKAGES if name not in pins]
    if missing:
        raise MobilecError(f"{pyproject} pins no exact version (==) for {', '.join(missing)}; pin them there")
    versions = {name: pins[name] for name in PINNED_PACKAGES}
    for name in IMPORT_DEPENDENCIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError as err:
            raise MobilecError(f"{name} is not installed on this host; run scripts/setup.sh") from err
    return versions


def image_path(cache: Path | None = None) -> Path:
    """The root filesystem for the current pins and recipe (it may not exist yet)."""
    recipe = {"recipe": RECIPE_VERSION, "suite": DEBIAN_SUITE, "packages": DEBIAN_PACKAGES,
              "python": REMOTE_PYTHON_VERSION, "wheels": _pinned_versions()}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    return (cache or cache_dir()) / f"{DEBIAN_SUITE}-arm64-{digest}"


def _require_root() -> None:
    if os.geteuid() != 0:
        raise MobilecError("the emulated arm64 device needs root (chroot, mount); run as root or with sudo")


def _require_tools(*tools: str) -> None:
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise MobilecError(f"{', '.join(missing)} not found; install them with `{INSTALL_HINT}`")


def enable_binfmt() -> None:
    """Make the kernel run aarch64 binaries through qemu (binfmt_misc mounted, qemu-aarch64 enabled)."""
    _require_root()
    _require_tools("qemu-aarch64-static", "update-binfmts")
    if not (BINFMT_DIR / "status").exists():
        mounted = subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT_DIR)],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            raise MobilecError(f"cannot mount binfmt_misc ({mounted.stderr.strip()}); run in a privileged "
                               f"container or mount it on the host: mount -t binfmt_misc binfmt_misc {BINFMT_DIR}")
    entry = BINFMT_DIR / "qemu-aarch64"
    if not entry.exists() or not entry.read_text().startswith("enabled"):
        enabled = subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True, text=True)
        if enabled.returncode != 0 or not entry.exists():
            raise MobilecError(f"cannot enable qemu-aarch64 in binfmt_misc ({enabled.stderr.strip()}); "
                               f"reinstall it with `{INSTALL_HINT}`")
    # Without the F flag the kernel would look for the interpreter inside the chroot, where there is none.
    flags = re.search(r"^flags: *(\S*)", entry.read_text(), re.M)
    if not flags or "F" not in flags.group(1):
        raise MobilecError(f"binfmt entry {entry} lacks the F (fix binary) flag; re-register it with "
                           f"`update-binfmts --disable qemu-aarch64 && update-binfmts --enable qemu-aarch64` "
                           f"from Debian's qemu-user-static")


def prepare_host() -> None:
    """Enable qemu-aarch64 in binfmt_misc; raise MobilecError if this host cannot run the emulated device."""
    _require_root()
    _require_tools("debootstrap")
    enable_binfmt()


def debian_mirror() -> str:
    """A Debian mirror that apt on this host uses for bookworm (MOBILEC_DEBIAN_MIRROR overrides)."""
    if os.environ.get("MOBILEC_DEBIAN_MIRROR"):
        return os.environ["MOBILEC_DEBIAN_MIRROR"]
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        if not path.is_file():
            continue
        if path.suffix == ".sources":
            entries = [dict(re.findall(r"^([\w-]+):[ \t]*(.*)$", stanza, re.M))
                       for stanza in re.split(r"\n\s*\n", path.read_text())]
        elif path.name == "sources.list" or path.suffix == ".list":
            entries = []
            for line in path.read_text().splitlines():
                words = re.sub(r"\[[^]]*\]", "", line.split("#")[0]).split()
                if len(words) >= 4 and words[0] == "deb":
                    entries.append({"Types": "deb", "URIs": words[1], "Suites": words[2],
                                    "Components": " ".join(words[3:])})
        else:
            continue
        for entry in entries:
            if ("deb" in entry.get("Types", "").split() and DEBIAN_SUITE in entry.get("Suites", "").split()
                    and "main" in entry.get("Components", "").split()
                    and entry.get("Enabled", "yes").lower() != "no"
                    and "arm64" in entry.get("Architectures", "arm64").split()):
                return entry["URIs"].split()[0]
    raise MobilecError(f"no Debian {DEBIAN_SUITE} main mirror in /etc/apt/sources.list*; "
                       f"set MOBILEC_DEBIAN_MIRROR=http://deb.debian.org/debian")


def _mounts_under(root: Path) -> list[Path]:
    """Mount points at or under `root`, deepest first."""
    root = root.resolve()
    points = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = Path(line.split()[1].replace("\\040", " "))
        if point == root or root in point.parents:
            points.append(point)
    return sorted(points, key=lambda p: len(p.parts), reverse=True)


def _unmount_under(root: Path) -> None:
    """Unmount everything at or under `root` (lazily if busy); raise if something stays mounted."""
    for point in _mounts_under(root):
        if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(point)], capture_output=True)
    left = _mounts_under(root)
    if left:
        raise MobilecError(f"{left[0]} is still mounted; unmount it (umount --lazy {left[0]}) and delete {root}")


def _remove_tree(root: Path) -> None:
    """Delete `root`, unmounting first: deleting through a mount would delete the mounted files."""
    _unmount_under(root)
    shutil.rmtree(root, ignore_errors=True)


def _mount(*args: str) -> None:
    mounted = subprocess.run(["mount", *args], capture_output=True, text=True)
    if mounted.returncode != 0:
        raise MobilecError(f"mount {' '.join(args)} failed ({mounted.stderr.strip()}); the emulated device needs "
                           f"root in a privileged container")


def _mount_proc(root: Path) -> None:
    _mount("-t", "proc", "proc", str(root / "proc"))


def _chroot_command(root: Path, *command: str, env: tuple[str, ...] = ()) -> list[str]:
    return ["chroot", str(root), "/usr/bin/env", "-i", *CHROOT_ENV, *env, *command]


class _Progress:
    """Stage lines on stderr: `emulated-arm64: <stage> ... done in N s (M s total)`."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        print(f"emulated-arm64: {name} ...", file=sys.stderr, flush=True)
        yield
        now = time.monotonic()
        print(f"emulated-arm64: {name} done in {now - began:.0f} s ({now - self.start:.0f} s total)",
              file=sys.stderr, flush=True)


def _run_logged(command: list[str], log: Path, what: str) -> None:
    """Run a build step with its output appended to `log`; on failure name the step, the log and its last line."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise MobilecError(f"{what} failed (exit {result.returncode}): {lines[-1] if lines else ''}; "
                           f"full log in {log}")


@contextlib.contextmanager
def _image_lock(image: Path) -> Iterator[None]:
    """One builder of an image at a time; a second caller waits, then finds the result."""
    image.parent.mkdir(parents=True, exist_ok=True)
    with (image.parent / f"{image.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build_image(cache: Path | None = None) -> Path:
    """Build the image if it is not cached (about a minute); return its directory."""
    image = image_path(cache)
    if image.exists():
        return image
    prepare_host()
    with _image_lock(image):
        if not image.exists():
            _build_image_locked(image)
    return image


def _build_image_locked(image: Path) -> None:
    progress = _Progress()
    # Under the image's lock no other build of it runs: a directory of its builds is what a killed one left.
    for stale in image.parent.glob(f"build-{image.name}-*"):
        if stale.is_dir() and not stale.is_symlink():
            _remove_tree(stale)
    log = image.parent / "build.log"
    log.write_text("")
    work = Path(tempfile.mkdtemp(prefix=f"build-{image.name}-", dir=image.parent))
    root = work / "rootfs"
    versions = _pinned_versions()
    requirements = [f"{name}=={version}" for name, version in versions.items()]
    try:
        mirror = debian_mirror()
        with progress.stage(f"download and unpack Debian {DEBIAN_SUITE} arm64 from {mirror}"):
            _run_logged(["debootstrap", "--foreign", "--arch=arm64", "--variant=minbase",
                         f"--include={','.join(DEBIAN_PACKAGES)}", DEBIAN_SUITE, str(root), mirror],
                        log, "debootstrap")
            # The first stage unpacked only the essential packages; the rest waits for the second stage (dpkg
            # under qemu), which would also run their maintainer scripts. Unpacking is all Python needs.
            _run_logged(["sh", "-c", 'for deb in "$1"/var/cache/apt/archives/*.deb; do dpkg-deb --fsys-tarfile '
                         '"$deb" | tar -x -C "$1" --keep-directory-symlink || exit 1; done', "unpack", str(root)],
                        log, "unpacking the packages")
            shutil.rmtree(root / "debootstrap")
            for name in ("passwd", "group"):  # what base-passwd's maintainer script would have written
                shutil.copyfile(root / "usr/share/base-passwd" / f"{name}.master", root / "etc" / name)
        with progress.stage(f"install aarch64 wheels into {REMOTE_VENV}"):
            _make_venv(root / REMOTE_VENV.lstrip("/"))
            _run_logged([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--quiet",
                         "--no-compile", "--target", str(root / REMOTE_SITE_PACKAGES.lstrip("/")),
                         "--only-binary=:all:", "--implementation", "cp", "--python-version", REMOTE_PYTHON_VERSION,
                         *(f"--platform={platform}" for platform in WHEEL_PLATFORMS), *requirements],
                        log, "pip install of the aarch64 wheels")
        _mount_proc(root)
        with progress.stage("check that tvm imports on the device"):
            _run_logged(_chroot_command(root, REMOTE_PYTHON, "-c",
                                        f"import ctypes, tvm, tvm.rpc; ctypes.CDLL('{REMOTE_EXTRA_LIBRARY}'); "
                                        "print('tvm', tvm.__version__)",
                                        env=("TVM_USE_RUNTIME_LIB=1",)),
                        log, "importing tvm in the chroot")
        _unmount_under(root)
        for path in IMAGE_PRUNE:
            shutil.rmtree(root / path, ignore_errors=True)
        root.rename(image)  # complete, or not there at all
        print(f"emulated-arm64: image {image} ({time.monotonic() - progress.start:.0f} s)", file=sys.stderr)
    finally:
        _remove_tree(work)


def _make_venv(venv: Path) -> None:
    """What `python3 -m venv --without-pip` makes, written from here: the device's Python finds pyvenv.cfg beside
    its bin/ and takes lib/pythonX.Y/site-packages."""
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(f"/usr/bin/python{REMOTE_PYTHON_VERSION}")
    (venv / "pyvenv.cfg").write_text(f"home = /usr/bin\ninclude-system-site-packages = false\n"
                                     f"version = {REMOTE_PYTHON_VERSION}\n")
    (venv / REMOTE_SITE_PACKAGES.removeprefix(f"{REMOTE_VENV}/")).mkdir(parents=True)


def _spawn(command: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a device process with its output in `log`, leading its own process group, so that stop() kills
    every child (forked sessions, qemu), a Ctrl-C meant for the caller reaches none, and all of them end when the
    caller does, even by SIGKILL (processes.py)."""
    return processes.spawn(command, log, env)


_kill_group = processes.kill_group


@dataclasses.dataclass
class EmulatedArmDevice:
    """A running emulated device: an RPC tracker at tracker_host:tracker_port serving `key`."""

    tracker_host: str
    tracker_port: int
    key: str
    root: Path
    server_log: Path
    processes: list[subprocess.Popen] = dataclasses.field(default_factory=list)

    def request(self, session_timeout: float = 0):
        """A new RPC session on the device, through the tracker."""
        import tvm.rpc  # pylint: disable=import-outside-toplevel

        return tvm.rpc.connect_tracker(self.tracker_host, self.tracker_port).request(
            self.key, session_timeout=session_timeout)

    @property
    def scratch(self) -> Path:
        """The device's /tmp, seen from the host: files put there are the device's /tmp/NAME."""
        return self.root.parent / "tmp"

    def run(self, *command: str, timeout: float = 600.0) -> subprocess.CompletedProcess:
        """A program run on the device (in its root, under qemu) with the chroot's clean environment (CHROOT_ENV:
        PATH, HOME, LANG, nothing of this host's); its output captured."""
        return subprocess.run(_chroot_command(self.root, *command), capture_output=True, text=True, timeout=timeout)

    def stop(self) -> None:
        """Kill the server and the tracker, unmount and delete the root filesystem; safe to call twice."""
        for process in reversed(self.processes):
            _kill_group(process)
        self.processes.clear()
        if self.root.parent.exists():
            _remove_tree(self.root.parent)
        atexit.unregister(self.stop)

    def __enter__(self) -> EmulatedArmDevice:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def _check_running(process: subprocess.Popen, log: Path) -> None:
    """Raise, with the end of its log, if a device process has exited."""
    if process.poll() is not None:
        raise MobilecError(f"the emulated device's {log.stem} exited (code {process.returncode}); "
                           f"its log ends:\n{_tail(log)}")


def _server_available(host: str, port: int, key: str) -> bool:
    """Whether the tracker holds a free server for `key` (one a request would get now)."""
    import tvm.rpc  # pylint: disable=import-outside-toplevel

    tracker = tvm.rpc.connect_tracker(host, port)
    try:
        return tracker.summary()["queue_info"].get(key, {}).get("free", 0) > 0
    finally:
        tracker.close()


def start_device(key: str = DEFAULT_KEY, tracker_port: int | None = None, image: Path | None = None,
                 timeout_s: float = 120.0, opencl: bool = False) -> EmulatedArmDevice:
    """Start the emulated device from the cached image (build it first with build_image); return its handle.
    With `opencl`, its server loads the aarch64 OpenCL device, whose kernels run on the image's PoCL."""
    prepare_host()
    image = image or image_path()
    if not image.is_dir():
        raise MobilecError(f"no emulated arm64 image at {image}; build it with "
                           f"`python -m compiler.testing.emulated_arm build`")
    work = Path(tempfile.mkdtemp(prefix="mobilec-emulated-arm64-"))
    root = work / "rootfs"
    root.mkdir()
    host = "127.0.0.1"
    device = EmulatedArmDevice(host, tracker_port or free_port(), key, root, work / "server.log")
    atexit.register(device.stop)
    try:
        # The shared image, read-only, with this device's own /proc and scratch space: devices never
        # see each other's files and the image stays intact. The RPC server keeps uploads (model weights) in
        # /tmp, so that is a directory on disk, not memory.
        _mount("--bind", str(image), str(root))
        # Private: on a host whose / is shared, mounts below would otherwise appear in the cached image too.
        _mount("--make-private", str(root))
        _mount("-o", "remount,bind,ro", str(root))
        _mount_proc(root)
        # PoCL learns the CPU's cores and memory from sysfs (hwloc); without it, it aborts.
        _mount("--bind", "/sys", str(root / "sys"))
        _mount("-o", "remount,bind,ro", str(root / "sys"))
        scratch = work / "tmp"
        scratch.mkdir()
        scratch.chmod(0o1777)
        _mount("--bind", str(scratch), str(root / "tmp"))
        # PoCL's compiled kernels outlive the device, kept beside the image: PoCL compiles each kernel with LLVM
        # under qemu (a tiny Llama's first bench: ~110 s of 117; 10 s with the cache).
        pocl_cache = image.parent / f"{image.name}-pocl-cache"
        pocl_cache.mkdir(exist_ok=True)
        (scratch / Path(REMOTE_POCL_CACHE).relative_to("/tmp")).mkdir()
        _mount("--bind", str(pocl_cache), str(root / REMOTE_POCL_CACHE.lstrip("/")))
        _mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", str(root / "dev" / "shm"))
        # The device serves itself as a board would: the folder `mobilec board-folder` writes, in its /tmp.
        if opencl:
            write_board_folder(scratch / "board", "aarch64")
        else:
            (scratch / "board").mkdir()
            shutil.copyfile(device_server.__file__, scratch / "board" / Path(device_server.__file__).name)
        tracker_log = work / "tracker.log"
        # The tracker needs only TVM's runtime library, which loads seconds faster than the compiler.
        tracker = _spawn([sys.executable, "-m", "tvm.exec.rpc_tracker", "--host", host,
                          "--port", str(device.tracker_port), "--port-end", str(device.tracker_port + 1)],
                         tracker_log, env=worker_environ({**os.environ, "TVM_USE_RUNTIME_LIB": "1"}))
        device.processes.append(tracker)
        deadline = time.monotonic() + timeout_s
        # Started together, not one after the other: each takes ~6 s to come up (the tracker imports tvm in two
        # processes, the server under qemu), so the server usually finds no tracker yet and retries 5 s later,
        # which is still sooner than waiting for the tracker before starting the server.
        server_port = free_port()
        server = _spawn(_chroot_command(root, REMOTE_PYTHON, f"/tmp/board/{Path(device_server.__file__).name}",
                                        "--host", host, "--port", str(server_port), "--port-end", str(server_port + 1),
                                        "--tracker", f"{host}:{device.tracker_port}", "--key", key,
                                        *(() if opencl else ("--no-opencl",)),
                                        env=(f"POCL_CACHE_DIR={REMOTE_POCL_CACHE}", *POCL_BUILD_OPTIONS)),
                        device.server_log)
        device.processes.append(server)
        # connect_tracker retries a refused connection for a minute: ask the tracker only once it listens.
        while not (_listening(host, device.tracker_port) and _server_available(host, device.tracker_port, key)):
            _check_running(tracker, tracker_log)
            _check_running(server, device.server_log)
            if time.monotonic() > deadline:
                raise MobilecError(f"the emulated device did not offer key {key!r} in its tracker within "
                                   f"{timeout_s:.0f} s; the server's log ends:\n{_tail(device.server_log)}")
            time.sleep(0.5)
    except BaseException:
        device.stop()
        raise
    return device


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m compiler.testing.emulated_arm",
                                     description="An emulated arm64 device (TVM RPC server under qemu-user).")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="build the cached image if needed (about a minute the first time)")
    serve = commands.add_parser("serve", help="build if needed, start the device and serve until Ctrl-C")
    serve.add_argument("--key", default=DEFAULT_KEY, help=f"the device key in the tracker (default {DEFAULT_KEY})")
    serve.add_argument("--tracker-port", type=int, default=None, help="the tracker's port (default: a free one)")
    serve.add_argument("--opencl", action="store_true", help="load the aarch64 OpenCL device (kernels on PoCL)")
    args = parser.parse_args(argv)
    try:
        image = build_image()
        if args.command == "build":
            print(image)
            return 0
        began = time.monotonic()
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the device on `kill` too
        with start_device(args.key, args.tracker_port, image, opencl=args.opencl) as device:
            print(f"tracker {device.tracker_host}:{device.tracker_port} key {device.key} "
                  f"(ready in {time.monotonic() - began:.0f} s; Ctrl-C stops)", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    except MobilecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
