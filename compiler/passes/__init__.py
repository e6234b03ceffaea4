"""Relax/TIR passes of the mobilec pipeline, one per module; compiler/codegen/pipeline.py orders them."""

import tvm_ffi

from ..errors import MobilecError

# Raised inside a pass, the error crosses TVM's FFI; registered, it comes back out as MobilecError.
tvm_ffi.register_error("MobilecError", MobilecError)
