"""bench/hexagon_gemv_packets.py's counting, on a hand-written loop whose packets are known."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

from compiler.errors import MobilecError
from compiler.testing import emulated_hexagon

SCRIPT = emulated_hexagon.REPO_ROOT / "bench" / "hexagon_gemv_packets.py"
pytestmark = pytest.mark.skipif(emulated_hexagon.llvm_version() is None,
                                reason="scripts/fetch_qemu_hexagon.sh installs clang, lld and llvm")
# A copy loop first (no vrmpy: not the GEMV loop), then a 3-packet loop with 3 vrmpy: 12 blocks of 32 weights.
TINY = """
	.text
	.globl tiny
	.type tiny,@function
tiny:
	{ loop0(.Lcopy, r1) }
.Lcopy:
	{ v9 = vmem(r0++#1) }
	{ vmem(r4++#1) = v9 }:endloop0
	{ loop0(.Lbody, r1) }
.Lbody:
	{ v0.w += vrmpy(v1.ub, r2.b)
	  v3.w += vrmpy(v4.ub, r2.b)
	  v5 = vmem(r0++#1) }
	{ v6 = vand(v5, v7) }
	{ v8.w += vrmpy(v6.ub, r3.b)
	  nop }:endloop0
	{ jumpr r31 }
	.globl straight
	.type straight,@function
straight:
	{ v0.w += vrmpy(v1.ub, r2.b) }
	{ jumpr r31 }
"""


@pytest.fixture(scope="module")
def packets():
    spec = importlib.util.spec_from_file_location("hexagon_gemv_packets", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_counts_the_vrmpy_loop(packets, tmp_path):
    source = tmp_path / "tiny.S"
    source.write_text(TINY)
    subprocess.run([emulated_hexagon.llvm_tool("clang"), "--target=hexagon-unknown-linux-musl", f"-mcpu=hexagon{emulated_hexagon.CPU}", "-mhvx",
                    "-mhvx-length=128b", "-c", str(source), "-o", str(tmp_path / "tiny.o")], check=True)
    found = packets.functions(packets.disassemble(tmp_path / "tiny.o"))
    body = packets.inner_loop(found["tiny"])
    assert packets.packets_per_32_weights(body) == (3, 3, 3 / 12)
    with pytest.raises(MobilecError, match="no hardware loop"):
        packets.inner_loop(found["straight"])
