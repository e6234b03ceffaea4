"""Activation-aware int4 calibration (`--calibrate awq`): AWQ channel scaling, then GPTQ rounding.

The float model runs once on a calibration text; each linear layer's inputs X are recorded.
1. AWQ: per group of layers sharing one input, search s = mean|x|^alpha; the layers' weight columns are
   multiplied by s and the op producing their input divided by s (RMSNorm weight, up_proj rows, v_proj rows),
   which leaves the float model unchanged but gives the channels that carry large activations finer steps.
2. GPTQ: each layer is rounded column by column, the error of each column pushed onto the columns not yet
   rounded through H = X^T X, so the layer's output on the calibration inputs, not its weights, stays close.
The result is a `Calibration`: transforms on our float parameters plus a calibration-aware `quantize`.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from pathlib import Path

import numpy as np

from .. import validate
from ..errors import MobilecError
from ..loaders import Checkpoint
from .group import GroupLayout, order_codes, pack_codes, plain_grid, quantize, scale_candidates, stored_codes

METHODS = ("awq",)
CALIB_WINDOWS, CALIB_WINDOW = 8, 512  # windows spread over the text: GPTQ overfits fewer tokens (K is 576-1536)
SEARCH_ROWS = 16  # rows per window kept for the alpha search's output error
ALPHAS = np.linspace(0.0, 1.0, 11)  # alpha 0 is s = 1, plain rounding: the search can only improve on it
GPTQ_DAMP = 0.1  # of H's mean diagonal, added to its diagonal: H from a few thousand tokens is noisy, and a
# stronger pull towards plain rounding generalized better to other text than GPTQ's usual 0.01
GPTQ_BLOCK = 128  # columns rounded before the lazy update of the rest; a multiple of every group size


def default_calibration_text() -> tuple[str, str]:
    """(text, its name): CPython's pydoc topics (the language reference in English prose, pydoc_data/topics.py).
    It ships with every Python, so calibration works offline; it is not CPython's LICENSE, our eval text."""
    from pydoc_data.topics import topics  # pylint: disable=import-outside-toplevel

    return "\n\n".join(topics[k] for k in sorted(topics)), "pydoc_data.topics"


def check_options(method: str | None, calib_text: str | None, layout: GroupLayout | None) -> None:
    if method is None:
        if calib_text is not None:
            raise MobilecError("--calib-text needs --calibrate awq")
        return
    if method not in METHODS:
        raise MobilecError(f"unknown --calibrate {method!r}; valid: {', '.join(METHODS)}")
    if layout is None or not layout.symmetric or layout.bits != 4:
        raise MobilecError("--calibrate awq needs a symmetric int4 scheme (q4f16_g32, q4f16_g128, q4f32_g32)")
    if calib_text is not None:
        validate.read_text_file(calib_text, "--calib-text")  # before the float model loads


# ---------------------------------------------------------------- quantization in torch (search and GPTQ)

def _group_scale(g, layout: GroupLayout):
    """torch version of group._symmetric's scale on [..., group] values: the same candidates, the same choice.
    Returns (the stored scale, the plain grid's float32 scale before its rounding, which its codes come from)."""
    import torch  # pylint: disable=import-outside-toplevel

    dtype = getattr(torch, layout.scale_dtype)
    base = torch.gather(g, -1, g.abs().argmax(dim=-1, keepdim=True))[..., 0] / -layout.offset
    best_err = torch.full_like(base, math.inf)
    best = torch.zeros_like(base)
    for t in scale_candidates(layout):
        s = (base * float(t)).to(dtype).float()
        codes = _codes(g, s[..., None], base[..., None], layout)
        err = ((codes - layout.offset) * s[..., None] - g).square().sum(dim=-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, s, best)
    return best, base


def _codes(w, scale, base, layout: GroupLayout):
    """Codes of w as group._symmetric takes them: on the plain grid from its unrounded scale `base`, halves up; else
    nearest to the stored `scale`."""
    import torch  # pylint: disable=import-outside-toplevel

    top = (1 << layout.bits) - 1
    if plain_grid(layout):
        inv = torch.where(base != 0, 1 / torch.where(base != 0, base, 1.0), 0.0)
        return torch.clamp(torch.floor(w * inv + (layout.offset + 0.5)), 0, top)
    q = torch.where(scale != 0, torch.round(w / torch.where(scale != 0, scale, 1.0)), 0.0)
    return torch.clamp(q + layout.offset, 0, top)


