"""The sitecustomize of the TVM worker processes mobilec starts (compiler/torch_hidden.py)."""
