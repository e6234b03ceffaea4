"""Shared fixtures: the default model compiled once per test run (tests/helpers/compiled_once.py), its float
reference, the emulated arm64 device; the `slow` marker put on every test that needs one of the expensive fixtures."""

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
from tests.helpers.compiled_once import compiled_once  # noqa: E402

# Each compiles or runs the real SmolLM2 model, or starts the emulated arm64 device: a minute or more on 2 cores.
SLOW_FIXTURES = frozenset({"smollm2_reference", "smollm2_q0f32", "smollm2_gguf_exact", "emulated_arm_device"})


# The files that take longest (worker-seconds in a full run on 2 cores, 2026-12-07: 338, 297, 222, 210, 183, 159,
# 143, 133, 131, 130, 128, 125, ...), sent to the workers first so that the run does not end on one of them
# while the other worker idles. A stale entry costs only time.
LONGEST_FILES = (  # worker-seconds in a whole run (`--durations`), longest first
    "runtime/test_smollm2_float16_gpu_artifacts.py", "targets/test_oclgrind.py", "test_random_llama_gguf.py",
    "targets/test_real_shapes_gpu_npu_arm.py", "test_notebooks.py", "test_estimate.py", "targets/test_pocl_kernels.py",
    "kernels/test_integer_dot_gemv.py", "test_architectures_gemma.py", "test_kv_cache_dtype.py",
    "targets/test_float16_kernels.py", "targets/test_real_shapes_x86.py", "runtime/test_gpu_over_rpc.py",
    "kernels/test_cpu_attention.py", "quantization/test_quantized_models.py", "test_mobile_artifacts.py",
    "test_docs.py", "test_quantized_cache_windows.py", "test_architectures_mistral_phi3.py", "test_tune.py",
    "test_compile_memory.py", "passes/test_chain_kernels.py",
)
TESTS_DIR = Path(__file__).parent


def pytest_collection_modifyitems(items):
    """Marks `slow` the tests that need a slow fixture, then puts LONGEST_FILES first, longest first (a stable sort:
    each file's tests stay together and in order, the other files in collection order). The workers take whole
    files in this order (--dist loadfile --no-loadscope-reorder; xdist's default sends the files with the most tests
    first, which put the few-test, minutes-long ones last)."""
    for item in items:
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    rank = {TESTS_DIR / name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))


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


@pytest.fixture(scope="session")
def smollm2_q0f32(tmp_path_factory) -> Path:
    return compiled_once(tmp_path_factory, default_model_path(), "host", "q0f32", context_window=512)


@pytest.fixture(scope="session")
def smollm2_gguf_exact(tmp_path_factory) -> Path:
    # exact: the GGUF's blocks bit for bit, and a float32 KV cache (a float16 one moves logits by ~1e-2)
    return compiled_once(tmp_path_factory, default_model_path(), "host", "gguf", context_window=512, kv_dtype="f32")


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
