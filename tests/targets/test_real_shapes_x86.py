"""Every common model shape compiles for the x86 target files (x86-64-v3, x86-64-v4; host is one of them), as
test_real_shapes_gpu_npu_arm.py does for the others: in the default set each shape for one target file, all the
files taking turns (tests/helpers/real_shapes.py `matrix`); every pair in the extended set."""

import pytest

from tests.helpers.real_shapes import check_compiles, matrix, target_files


@pytest.mark.parametrize(("shape", "target"), matrix(target_files(x86=True)))
def test_compiles(shape, target, tmp_path):
    check_compiles(shape, target, tmp_path)
