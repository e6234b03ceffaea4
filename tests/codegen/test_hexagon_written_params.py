"""codegen/hexagon.written_params: which of an NPU kernel's buffers the emulated DSP copies back to the host. A
parameter missed there comes back unchanged, with no error, so each way of writing one is checked."""

import tvm
from tvm.script import tirx as T

from compiler.codegen.hexagon import WRITES_ATTR, written_params


@T.prim_func(private=True)
def stores_into_its_second(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32"),
                           c: T.Buffer((4,), "float32")):
    for i in range(4):
        b[i] = a[i] + c[i]


@T.prim_func(private=True)
def stores_through_a_view(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32"),
                          c: T.Buffer((4,), "float32")):
    flat = T.decl_buffer((4,), "float32", data=a.data)
    for i in range(4):
        flat[i] = b[i] + c[i]


@T.prim_func(private=True)
def calls_c_with_a_local_scalar(a: T.Buffer((4,), "float32"), b: T.Buffer((4,), "float32"),
                                c: T.Buffer((4,), "float32")):
    n = T.alloc_buffer((1,), "int32", scope="local")
    n[0] = 4
    T.evaluate(T.call_extern("int32", "some_c_kernel", a.data, b.data, c.data, n[0]))


def test_the_buffers_a_kernel_stores_into():
    assert written_params(stores_into_its_second) == [1]


def test_a_store_through_a_view_writes_the_viewed_parameter():
    assert written_params(stores_through_a_view) == [0]


def test_a_c_calling_kernel_writes_its_last_parameter_whatever_it_stores_locally():
    # before: its store into the local scalar hid the rule, and no parameter came back
    assert written_params(calls_c_with_a_local_scalar) == [2]


def test_a_c_calling_kernel_with_two_outputs_names_them():
    func = calls_c_with_a_local_scalar.with_attr(WRITES_ATTR, [0, 2])
    assert written_params(func) == [0, 2]
