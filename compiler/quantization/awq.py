"""Activation-aware int4 calibration (`--calibrate awq`): AWQ channel scaling, then GPTQ rounding.

The float model runs on a calibration text one decoder layer at a time (only that layer's weights in memory);
each linear layer's inputs X are recorded, and as soon as a decoder layer has run its layers are calibrated:
1. AWQ: per group of layers sharing one input, search s = mean|x|^alpha; the layers' weight columns are
   multiplied by s and the op producing their input divided by s (RMSNorm weight, up_proj rows, v_proj rows),
   which leaves the float model unchanged but gives the channels that carry large activations finer steps.
2. GPTQ: each layer is rounded column by column, the error of each column pushed onto the columns not yet
   rounded through H = X^T X, so the layer's output on the calibration inputs, not its weights, stays close.
   The rounded arrays go to a directory, where the artifact's writer reads them back.
The result is a `Calibration`: transforms on our float parameters plus a calibration-aware `quantize`.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .. import validate
from ..errors import MobilecError
from ..loaders import Checkpoint
from .group import (
    GroupLayout,
    order_codes,
    output_layer_layout,
    pack_codes,
    plain_grid,
    quantize,
    scale_candidates,
    stored_codes,
)

METHODS = ("awq",)
CALIB_WINDOWS, CALIB_WINDOW = 8, 512  # windows spread over the text: GPTQ overfits fewer tokens (K is 576-1536)
SEARCH_ROWS = 16  # rows per window kept for the alpha search's output error
ALPHAS = np.linspace(0.0, 1.0, 11)  # alpha 0 is s = 1, plain rounding: the search can only improve on it
GPTQ_DAMP = 0.1  # of H's mean diagonal, added to its diagonal: H from a few thousand tokens is noisy, and a
# stronger pull towards plain rounding generalized better to other text than GPTQ's usual 0.01
GPTQ_BLOCK = 128  # columns rounded before the lazy update of the rest; a multiple of every group size
GPTQ_ROWS = 4096  # rows rounded at a time (rows are independent given H): an 8B model's output layer has
# 128256, whose float32 working copies would be 2 GB each
# bytes GPTQ holds per k^2 for a layer with k inputs: H in float32, and two float64 [k, k] matrices at once while
# _inverse_factor factors and inverts it (k = 14336, an 8B down_proj: 4.1 GB); estimate counts it
GPTQ_BYTES_PER_INPUT_SQUARED = 4 + 2 * 8


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
    n, k = w.shape
    u = _inverse_factor(hessian, layout.padded_k(k))
    scales = np.empty((n, layout.padded_k(k) // layout.group), layout.scale_dtype)
    packed = np.empty((n, layout.stored_k(k) * layout.bits // 8), np.uint8)
    for r0 in range(0, n, GPTQ_ROWS):
        codes, scales[r0 : r0 + GPTQ_ROWS] = _gptq_rows(w[r0 : r0 + GPTQ_ROWS], u, layout)
        packed[r0 : r0 + GPTQ_ROWS] = pack_codes(stored_codes(codes, layout.stored_k(k)), layout.bits)
    return {"q_scale": scales, "q_weight": order_codes(packed, layout)}


def _inverse_factor(hessian: np.ndarray, kp: int):
    """The upper Cholesky factor of the damped H^-1, padded to kp columns, float32 torch: row j holds how column
    j's rounding error spreads onto the columns after j."""
    import torch  # pylint: disable=import-outside-toplevel

    k = len(hessian)
    h = torch.eye(kp, dtype=torch.float64)  # padding columns are zero and stay zero
    h[:k, :k] = torch.from_numpy(hessian)  # converted as copied: a float64 copy of H is 1.6 GB for K = 14336
    diagonal = h.diagonal()
    diagonal[:k] += torch.where(diagonal[:k] == 0, 1.0, 0.0)  # never-active inputs
    diagonal += GPTQ_DAMP * diagonal[:k].mean()
    # at most two float64 [kp, kp] matrices alive at once; the float32 copy is made beside the last one only
    factor = torch.linalg.cholesky(h)
    del h, diagonal
    inverse = torch.cholesky_inverse(factor)
    del factor
    upper = torch.linalg.cholesky(inverse, upper=True)
    del inverse
    return upper.float()


