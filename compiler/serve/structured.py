"""Structured output: `response_format` json_object / json_schema as a token mask applied before sampling, from
xgrammar's grammar matcher (one per sequence; the grammar compiled once per schema for the server's tokenizer)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import MobilecError


class TokenMask:
    """The tokens a grammar allows next, advanced by each token sampled."""

    def __init__(self, matcher, bitmask, vocab_size: int):
        self.matcher, self.bitmask, self.vocab_size = matcher, bitmask, vocab_size

    def allowed(self) -> np.ndarray:
        """A bool per token of the model's vocabulary."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), bitorder="little")  # 32 tokens per int32
        return bits[:self.vocab_size].astype(bool)

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token):
            raise MobilecError(f"token {token} breaks the response_format grammar")

    @property
    def done(self) -> bool:
        """The grammar accepted its end (the end-of-sequence token after a complete value)."""
        return self.matcher.is_terminated()


class Grammars:
    """Compiles response_format grammars for one tokenizer and model vocabulary; xgrammar is imported on first use."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._compiler = None

    def _xgrammar(self):
        try:
            import xgrammar  # pylint: disable=import-outside-toplevel
        except ImportError:
            raise MobilecError("response_format json needs the xgrammar package; pip install --no-deps xgrammar==0.2.9") \
                from None
        if self._compiler is None:
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgrammar.GrammarCompiler(info)
        return xgrammar

    def mask_factory(self, response_format: dict[str, Any]) -> Callable[[], TokenMask] | None:
        """A maker of fresh masks for `response_format` ({"type": "text" | "json_object" | "json_schema", ...}), or
        None for plain text. Compact JSON (no free whitespace), so a value ends in few tokens."""
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            schema: Any = {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise MobilecError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": "
                                   "{...}}}")
            schema = spec["schema"]
        else:
            raise MobilecError(f"response_format type {json.dumps(kind)} is unknown; use text, json_object or "
                               f"json_schema")
        xgrammar = self._xgrammar()
        try:
            compiled = self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        except Exception as err:  # xgrammar's own errors: any type
            raise MobilecError(f"the JSON schema cannot be used: {' '.join(str(err).split())[:300]}") from None
        vocab_size = self.vocab_size

        def make() -> TokenMask:
            return TokenMask(xgrammar.GrammarMatcher(compiled), xgrammar.allocate_token_bitmask(1, vocab_size),
                             vocab_size)

        return make
