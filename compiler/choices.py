"""The named choices of options, in one place that imports nothing heavy: the CLI offers them (`import
compiler.commands.cli` must not import TVM) and the modules that implement them read them from here."""

# --decode-activations: the integer width of decode GEMV activations (kernels/integer_dot_gemv/)
DECODE_ACTIVATIONS = ("int16", "int8")
# mobilec tune --only: which model functions' kernels are tuned
TUNE_FUNCTIONS = {"decode": ("decode",), "prefill": ("prefill",), "all": ("decode", "prefill")}
# a target file's device.compute_dtype and compile --compute-dtype: activations (and the KV cache by default)
COMPUTE_DTYPES = ("float32", "float16")
# compile/estimate --kv-dtype: how the KV cache stores keys and values (kv_cache_dtype.py)
KV_DTYPE_NAMES = ("f32", "f16", "int8", "int4")  # the names a target file's device.kv_dtype may give
KV_DTYPES = ("auto", *KV_DTYPE_NAMES)
# the Hugging Face model_types mobilec compiles (models/registry.py: one family each), and what they cover
MODEL_TYPES = {
    "llama": "SmolLM2, TinyLlama, Llama 2, Llama 3.x",
    "qwen2": "Qwen2, Qwen2.5",
    "qwen3": "Qwen3",
    "gemma3_text": "Gemma 3 1B (text-only checkpoints)",
    "gemma2": "Gemma 2",
    "mistral": "Mistral 7B (a sliding_window only where it does not bind)",
    "phi3": "Phi-3-mini, Phi-3.5-mini, Phi-4-mini (Hugging Face checkpoints only)",
}
