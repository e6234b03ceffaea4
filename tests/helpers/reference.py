"""Greedy decoding and logits with a transformers model: the reference mobilec is compared against."""

import numpy as np
import torch


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


def fake_quantized(model, layout):
    """A copy of `model` whose linear and embedding weights went through quantize + dequantize (numpy reference)."""
    import copy

    from compiler.quantization import group

    clone = copy.deepcopy(model)
    with torch.no_grad():
        for module in clone.modules():
            if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
                w = module.weight.numpy()
                module.weight.copy_(torch.from_numpy(group.dequantize(group.quantize(w, layout), layout, w.shape[1])))
    return clone
