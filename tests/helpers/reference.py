"""Greedy decoding and logits with a transformers model (the reference mobilec is compared against) and with an
artifact."""

import functools
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from compiler.artifacts.artifact import load_artifact
from compiler.model_import.kv_cache_dtype import CODE_FORMATS
from compiler.runtime.session import Session


def reference_greedy(model, prompt_ids: list[int], n_tokens: int) -> tuple[list[int], np.ndarray, list[np.ndarray]]:
    """(greedy token ids, prefill logits [n, vocab], logits after each decoded token)."""
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        prefill_logits = out.logits[0].float().numpy()
        past, tok = out.past_key_values, int(out.logits[0, -1].argmax())
        tokens, decode_logits = [tok], []
        for _ in range(n_tokens - 1):
            out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            decode_logits.append(out.logits[0, -1].float().numpy())
            tok = int(out.logits[0, -1].argmax())
            tokens.append(tok)
    return tokens, prefill_logits, decode_logits


def artifact_greedy(path, prompt_ids, n_tokens: int) -> tuple[np.ndarray, list[int], str]:
    """(logits of the prompt and after each decoded token, n_tokens greedy token ids, the device the kernels ran
    on) of the artifact at `path`."""
    session = Session(load_artifact(path))
    logits = [np.asarray(session.prefill(prompt_ids)).reshape(-1)]
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < n_tokens:
        logits.append(np.asarray(session.decode(tokens[-1])).reshape(-1))
        tokens.append(int(logits[-1].argmax()))
    return np.stack(logits), tokens, str(session.device.dev)


# llama.cpp's logits at every position, computed in a child process: a llama.cpp that crashes (llama-cpp-python
# 0.3.36's native build segfaults in decode on CPUs with AMX) takes down only that process, not the test worker
_LLAMA_CPP_LOGITS = """
import sys
import numpy as np
import llama_cpp
path, out, ids = sys.argv[1], sys.argv[2], [int(i) for i in sys.argv[3].split(",")]
llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_threads=1, logits_all=True, verbose=False)
llm.eval(ids)
np.save(out, np.array(llm.scores[: len(ids)], dtype=np.float32))
"""


def _run_llama_cpp_logits(path, ids: list[int]) -> tuple[np.ndarray | None, subprocess.CompletedProcess]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npy"
        run = subprocess.run([sys.executable, "-c", _LLAMA_CPP_LOGITS, str(path), str(out), ",".join(map(str, ids))],
                             capture_output=True, text=True, check=False)
        return (np.load(out) if run.returncode == 0 else None), run


@functools.cache
def _llama_cpp_crashes_on_smollm2() -> bool:
    """Whether this machine's llama.cpp dies by a signal on SmolLM2's own GGUF too (its defect, not the file's)."""
    from compiler.loaders.default_model import default_model_path

    return _run_llama_cpp_logits(default_model_path(), [1, 2, 3])[1].returncode < 0


def llama_cpp_logits(path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits at every position of `ids` for the GGUF at `path` (the test skips without
    llama-cpp-python). logits_all: llama-cpp-python 0.3.36 leaves `scores` zero without it. A llama.cpp that crashes
    on SmolLM2's GGUF as well skips the test, naming the signal; any other failure fails it."""
    import pytest

    pytest.importorskip("llama_cpp")
    logits, run = _run_llama_cpp_logits(path, ids)
    if logits is not None:
        return logits
    if run.returncode < 0 and _llama_cpp_crashes_on_smollm2():
        pytest.skip(f"llama.cpp dies by signal {-run.returncode} on this machine, on SmolLM2's GGUF too (its native "
                    f"build on a CPU with AMX; README: Benchmarks)")
    pytest.fail(f"llama.cpp failed on {path} (exit {run.returncode}): {run.stderr.strip()[-400:]}")


def fake_quantized(model, layout):
    """A copy of `model` whose linear and embedding weights went through quantize + dequantize (numpy reference);
    the embedding and output layer use the 8-bit layout mobilec keeps for them."""
    import copy

    from compiler.quantization import group

    clone = copy.deepcopy(model)
    output_layers = {id(clone.get_input_embeddings()), id(clone.get_output_embeddings())}
    done = set()  # a tied table is one parameter: quantized once (a second round trip moves it by up to 7e-3)
    with torch.no_grad():
        for module in clone.modules():
            if isinstance(module, torch.nn.Linear | torch.nn.Embedding) and id(module.weight) not in done:
                done.add(id(module.weight))
                lay = group.output_layer_layout(layout) if id(module) in output_layers else layout
                w = module.weight.numpy()
                module.weight.copy_(torch.from_numpy(group.dequantize(group.quantize(w, lay), lay, w.shape[1])))
    return clone


def _int8_round_trip(x):
    amax = x.abs().amax(-1, keepdim=True)
    return torch.round(x * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))) * (amax / 127)


def _int4_round_trip(x, kv: int):
    """Per group of the cache's channels (kv_cache_dtype.Carrier.group: K's 8, V's 16, or fewer where head_dim is
    not a multiple), with the scale and min rounded to bfloat16 and the codes taken against them, as stored."""
    group = math.gcd(CODE_FORMATS["int4"].groups[kv], x.shape[-1])
    x = x.unflatten(-1, (-1, group))
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale, lo = ((hi - lo) / 15).to(torch.bfloat16).float(), lo.to(torch.bfloat16).float()
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.clamp(torch.round((x - lo) * inv), 0, 15) * scale + lo).flatten(-2)


KV_ROUND_TRIPS = {"int8": lambda x, kv: _int8_round_trip(x), "int4": _int4_round_trip}


def kv_fake_quantized(model, name: str):
    """A copy of `model` whose attention sees K (after RoPE) and V through quantize + dequantize per token and KV
    head, as the `name` (int8, int4) cache stores them (quantizing the whole cached K/V each step is the same: a
    dequantized row quantizes to its own codes). The attention is the model's own: its module's eager one (Gemma 2's
    capped scores, sliding windows) where the model runs eager attention, else SDPA."""
    import copy
    import sys

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    round_trip = KV_ROUND_TRIPS[name]
    eager = model.config._attn_implementation == "eager"  # pylint: disable=protected-access
    inner = sys.modules[type(model).__module__].eager_attention_forward if eager else sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        return inner(module, query, round_trip(key, 0), round_trip(value, 1), attention_mask, **kwargs)

    impl = f"mobilec_{name}_kv_{type(model).__name__}_{'eager' if eager else 'sdpa'}"  # one per inner attention
    AttentionInterface.register(impl, attention)
    # its masks as for the inner attention: an attention unknown to the mask registry gets no mask at all (causal
    # only through SDPA's is_causal, no sliding window)
    AttentionMaskInterface.register(impl, eager_mask if eager else sdpa_mask)
    clone = copy.deepcopy(model)
    clone.set_attn_implementation(impl)
    return clone
