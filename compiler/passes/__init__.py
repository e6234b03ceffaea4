"""Relax/TIR passes of the mobilec pipeline."""

from .fuse_transpose_matmul import FuseTransposeMatmul
