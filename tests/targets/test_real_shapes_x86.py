"""Every common model shape compiles for the x86 target files (x86-64-v3, x86-64-v4; host is one of them), as
test_real_shapes_gpu_npu_arm.py does for the others."""

import pytest

from tests.helpers.real_shapes import SHAPES, check_compiles, target_files


@pytest.mark.parametrize("target", target_files(x86=True))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_compiles(shape, target, tmp_path):
    check_compiles(shape, target, tmp_path)
