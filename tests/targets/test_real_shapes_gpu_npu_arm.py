"""Every common model shape compiles for the phone GPU, NPU and ARM target files (tests/helpers/real_shapes.py;
the x86 files in test_real_shapes_x86.py, apart so that both test workers share the ~10 minutes)."""

import pytest

from tests.helpers.real_shapes import SHAPES, check_compiles, target_files


@pytest.mark.parametrize("target", target_files(x86=False))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_compiles(shape, target, tmp_path):
    check_compiles(shape, target, tmp_path)
