"""The native SHA-256 (native/runtime/sha256.cc) against hashlib: every engine this CPU can run (the portable one,
SHA-NI on x86-64, the ARMv8 SHA2 instructions on aarch64 under qemu), whole and in irregular Update chunks, on the
sizes around the padding boundaries and across the 4 MB read chunks; the accelerated engine refused, not run, on a
CPU without the instructions; and SHA-NI at least 3x faster than the portable code.

The C++ is built once per session into a test driver (tests/native/sha256_main.cc): for the host with the system
compiler, and for aarch64 with aarch64-linux-gnu-g++ (static) run under qemu-aarch64-static."""

from __future__ import annotations

import hashlib
import platform
import random
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "native" / "runtime"
COMPILER = shutil.which("g++") or shutil.which("c++")
CROSS_COMPILER = shutil.which("aarch64-linux-gnu-g++")
QEMU_AARCH64 = shutil.which("qemu-aarch64-static")
QEMU_X86_64 = shutil.which("qemu-x86_64-static")

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler (g++ or c++) to build the native runtime")
needs_aarch64 = pytest.mark.skipif(CROSS_COMPILER is None or QEMU_AARCH64 is None,
                                   reason="no aarch64-linux-gnu-g++ or qemu-aarch64-static")

# Plain -O2 and no -m/-march flag: the accelerated code must build through its target attributes alone.
FLAGS = ["-std=c++17", "-O2", "-Wall", "-Wextra"]
SOURCES = [str(REPO / "tests" / "native" / "sha256_main.cc"), str(RUNTIME / "sha256.cc"), "-I", str(RUNTIME)]

MB4 = 4 << 20
# Around one and two blocks' padding (55/56 bytes fit the length in the same block), the 4 MB reads of Sha256OfFile.
SIZES = [0, 1, 55, 56, 63, 64, 65, 119, 120, 127, 128, 1000, MB4 - 1, MB4 + 17]
BIG_SIZE = 13 * (1 << 20) + 7
MODES = [[], ["--chunks"], ["--chunks=2"]]


