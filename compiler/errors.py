"""The one error type users see: a single line naming the problem and the fix."""

import tvm_ffi


class MobilecError(Exception):
    """A problem with the user's input or environment; the CLI prints it as one line and exits 2."""


# Raised inside a pass, the error crosses TVM's FFI; registered, it comes back out as MobilecError.
tvm_ffi.register_error("MobilecError", MobilecError)
