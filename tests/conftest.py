"""Shared fixtures: the default model compiled once per test run (shared by the xdist workers), its float
reference, the emulated arm64 device; the `slow` marker put on every test that needs one of the expensive fixtures."""

import fcntl
import os
from pathlib import Path

# pytest-xdist runs one worker per core: one thread each, or TVM's and torch's thread pools (which spin while they
# wait) take turns on both cores against the other worker. Set before tvm or torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _variable in ("TVM_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(_variable, "1")

# Float32 GPU artifacts run on PoCL in these processes (the fastest OpenCL here); tests of float16 ones start
# processes that name Intel's runtime (tests/helpers/pocl_device.py).
os.environ.setdefault("MOBILEC_OPENCL_PLATFORM", "pocl")

import pytest  # noqa: E402  (after the thread counts)

from compiler.loaders.default_model import default_model_path  # noqa: E402

# Each compiles or runs the real SmolLM2 model, or starts the emulated arm64 device: a minute or more on 2 cores.
SLOW_FIXTURES = frozenset({"smollm2_reference", "smollm2_q0f32", "smollm2_gguf_exact", "emulated_arm_device"})


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf):
    """transformers' float32 SmolLM2, dequantized from the same GGUF (~30 s to load)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()


def _compiled_once(tmp_path_factory, name: str, quant: str, **options) -> Path:
    """SmolLM2 compiled once per test run, not once per xdist worker: the workers' temporary directories share a
    parent, where the first compiles under a lock and the other waits, then finds the artifact (compile_model
    renames it into place whole)."""
    from compiler.compile_model import CompileOptions, compile_model

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    shared = root / "compiled-once"
    shared.mkdir(exist_ok=True)
    out = shared / name
    with (shared / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            compile_model(CompileOptions(str(default_model_path()), "host", quant, str(out), context_window=512,
                                         progress=False, **options))
    return out


@pytest.fixture(scope="session")
def smollm2_q0f32(tmp_path_factory) -> Path:
    return _compiled_once(tmp_path_factory, "smollm2-q0f32", "q0f32")


@pytest.fixture(scope="session")
def smollm2_gguf_exact(tmp_path_factory) -> Path:
    # exact: the GGUF's blocks bit for bit, and a float32 KV cache (a float16 one moves logits by ~1e-2)
    return _compiled_once(tmp_path_factory, "smollm2-gguf", "gguf", kv_dtype="f32")


@pytest.fixture(scope="session")
def emulated_arm_device(pytestconfig):
    """An emulated arm64 device (compiler/testing/emulated_arm.py): a handle with tracker_host, tracker_port, key
    and request(); its server is a board's, with the aarch64 OpenCL device on the image's PoCL. The image is built on
    first use (about a minute) and cached; the device starts in ~30 s."""
    import os

    from compiler.testing.emulated_arm import build_image, prepare_host, start_device

    if os.geteuid() != 0:  # CI runs as root; anything else that stops the device must fail the tests
        pytest.skip("the emulated arm64 device needs root (debootstrap, chroot, binfmt_misc)")
    prepare_host()
    # Show the build's progress lines: minutes of silence look like a hang.
    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        image = build_image()
    with start_device(image=image, opencl=True) as device:
        yield device
