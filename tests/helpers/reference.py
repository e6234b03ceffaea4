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
    """A copy of `model` whose linear and embedding weights went through quantize + dequantize (numpy reference);
    the embedding and output layer use the 8-bit layout mobilec keeps for them."""
    import copy

    from compiler.quantization import group
    from compiler.quantization.quantize_model import output_layer_layout

    clone = copy.deepcopy(model)
    output_layers = {id(clone.get_input_embeddings()), id(clone.get_output_embeddings())}
    with torch.no_grad():
        for module in clone.modules():
            if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
                lay = output_layer_layout(layout) if id(module) in output_layers else layout
                w = module.weight.numpy()
                module.weight.copy_(torch.from_numpy(group.dequantize(group.quantize(w, lay), lay, w.shape[1])))
    return clone
