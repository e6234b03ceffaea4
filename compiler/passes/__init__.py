"""Relax/TIR passes of the mobilec pipeline, one per module; compiler/pipeline.py orders them."""
