"""Model import: checkpoint + build plan -> Relax IRModule, the KV cache's dtype, the chat prompt."""