def _build(compiler: str, out: Path, extra: list[str] = ()) -> Path:
    command = [compiler, *FLAGS, *SOURCES, *extra, "-o", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"building the driver failed:\n{' '.join(command)}\n{result.stderr[-4000:]}"
    return out


@pytest.fixture(scope="session")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(COMPILER, tmp_path_factory.mktemp("sha256_driver") / "sha256_main")


@pytest.fixture(scope="session")
def arm_drivers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The aarch64 driver, and one that hides HWCAP_SHA2 (no qemu CPU model lacks it)."""
    out = tmp_path_factory.mktemp("sha256_arm_driver")
    plain = _build(CROSS_COMPILER, out / "sha256_main", ["-static"])
    hidden = _build(CROSS_COMPILER, out / "sha256_main_no_sha2",
                    ["-static", "-DSHA256_MAIN_HIDE_SHA2", "-Wl,--wrap=getauxval"])
    return plain, hidden


@pytest.fixture(scope="session")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, str]:
    """Random files of every size in SIZES and a 13 MB one, with hashlib's digests."""
    out = tmp_path_factory.mktemp("sha256_files")
    rng = random.Random(256)
    digests = {}
    for size in [*SIZES, BIG_SIZE]:
        path = out / f"random_{size}"
        content = rng.randbytes(size)
        path.write_bytes(content)
        digests[path] = hashlib.sha256(content).hexdigest()
    return digests


def big(files: dict[Path, str]) -> Path:
    return next(path for path in files if path.name == f"random_{BIG_SIZE}")


def run(command: list, *args) -> subprocess.CompletedProcess:
    return subprocess.run([*map(str, command), *map(str, args)], capture_output=True, text=True, check=False,
                          timeout=120)


def check_digests(command: list, engine: str, mode: list[str], files: dict[Path, str]) -> None:
    result = run(command, *mode, engine, *files)
    assert result.returncode == 0, result.stderr
    got = result.stdout.split()
    assert len(got) == len(files)
    for (path, want), have in zip(files.items(), got):
        assert have == want, f"{engine} {' '.join(mode)}: {path.name} ({path.stat().st_size} bytes)"


def host_has_sha_ni() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return False
    return {"sha_ni", "ssse3", "sse4_1"} <= set(flags.split())


def engine_name(command: list) -> str:
    result = run(command, "--engine")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_host_engine_name(driver: Path):
    name = engine_name([driver])
    if platform.machine() in ("x86_64", "AMD64") and Path("/proc/cpuinfo").exists():
        assert name == ("sha-ni" if host_has_sha_ni() else "portable")
    else:
        assert name in ("armv8-sha2", "portable")


@pytest.mark.parametrize("mode", MODES, ids=["whole", "chunks", "chunks_seed2"])
@pytest.mark.parametrize("engine", ["portable", "auto", "accelerated"])
def test_host_digests(driver: Path, files: dict[Path, str], engine: str, mode: list[str]):
    if engine == "accelerated" and engine_name([driver]) == "portable":
        result = run([driver], engine, *files)
        assert result.returncode == 3 and "accelerated SHA-256 engine needs" in result.stderr
        return
    check_digests([driver], engine, mode, files)


def test_host_one_bit_flipped(driver: Path, files: dict[Path, str], tmp_path: Path):
    """A negative control: the comparison can fail."""
    content = bytearray(big(files).read_bytes())
    content[len(content) // 3] ^= 0x10
    flipped = tmp_path / "flipped"
    flipped.write_bytes(bytes(content))
    engines = ["portable"] + (["accelerated"] if engine_name([driver]) != "portable" else [])
    for engine in engines:
        for mode in MODES[:2]:
            result = run([driver], *mode, engine, flipped, big(files))
            assert result.returncode == 0, result.stderr
            have_flipped, have_original = result.stdout.split()
            assert have_original == files[big(files)]
            assert have_flipped == hashlib.sha256(content).hexdigest() != have_original


def test_host_unreadable_file(driver: Path, tmp_path: Path):
    missing = tmp_path / "missing"
    result = run([driver], "auto", missing)
    assert result.returncode == 1
    assert result.stderr.strip() == f"cannot read {missing}: No such file or directory"
    result = run([driver], "auto", tmp_path)  # a directory opens, then fails to read
    assert result.returncode == 1 and result.stderr.startswith(f"cannot read {tmp_path}: ")


def test_sha_ni_faster_than_portable(driver: Path, files: dict[Path, str]):
    if not host_has_sha_ni():
        pytest.skip("this CPU has no SHA-NI")
    seconds = {}
    for engine in ("portable", "accelerated"):
        result = run([driver], "--time", engine, big(files))
        assert result.returncode == 0, result.stderr
        digest, took = result.stdout.split()
        assert digest == files[big(files)]
        seconds[engine] = float(took)
    mb_per_s = {engine: BIG_SIZE / 1e6 / took for engine, took in seconds.items()}
    assert seconds["portable"] >= 3 * seconds["accelerated"], f"MB/s: {mb_per_s}"


@pytest.mark.skipif(QEMU_X86_64 is None, reason="no qemu-x86_64-static")
def test_host_build_refuses_sha_ni_on_cpu_without_it(driver: Path, files: dict[Path, str]):
    """qemu's qemu64 CPU model has neither SHA-NI nor SSSE3: auto is portable and accelerated is refused."""
    if platform.machine() != "x86_64":
        pytest.skip("the driver is not an x86-64 program")
    qemu = [QEMU_X86_64, "-cpu", "qemu64", driver]
    assert engine_name(qemu) == "portable"
    result = run(qemu, "accelerated", *files)
    assert result.returncode == 3
    assert result.stderr.strip() == (
        "the accelerated SHA-256 engine needs SHA-NI, SSE4.1 and SSSE3, which this CPU does not have")
    assert result.stdout == ""
    small = {path: digest for path, digest in files.items() if path.stat().st_size <= MB4 + 17}
    check_digests(qemu, "auto", [], small)


def qemu_arm(cpu: str, driver: Path) -> list:
    return [QEMU_AARCH64, "-L", "/usr/aarch64-linux-gnu", "-cpu", cpu, driver]


@needs_aarch64
@pytest.mark.parametrize("mode", MODES[:2], ids=["whole", "chunks"])
@pytest.mark.parametrize("engine", ["portable", "auto", "accelerated"])
def test_aarch64_digests(arm_drivers: tuple[Path, Path], files: dict[Path, str], engine: str, mode: list[str]):
    qemu = qemu_arm("max", arm_drivers[0])
    assert engine_name(qemu) == "armv8-sha2"
    check_digests(qemu, engine, mode, files)


@needs_aarch64
def test_aarch64_cortex_a53(arm_drivers: tuple[Path, Path], files: dict[Path, str]):
    qemu = qemu_arm("cortex-a53", arm_drivers[0])
    assert engine_name(qemu) == "armv8-sha2"
    check_digests(qemu, "accelerated", ["--chunks=3"], files)


@needs_aarch64
def test_aarch64_without_sha2(arm_drivers: tuple[Path, Path], files: dict[Path, str]):
    qemu = qemu_arm("max", arm_drivers[1])
    assert engine_name(qemu) == "portable"
    result = run(qemu, "accelerated", *files)
    assert result.returncode == 3
    assert result.stderr.strip() == (
        "the accelerated SHA-256 engine needs the ARMv8 SHA2 instructions, which this CPU does not have")
    assert result.stdout == ""
    check_digests(qemu, "auto", ["--chunks"], files)