def _gptq_rows(w: np.ndarray, u, layout: GroupLayout) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ on rows [n, k] of a weight with the factor `u` of its inputs: (codes [n, kp], scales [n, groups])."""
    import torch  # pylint: disable=import-outside-toplevel

    n, k = w.shape
    kp = len(u)
    weights = torch.zeros(n, kp)
    weights[:, :k] = torch.from_numpy(np.asarray(w, np.float32))
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
    return codes.numpy(), scales.numpy().astype(layout.scale_dtype)


# ---------------------------------------------------------------- the calibration result

@dataclasses.dataclass
class Calibration:
    """Transforms on our float parameters, and the calibrated layers' stored arrays.

    columns[param]: multiply the weight's columns (its inputs) by this vector.
    rows[param]: (start, s) pairs, divide rows start:start+len(s) (elements of a 1-D norm weight) by s.
    rounded: the layers GPTQ rounded (with their inputs' H in the scaled model, X / s), whose arrays, codes in
    the plain order, are `store`/<layer path>.npz.
    """

    columns: dict[str, np.ndarray]
    rows: dict[str, list[tuple[int, np.ndarray]]]
    store: Path
    rounded: set[str]
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

    def quantize(self, path: str, weight: Callable[[], np.ndarray], layout: GroupLayout) -> dict[str, np.ndarray]:
        """The stored arrays of layer `path` in `layout`: GPTQ's, else its float weight (read by `weight`, the
        checkpoint's) with the scales folded in, plainly rounded."""
        if path not in self.rounded:
            return quantize(self.float_param(f"{path}.weight", weight()), layout)
        with np.load(self.store / f"{path}.npz") as arrays:
            return {"q_scale": arrays["q_scale"], "q_weight": order_codes(arrays["q_weight"], layout)}

    def round_layer(self, path: str, w: np.ndarray, hessian: np.ndarray, layout: GroupLayout) -> None:
        """GPTQ on layer `path`'s float weight w (the checkpoint's), H = X^T X of its inputs in the float model
        (scaled here, in place), into the store."""
        s = self.columns.get(f"{path}.weight")
        if s is not None:  # in place: the 822 MB of an 8B down_proj's H are not copied
            hessian /= s[:, None]
            hessian /= s[None, :]
        plain = dataclasses.replace(layout, code_order="plain")  # `quantize` orders the codes as the target reads them
        np.savez(self.store / f"{path}.npz", **gptq_quantize(self.float_param(f"{path}.weight", w), hessian, plain))
        self.rounded.add(path)


def _empty_model(ckpt: Checkpoint):
    """transformers' float32 model of the checkpoint with its parameters on the meta device (no memory); its
    buffers (RoPE's frequencies) are real."""
    import torch  # pylint: disable=import-outside-toplevel
    from accelerate import init_empty_weights  # pylint: disable=import-outside-toplevel
    from transformers import AutoConfig, AutoModelForCausalLM  # pylint: disable=import-outside-toplevel

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**ckpt.hf_config), dtype=torch.float32)
    return model.eval().requires_grad_(False)


def _load(module, prefix: str, ckpt: Checkpoint, names: set[str]) -> None:
    """Give `module`'s parameters the checkpoint's tensors `prefix` + their names, as float32."""
    import torch  # pylint: disable=import-outside-toplevel

    state = {}
    for name, _ in module.named_parameters():
        if prefix + name not in names:
            raise MobilecError(f"--calibrate: {ckpt.description} lacks {prefix + name!r}, which transformers' model "
                               "of it needs")
        state[name] = torch.from_numpy(ckpt.get(prefix + name))
    module.load_state_dict(state, strict=False, assign=True)


@dataclasses.dataclass
class _Inputs:
    """Statistics of one layer's inputs over the calibration windows."""

    hessian: np.ndarray  # X^T X [k, k]
    mean_abs: np.ndarray  # mean |x| per channel [k]
    samples: np.ndarray  # SEARCH_ROWS rows of each window [windows * SEARCH_ROWS, k]

    @classmethod
    def of(cls, x: np.ndarray) -> _Inputs:
        """The statistics of inputs x [windows, tokens, k]."""
        rows = np.linspace(0, x.shape[1] - 1, min(SEARCH_ROWS, x.shape[1])).astype(int)
        flat = x.reshape(-1, x.shape[2])
        return cls(flat.T @ flat, np.abs(flat).mean(axis=0), x[:, rows].reshape(-1, x.shape[2]))


