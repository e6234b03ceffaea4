"""Tiny seeded random Llama/Qwen2 models: compiled prefill and decode logits against transformers (fp32)."""

import numpy as np
import pytest

from compiler.artifacts.artifact import load_artifact
from compiler.runtime.session import Session
from tests.helpers.compiled_once import tiny_compiled_once
from tests.helpers.reference import reference_greedy
from tests.helpers.tiny_models import SPECS, build_model

pytestmark = pytest.mark.slow  # a compile per model plus transformers: ~1 minute

PROMPT = [3, 7, 1, 4, 4, 9, 2, 5, 6, 8, 10]


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.fixture(scope="module", params=sorted(SPECS))
def compiled(request, tmp_path_factory):
    name = request.param
    artifact = tiny_compiled_once(tmp_path_factory, name, "host", "q0f32", context_window=64)
    return build_model(name), Session(load_artifact(artifact))


def test_prefill_and_8_decode_steps_match_transformers(compiled):
    model, session = compiled
    ref_tokens, ref_prefill, ref_decode = reference_greedy(model, PROMPT, 9)
    session.reset()
    assert _rel_err(session.prefill_all_logits(PROMPT), ref_prefill) < 1e-3
    for step, token in enumerate(ref_tokens[:-1]):  # feed the reference's tokens: a mismatch can't cascade
        assert _rel_err(session.decode(token), ref_decode[step]) < 1e-3, f"decode step {step}"


def test_negative_control_perturbed_weights_are_detected(compiled, tmp_path):
    """The same comparison fails against a model whose weights differ slightly."""
    model, session = compiled
    other = build_model(_spec_name(model), seed=1)
    _, ref_prefill, _ = reference_greedy(other, PROMPT, 1)
    session.reset()
    assert _rel_err(session.prefill_all_logits(PROMPT), ref_prefill) > 1e-2


def _spec_name(model) -> str:
    cfg = model.config
    return next(n for n, (_, _, kw) in SPECS.items()
                if kw["vocab_size"] == cfg.vocab_size and kw["hidden_size"] == cfg.hidden_size)


def test_chunked_prefill_equals_one_shot(compiled):
    """Prompts longer than the prefill chunk are fed in pieces; the KV cache must make that invisible."""
    _, session = compiled
    session.reset()
    whole = session.prefill_all_logits(PROMPT)
    session.reset()
    session.prefill_chunk = 4
    try:
        pieces = session.prefill_all_logits(PROMPT)
    finally:
        session.prefill_chunk = int(session.artifact.config["prefill_chunk"])
    np.testing.assert_allclose(pieces, whole, rtol=1e-4, atol=1e-4)