def fake_quantize(w, layout: GroupLayout):
    """float [n, k] torch -> quantize then dequantize, exactly as group.quantize + group.dequantize."""
    import torch  # pylint: disable=import-outside-toplevel

    n, k = w.shape
    kp = layout.padded_k(k)
    g = torch.nn.functional.pad(w, (0, kp - k)).view(n, kp // layout.group, layout.group)
    scale, base = _group_scale(g, layout)
    scale, base = scale[..., None], base[..., None]
    return (_codes(g, scale, base, layout) * scale + scale * -layout.offset).view(n, kp)[:, :k]  # as group.dequantize


def search_scale(w, xs, mean_abs, layout: GroupLayout, heads: tuple[int, int, int] | None = None):
    """AWQ: the s = mean_abs^alpha (alpha on a grid) that minimizes |xs W^T - (xs/s) Q(W s)^T|^2.

    w [n, k], sample inputs xs [t, k] and mean |x| [k] are torch float32. With heads = (kv heads, query heads
    per kv head, head dim), s is the same for the query heads sharing a kv head. Returns s as float32 [k].
    """
    import torch  # pylint: disable=import-outside-toplevel

    if heads is not None:
        mean_abs = mean_abs.view(heads).mean(dim=1, keepdim=True).expand(heads).reshape(-1)
    mean_abs = mean_abs.clamp(min=1e-5)
    best, best_s = math.inf, torch.ones_like(mean_abs)
    for alpha in ALPHAS:
        s = mean_abs.pow(float(alpha))
        s = s / (s.max() * s.min()).sqrt()  # geometric centre 1 keeps weights and activations in range
        err = (xs @ (fake_quantize(w * s, layout) / s - w).T).pow(2).sum().item()
        if err < best:
            best, best_s = err, s
    return best_s


def gptq_quantize(w: np.ndarray, hessian: np.ndarray, layout: GroupLayout) -> dict[str, np.ndarray]:
    """Float [n, k] weight and H = X^T X [k, k] of its calibration inputs -> the stored arrays of group.quantize.

    GPTQ (Frantar et al. 2022) with each group's symmetric scale taken, as group.quantize takes it, from the
    group's largest magnitude, but of the weights as error compensation has left them when the group starts.
    """
    import torch  # pylint: disable=import-outside-toplevel

    n, k = w.shape
    kp = layout.padded_k(k)
    weights = torch.zeros(n, kp)
    weights[:, :k] = torch.from_numpy(np.asarray(w, np.float32))
    h = torch.eye(kp, dtype=torch.float64)  # padding columns are zero and stay zero
    h[:k, :k] = torch.from_numpy(np.asarray(hessian, np.float64))
    h[torch.arange(k), torch.arange(k)] += torch.where(h.diagonal()[:k] == 0, 1.0, 0.0)  # never-active inputs
    h += GPTQ_DAMP * h.diagonal()[:k].mean() * torch.eye(kp, dtype=torch.float64)
    # Upper Cholesky factor of H^-1: row j holds how column j's rounding error spreads onto columns > j.
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).float()
    codes = torch.empty(n, kp)
    scales = torch.empty(n, kp // layout.group)
    for b0 in range(0, kp, GPTQ_BLOCK):
        b1 = min(b0 + GPTQ_BLOCK, kp)
        block, errors, ub = weights[:, b0:b1].clone(), torch.zeros(n, b1 - b0), u[b0:b1, b0:b1]
        for j in range(b1 - b0):
            col = b0 + j
            if col % layout.group == 0:
                scale, base = _group_scale(block[:, j : j + layout.group], layout)
                scales[:, col // layout.group] = scale
            codes[:, col] = _codes(block[:, j], scale, base, layout)
            err = (block[:, j] - (codes[:, col] - layout.offset) * scale) / ub[j, j]
            block[:, j:] -= err[:, None] * ub[j, j:][None, :]
            errors[:, j] = err
        weights[:, b1:] -= errors @ u[b0:b1, b1:]
    return {"q_scale": scales.numpy().astype(layout.scale_dtype),
            "q_weight": order_codes(pack_codes(stored_codes(codes.numpy(), layout.stored_k(k)), layout.bits), layout)}


# ---------------------------------------------------------------- the calibration result

@dataclasses.dataclass
class Calibration:
    """Transforms on our float parameters, and each layer's input statistics for GPTQ.

    columns[param]: multiply the weight's columns (its inputs) by this vector.
    rows[param]: (start, s) pairs, divide rows start:start+len(s) (elements of a 1-D norm weight) by s.
    hessians[layer path]: X^T X of its calibration inputs X, in the scaled model (X / s).
    """

    columns: dict[str, np.ndarray]
    rows: dict[str, list[tuple[int, np.ndarray]]]
    hessians: dict[str, np.ndarray]
    summary: dict

    def float_param(self, name: str, array: np.ndarray) -> np.ndarray:
        """Our float parameter `name` with the scales folded in (the float model computes the same function)."""
        if name not in self.columns and name not in self.rows:
            return array
        out = np.array(array, np.float32)
        if name in self.columns:
            out *= self.columns[name][None, :]
        for start, s in self.rows.get(name, []):
            out[start : start + len(s)] /= s.reshape(-1, *[1] * (out.ndim - 1))
        return out

    def quantize(self, path: str, w: np.ndarray, layout: GroupLayout) -> dict[str, np.ndarray]:
        """The checkpoint's float weight of layer `path` -> its stored arrays: scales folded, then GPTQ-rounded."""
        w = self.float_param(f"{path}.weight", w)
        return gptq_quantize(w, self.hessians[path], layout) if path in self.hessians else quantize(w, layout)


def torch_model(ckpt: Checkpoint):
    """transformers' float32 model of the checkpoint, with the tensors our loaders read (GGUF or HF)."""
    import torch  # pylint: disable=import-outside-toplevel
    from transformers import AutoConfig, AutoModelForCausalLM  # pylint: disable=import-outside-toplevel

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**ckpt.hf_config), dtype=torch.float32)
    state = {name: torch.from_numpy(np.asarray(ckpt.get(name), np.float32)) for name in ckpt.tensor_names()}
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    if missing:
        raise MobilecError(f"--calibrate: {ckpt.description} lacks {sorted(missing)[0]!r}, "
                           "which transformers' model of it needs")
    model.tie_weights()
    return model.eval()


