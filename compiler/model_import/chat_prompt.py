"""A chat prompt of one user message, as the model's chat template renders it, split at compile time into the text
before the message and the text after it, so that every runtime renders it the same way without a Jinja engine
(the native runtime has none; `mobilec generate` uses the same split).

The template is rendered by transformers with marker messages: the split is kept only where the rendering is the
same text around any message, the message in it as it is or stripped (Jinja's `trim`, Python's `str.strip`, which
Llama 3 and Gemma templates apply). A date the template asks for (`strftime_now`, Llama 3.2, Granite) stays a
strftime format, filled in when the prompt is rendered, as transformers fills it in (local time).

    "chat_prompt": {"before": [text | {"strftime": format}, ...], "after": [...], "message": "as-is" | "strip"}

or {"unsupported": "why"} for a template whose rendering depends on the message otherwise, or null for a
tokenizer without a chat template.
"""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

from ..errors import MobilecError

# Private-use characters no template writes: the markers of the message and of the date format
_OPEN, _CLOSE = "\ue000", "\ue001"
_DATE_OPEN, _DATE_CLOSE = "\ue010", "\ue011"
# Two different messages (a template must render both the same way around them), and one wrapped in whitespace
# that str.strip removes (the Unicode spaces included) to tell "as-is" from "strip"
_MESSAGES = ("x", "Hello, {{ world }}!\n")
_PADDING = " \t\n\u00a0\u3000"
MESSAGE_MODES = ("as-is", "strip")


class _MarkedNow:
    """Stands for datetime.now() in transformers' strftime_now: the format comes back between markers."""

    def strftime(self, fmt: str) -> str:
        return f"{_DATE_OPEN}{fmt}{_DATE_CLOSE}"


class _MarkedDatetime:
    @staticmethod
    def now() -> _MarkedNow:
        return _MarkedNow()


def _render(tokenizer, message: str) -> str:
    from transformers.utils import chat_template_utils  # pylint: disable=import-outside-toplevel

    with mock.patch.object(chat_template_utils, "datetime", _MarkedDatetime):
        return tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                             tokenize=False)


def _pieces(text: str) -> list[Any] | None:
    """Text with marked date formats as pieces: strings and {"strftime": format}; None if the markers are unpaired."""
    pieces: list[Any] = []
    while text:
        start = text.find(_DATE_OPEN)
        if start < 0:
            pieces.append(text)
            break
        end = text.find(_DATE_CLOSE, start)
        if end < 0:
            return None
        if start:
            pieces.append(text[:start])
        pieces.append({"strftime": text[start + 1:end]})
        text = text[end + 1:]
    return pieces


def _around(rendered: str, message: str) -> tuple[str, str] | None:
    """The text before and after the one occurrence of `message` in `rendered`, or None."""
    if rendered.count(message) != 1:
        return None
    before, after = rendered.split(message)
    return before, after


def split(tokenizer) -> dict[str, Any] | None:
    """The chat prompt entry of an artifact's config for `tokenizer` (see the module's docstring)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marked = [f"{_OPEN}{m}{_CLOSE}" for m in _MESSAGES]
    try:
        renderings = [_render(tokenizer, m) for m in marked]
        padded = _render(tokenizer, _PADDING + marked[0] + _PADDING)
    except Exception as err:  # the template's own errors (raise_exception, undefined names): any type
        return {"unsupported": f"its chat template fails on one user message ({str(err).splitlines()[0]})"}
    around = {_around(r, m) for r, m in zip(renderings, marked)}
    if None in around:
        return {"unsupported": "its chat template changes a user message or writes it more than once"}
    if len(around) != 1:
        return {"unsupported": "its chat template renders the text around a user message differently for different "
                               "messages"}
    before, after = around.pop()
    if padded == before + _PADDING + marked[0] + _PADDING + after:
        mode = "as-is"
    elif padded == before + marked[0] + after:
        mode = "strip"
    else:
        return {"unsupported": "its chat template changes a user message other than by stripping whitespace"}
    pieces = _pieces(before), _pieces(after)
    if None in pieces or any(c in before + after for c in (_OPEN, _CLOSE)):
        return {"unsupported": "its chat template writes the user message or a date in a way mobilec cannot split"}
    return {"before": pieces[0], "after": pieces[1], "message": mode}


def _valid_pieces(pieces: Any) -> bool:
    return isinstance(pieces, list) and all(
        isinstance(p, str) or (isinstance(p, dict) and list(p) == ["strftime"] and isinstance(p["strftime"], str))
        for p in pieces)


def _valid(entry: Any) -> bool:
    if entry is None:
        return True
    if isinstance(entry, dict) and list(entry) == ["unsupported"]:
        return isinstance(entry["unsupported"], str)
    return (isinstance(entry, dict) and set(entry) == {"before", "after", "message"} and _valid_pieces(entry["before"])
            and _valid_pieces(entry["after"]) and entry["message"] in MESSAGE_MODES)


def render(config: dict[str, Any], message: str, now: float | None = None) -> str:
    """The prompt text for `message` from an artifact config's chat prompt entry; dates from local time `now`
    (default: the current time). Refuses a model without a template, or with one that could not be split, and a
    malformed entry, in one line."""
    entry = config.get("chat_prompt", "missing")
    if not _valid(entry):
        raise MobilecError("the artifact's chat_prompt entry is missing or malformed; recompile the artifact")
    if entry is None:
        raise MobilecError("this model's tokenizer has no chat template; drop --chat")
    if "unsupported" in entry:
        raise MobilecError(f"--chat cannot render this model's prompts: {entry['unsupported']}; render the prompt "
                           f"with its template yourself and pass it without --chat")
    moment = time.localtime(now)

    def text(pieces: list[Any]) -> str:
        return "".join(p if isinstance(p, str) else time.strftime(p["strftime"], moment) for p in pieces)

    body = message.strip() if entry["message"] == "strip" else message
    return text(entry["before"]) + body + text(entry["after"])
