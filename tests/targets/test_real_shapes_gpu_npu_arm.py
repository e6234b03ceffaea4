"""Every common model shape compiles for the phone GPU, NPU and ARM target files (tests/helpers/real_shapes.py;
the x86 files in test_real_shapes_x86.py, apart so that both test workers share them): in the default set each shape
for one of these targets, taking turns (the 4096-wide shapes land on both GPUs); every pair in the extended set."""

import pytest

from tests.helpers.real_shapes import check_compiles, matrix, target_files

GPUS = ["android-adreno", "android-mali"]
CPUS_AND_NPU = ["linux-arm64", "android-arm64", "hexagon-npu"]


@pytest.mark.parametrize(("shape", "target"), matrix([sorted(GPUS + CPUS_AND_NPU)]))
def test_compiles(shape, target, tmp_path):
    check_compiles(shape, target, tmp_path)


def test_the_matrix_holds_every_target_file_that_is_not_x86():
    assert sorted(GPUS + CPUS_AND_NPU) == sorted(target_files(x86=False))