def calibration_windows(ids: list[int], max_len: int) -> list[list[int]]:
    """Up to CALIB_WINDOWS windows of CALIB_WINDOW tokens, spread evenly over the text for variety."""
    window = min(CALIB_WINDOW, max_len)
    count = max(1, min(CALIB_WINDOWS, len(ids) // window))
    starts = np.linspace(0, max(0, len(ids) - window), count).astype(int)
    return [ids[s : s + window] for s in starts]


def calibrate(ckpt: Checkpoint, layout: GroupLayout, text_file: str | None, store: Path,
              log=lambda msg: None) -> Calibration:
    """Run the float model on the calibration text one decoder layer at a time, all windows as one batch (each
    layer's weights are read once); as each layer has run, search its AWQ scales and GPTQ-round it into the
    directory `store`, then drop its weights and input statistics."""
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
    model = _empty_model(ckpt)
    windows = calibration_windows(ids, model.config.max_position_embeddings)
    cal = Calibration({}, {}, store, set(), {"method": "awq", "text": text_name, "tokens": sum(map(len, windows))})
    names, base = set(ckpt.tensor_names()), model.model
    prefixes = {module: f"{name}." for name, module in model.named_modules()}
    layer_index = {layer: i for i, layer in enumerate(base.layers)}
    stats: dict[str, _Inputs] = {}  # the inputs of the running decoder layer's linear layers

    def record(path: str, x) -> None:
        stats[path] = _Inputs.of(x.float().numpy())

    def load_layer(layer, _args) -> None:
        _load(layer, prefixes[layer], ckpt, names)

    def calibrate_layer(layer, _args, _output) -> None:
        i = layer_index[layer]
        _calibrate_layer(cal, f"model.layers.{i}", layer, stats, layout, model.config)
        layer.to("meta")  # frees the weights
        log(f"calibration: layer {i + 1}/{len(base.layers)} done, {time.perf_counter() - t0:.1f} s")

    for i, layer in enumerate(base.layers):  # the model is thrown away after this run: hooks are left on it
        p, attn, mlp = f"model.layers.{i}", layer.self_attn, layer.mlp
        layer.register_forward_pre_hook(load_layer)
        layer.register_forward_hook(calibrate_layer)
        for path, module in ((f"{p}.self_attn.qkv_proj", attn.q_proj), (f"{p}.self_attn.o_proj", attn.o_proj),
                             (f"{p}.mlp.gate_up_proj", mlp.gate_proj), (f"{p}.mlp.down_proj", mlp.down_proj)):
            module.register_forward_pre_hook(lambda _m, args, path=path: record(path, args[0]))
    embed = base.get_input_embeddings()
    for module in base.children():  # the final norm and such: small, loaded for the whole run
        if module is not embed and module is not base.layers:
            _load(module, prefixes[module], ckpt, names)
    log(f"calibration: {cal.summary['tokens']} tokens of {text_name}, one decoder layer at a time")
    with torch.inference_mode():
        _load(embed, prefixes[embed], ckpt, names)
        embedded = embed(torch.tensor(windows))  # the embedding module, which scales its output in some families
        embed.to("meta")
        out = base(inputs_embeds=embedded, use_cache=False).last_hidden_state  # the output layer's input
    # the output layer (the token table when tied): GPTQ only, nothing produces its input that could take a scale
    path = "model.embed_tokens" if model.config.tie_word_embeddings else "lm_head"
    x = out.numpy().reshape(-1, out.shape[-1])
    cal.round_layer(path, ckpt.get(f"{path}.weight"), x.T @ x, output_layer_layout(layout))
    log(f"calibration: output layer rounded, {time.perf_counter() - t0:.1f} s in all")
    return cal


def _calibrate_layer(cal: Calibration, p: str, layer, stats: dict[str, _Inputs], layout: GroupLayout, cfg) -> None:
    """Decoder layer `p`, its inputs in `stats` (taken out): search its AWQ scales, then GPTQ-round its layers."""
    import torch  # pylint: disable=import-outside-toplevel

    n_q, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_q
    v_start = (n_q + n_kv) * head_dim  # v's rows in our qkv_proj
    attn, mlp = layer.self_attn, layer.mlp
    weights = {f"{p}.self_attn.qkv_proj": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
               f"{p}.self_attn.o_proj": attn.o_proj.weight,
               f"{p}.mlp.gate_up_proj": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
               f"{p}.mlp.down_proj": mlp.down_proj.weight}
    inputs = {path: stats.pop(path) for path in weights}

    def fold(path: str, divided: list[tuple[str, int]], heads: tuple[int, int, int] | None = None):
        """Search s for layer `path`; its columns times s, rows start.. of each param in `divided` divided by s
        (by s per v head when `heads` ties it)."""
        st = inputs[path]
        s = search_scale(weights[path], torch.from_numpy(st.samples), torch.from_numpy(st.mean_abs), layout,
                         heads).numpy()
        cal.columns[f"{path}.weight"] = s
        producer = s if heads is None else s.reshape(heads)[:, 0, :].reshape(-1)
        for param, start in divided:
            cal.rows.setdefault(param, []).append((start, producer))

    fold(f"{p}.self_attn.qkv_proj", [(f"{p}.input_layernorm.weight", 0)])
    # o_proj's input is attention-weighted v: dividing a v row by s divides the o_proj input column of every
    # query head reading that v head (GQA), so s is searched tied across those heads.
    v_params = [(f"{p}.self_attn.qkv_proj.weight", v_start)]
    if attn.v_proj.bias is not None:
        v_params.append((f"{p}.self_attn.qkv_proj.bias", v_start))
    fold(f"{p}.self_attn.o_proj", v_params, (n_kv, n_q // n_kv, head_dim))
    fold(f"{p}.mlp.gate_up_proj", [(f"{p}.post_attention_layernorm.weight", 0)])
    fold(f"{p}.mlp.down_proj", [(f"{p}.mlp.gate_up_proj.weight", cfg.intermediate_size)])
    # after every search: qkv_proj's v rows take o_proj's s, gate_up_proj's up rows down_proj's
    for path, w in weights.items():
        cal.round_layer(path, w.numpy(), inputs.pop(path).hessian, layout)