@dataclasses.dataclass
class _Inputs:
    """Statistics of one layer's inputs over the calibration windows."""

    hessian: np.ndarray  # X^T X [k, k]
    abs_sum: np.ndarray  # sum of |x| per channel [k]
    samples: list[np.ndarray]  # SEARCH_ROWS rows of each window
    tokens: int = 0

    def add(self, x: np.ndarray) -> None:
        self.hessian += x.T @ x
        self.abs_sum += np.abs(x).sum(axis=0)
        self.samples.append(x[np.linspace(0, len(x) - 1, min(SEARCH_ROWS, len(x))).astype(int)])
        self.tokens += len(x)


def calibration_windows(ids: list[int], max_len: int) -> list[list[int]]:
    """Up to CALIB_WINDOWS windows of CALIB_WINDOW tokens, spread evenly over the text for variety."""
    window = min(CALIB_WINDOW, max_len)
    count = max(1, min(CALIB_WINDOWS, len(ids) // window))
    starts = np.linspace(0, max(0, len(ids) - window), count).astype(int)
    return [ids[s : s + window] for s in starts]


def record_inputs(model, windows: list[list[int]]) -> dict[str, _Inputs]:
    """Run the float model on each window; our layer path -> statistics of its inputs."""
    import torch  # pylint: disable=import-outside-toplevel

    tied = model.config.tie_word_embeddings
    watched = {"model.embed_tokens" if tied else "lm_head": model.lm_head}
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        watched |= {f"{p}.self_attn.qkv_proj": layer.self_attn.q_proj, f"{p}.self_attn.o_proj": layer.self_attn.o_proj,
                    f"{p}.mlp.gate_up_proj": layer.mlp.gate_proj, f"{p}.mlp.down_proj": layer.mlp.down_proj}
    stats = {path: _Inputs(np.zeros((m.in_features,) * 2, np.float32), np.zeros(m.in_features), [])
             for path, m in watched.items()}
    hooks = [module.register_forward_pre_hook(lambda _m, args, p=path: stats[p].add(args[0][0].float().numpy()))
             for path, module in watched.items()]
    try:
        with torch.inference_mode():
            for ids in windows:
                model(torch.tensor([ids]), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return stats


def calibrate(ckpt: Checkpoint, layout: GroupLayout, text_file: str | None, log=lambda msg: None) -> Calibration:
    """Record every layer's input statistics on the calibration text, search AWQ scales, keep H for GPTQ."""
    import torch  # pylint: disable=import-outside-toplevel

    from ..loaders.tokenizer import load_tokenizer  # pylint: disable=import-outside-toplevel
    from ..models.registry import family_for  # pylint: disable=import-outside-toplevel

    if family_for(ckpt.hf_config).name == "phi3":  # the folding below reads q/k/v and gate/up apart
        raise MobilecError("--calibrate is not implemented for phi3 (fused qkv_proj and gate_up_proj); compile "
                           "without it")
    t0 = time.perf_counter()
    if text_file is None:
        text, text_name = default_calibration_text()
    else:
        text, text_name = validate.read_text_file(text_file, "--calib-text"), str(text_file)
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        ckpt.save_tokenizer(tokenizer_dir)
        ids = load_tokenizer(Path(tokenizer_dir)).encode(text)
    if len(ids) < 16:
        raise MobilecError(f"--calib-text {text_name} has {len(ids)} tokens; calibration needs at least 16")
    model = torch_model(ckpt)
    windows = calibration_windows(ids, model.config.max_position_embeddings)
    stats = record_inputs(model, windows)
    tokens = sum(len(w) for w in windows)
    log(f"calibration: {tokens} tokens of {text_name} recorded in {time.perf_counter() - t0:.1f} s")

    cfg = model.config
    n_q, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    v_start = (n_q + n_kv) * head_dim  # v's rows in our qkv_proj
    columns: dict[str, np.ndarray] = {}
    rows: dict[str, list[tuple[int, np.ndarray]]] = {}
    hessians = {path: st.hessian for path, st in stats.items()}

    def fold(path: str, w, divided: list[tuple[str, int]], heads: tuple[int, int, int] | None = None):
        """Search s for layer `path` (weight w); its columns times s, rows start.. of each param in `divided`
        divided by s (by s per v head when `heads` ties it), its inputs' H divided by s s^T."""
        st = stats[path]
        mean_abs = torch.from_numpy(st.abs_sum / st.tokens).float()
        s = search_scale(w, torch.from_numpy(np.concatenate(st.samples)), mean_abs, layout, heads).numpy()
        columns[f"{path}.weight"] = s
        producer = s if heads is None else s.reshape(heads)[:, 0, :].reshape(-1)
        for param, start in divided:
            rows.setdefault(param, []).append((start, producer))
        hessians[path] = st.hessian / np.outer(s, s).astype(np.float32)

    with torch.inference_mode():
        for i, layer in enumerate(model.model.layers):
            p, attn, mlp = f"model.layers.{i}", layer.self_attn, layer.mlp
            fold(f"{p}.self_attn.qkv_proj", torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                 [(f"{p}.input_layernorm.weight", 0)])
            # o_proj's input is attention-weighted v: dividing a v row by s divides the o_proj input column of
            # every query head reading that v head (GQA), so s is searched tied across those heads.
            v_params = [(f"{p}.self_attn.qkv_proj.weight", v_start)]
            if attn.v_proj.bias is not None:
                v_params.append((f"{p}.self_attn.qkv_proj.bias", v_start))
            fold(f"{p}.self_attn.o_proj", attn.o_proj.weight, v_params, (n_kv, n_q // n_kv, head_dim))
            fold(f"{p}.mlp.gate_up_proj", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                 [(f"{p}.post_attention_layernorm.weight", 0)])
            fold(f"{p}.mlp.down_proj", mlp.down_proj.weight, [(f"{p}.mlp.gate_up_proj.weight", cfg.intermediate_size)])
    log(f"calibration: AWQ scales searched, {time.perf_counter() - t0:.1f} s in all (GPTQ runs as layers are stored)")
    return Calibration(columns, rows, hessians, {"method": "awq", "text": text_name, "tokens": tokens})
