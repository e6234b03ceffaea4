"""session.host_copy and device_tensor: logits leave the VM as numpy copies that later steps cannot change, and inputs
enter it as tensors of their own."""

import numpy as np
import tvm

from compiler.runtime.session import device_tensor, host_copy


def test_a_cpu_tensor_is_copied_not_viewed():
    values = np.arange(12, dtype="float32").reshape(1, 1, 12)
    tensor = tvm.runtime.tensor(values)
    copy = host_copy(tensor)
    tensor.copyfrom(np.zeros_like(values))  # the VM reuses an output's storage on the next step
    np.testing.assert_array_equal(copy, values)
    assert copy.dtype == values.dtype and copy.shape == values.shape


class _DeviceTensor:
    """A tensor on a device the host cannot read in place (an OpenCL or RPC device's)."""

    device = tvm.device("opencl", 0)

    def numpy(self):
        return np.ones(3, "float32")


def test_a_device_tensor_is_read_through_numpy():
    np.testing.assert_array_equal(host_copy(_DeviceTensor()), np.ones(3, "float32"))


def test_device_tensor_holds_the_values_in_a_tensor_of_its_own():
    values = np.array([3, 1, 2], "int32")
    tensor = device_tensor(values, tvm.cpu())
    values[0] = 7  # the caller's array is not the tensor's storage
    np.testing.assert_array_equal(tensor.numpy(), [3, 1, 2])
    assert tensor.dtype == "int32" and tuple(tensor.shape) == (3,)
