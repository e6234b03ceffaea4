"""Test harnesses (PoCL OpenCL runs)."""
