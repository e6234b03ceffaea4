"""Every common model shape compiles for the phone GPU, NPU and ARM target files (tests/helpers/real_shapes.py;
the x86 files in test_real_shapes_x86.py, apart so that both test workers share them): in the default set each shape
for one target file, all seven taking turns; every pair in the extended set."""

import pytest

from tests.helpers.real_shapes import SHAPES, check_compiles, matrix, target_files

GPUS = ["android-adreno", "android-mali"]
CPUS_AND_NPU = ["linux-arm64", "android-arm64", "hexagon-npu"]


@pytest.mark.parametrize(("shape", "target"), matrix(sorted(GPUS + CPUS_AND_NPU)))
def test_compiles(shape, target, tmp_path):
    check_compiles(shape, target, tmp_path)


def test_the_matrix_holds_every_target_file_that_is_not_x86():
    assert sorted(GPUS + CPUS_AND_NPU) == sorted(target_files(x86=False))


def test_the_4096_wide_shapes_compile_for_both_gpus_in_the_default_set():
    """The shapes no GPU build took before (hidden size 4096: Llama-2-7B, Llama-3-8B, Mistral-7B, Qwen3-8B)."""
    default = {p.values for p in matrix(GPUS) if not p.marks}
    wide = {shape for shape, _ in default if SHAPES[shape][1]["hidden_size"] == 4096}
    assert {target for shape, target in default if shape in wide} == set(GPUS)
