"""compiler/model_import/chat_prompt.py: the chat prompt split at compile time renders what transformers renders from
the template itself, for released models' templates (tests/data/chat_templates) and SmolLM2's; templates it cannot
split are refused, not rendered wrong."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from unittest import mock

import pytest

from compiler.artifacts.artifact import load_artifact
from compiler.errors import MobilecError
from compiler.model_import import chat_prompt

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
TEMPLATE_FILES = sorted(TEMPLATES.glob("*.jinja"))
MESSAGES = [
    "What is the capital of France?",
    "  leading and trailing spaces  ",
    "\n\tnew lines and tabs\n\n",
    "\u00a0no-break and ideographic spaces\u3000",
    "Unicode: 你好, мир, 🙂, e\u0301",
    "Jinja-looking text: {{ messages }} {% if x %}y{% endif %} {# c #}",
    "<|im_end|> special-looking text <|eot_id|> [INST]",
    "line one\nline two\n",
    "",
]
# Local noon on a fixed day: the date a template asks for (strftime_now) must come from the clock at render time
FIXED_NOW = time.mktime((2026, 3, 5, 12, 0, 0, 0, 0, -1))


def _tokenizer(template: str | None):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
                                        bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    tokenizer.chat_template = template
    return tokenizer


def _transformers_rendering(tokenizer, message: str, now: float) -> str:
    """What transformers renders from the template itself, its clock set to `now`."""
    from transformers.utils import chat_template_utils

    class Clock(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.datetime.fromtimestamp(now, tz)

    with mock.patch.object(chat_template_utils, "datetime", Clock):
        return tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                             tokenize=False)


def _config(template: str | None) -> dict:
    entry = chat_prompt.split(_tokenizer(template))
    return {"chat_prompt": json.loads(json.dumps(entry))}  # as an artifact's config holds it


@pytest.mark.parametrize("path", TEMPLATE_FILES, ids=lambda p: p.stem)
def test_split_renders_what_transformers_renders(path):
    template = path.read_text()
    config = _config(template)
    assert "unsupported" not in config["chat_prompt"], config["chat_prompt"]
    tokenizer = _tokenizer(template)
    for message in MESSAGES:
        assert chat_prompt.render(config, message, FIXED_NOW) == _transformers_rendering(tokenizer, message, FIXED_NOW)


# How each released template treats the message and whether it asks for today's date, as read from the templates
EXPECTED = {
    "Qwen-Qwen2.5-7B-Instruct": ("as-is", False),
    "Qwen-Qwen3-0.6B": ("as-is", False),
    "meta-llama-Llama-3.1-8B-Instruct": ("strip", False),  # its date is a fixed default string
    "meta-llama-Llama-3.2-3B-Instruct": ("strip", True),
    "microsoft-Phi-3.5-mini-instruct": ("as-is", False),
    "google-gemma-2-2b-it": ("strip", False),
    "mistralai-Mistral-Nemo-Instruct-2407": ("as-is", False),
    "ibm-granite-granite-3.3-2B-Instruct": ("as-is", True),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("as-is", False),
}


def test_every_template_file_has_its_expectation():
    assert sorted(p.stem for p in TEMPLATE_FILES) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_message_mode_and_date(name):
    entry = _config((TEMPLATES / f"{name}.jinja").read_text())["chat_prompt"]
    mode, dated = EXPECTED[name]
    assert entry["message"] == mode
    dates = [p for p in entry["before"] + entry["after"] if isinstance(p, dict)]
    assert bool(dates) == dated
    if dated:  # the date is rendered when the prompt is, not frozen at compile time
        other_day = FIXED_NOW + 40 * 86400
        config = {"chat_prompt": entry}
        assert chat_prompt.render(config, "hi", FIXED_NOW) != chat_prompt.render(config, "hi", other_day)
        assert time.strftime(dates[0]["strftime"], time.localtime(other_day)) in chat_prompt.render(config, "hi",
                                                                                                  other_day)


def test_strip_is_pythons_strip():
    """Jinja's trim is str.strip: the Unicode spaces go too, and only whitespace."""
    config = _config((TEMPLATES / "google-gemma-2-2b-it.jinja").read_text())
    rendered = chat_prompt.render(config, "\u3000\u00a0\u2028 x y \u200b\n", FIXED_NOW)
    assert "user\nx y \u200b<end_of_turn>" in rendered  # U+200B is not whitespace to Python


BAD_TEMPLATES = {
    "changes the message": ("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}", "changes a user message or writes it more than once"),
    "depends on the message": ("{% for m in messages %}{% if 'x' in m['content'] %}X:{% endif %}{{ m['content'] }}"
                               "{% endfor %}", "differently for different messages"),
    "writes it twice": ("{% for m in messages %}{{ m['content'] }}|{{ m['content'] }}{% endfor %}",
                        "writes it more than once"),
    "strips one side": ("{% for m in messages %}[{{ m['content'].lstrip() }}]{% endfor %}", "other than by stripping"),
    "raises": ("{{ raise_exception('only system messages') }}", "fails on one user message (only system messages)"),
}


@pytest.mark.parametrize("name", sorted(BAD_TEMPLATES))
def test_templates_it_cannot_split_are_refused(name):
    template, reason = BAD_TEMPLATES[name]
    config = _config(template)
    assert reason in config["chat_prompt"]["unsupported"]
    with pytest.raises(MobilecError, match="--chat cannot render this model's prompts: .*without --chat"):
        chat_prompt.render(config, "hi")


def test_no_template_and_malformed_entries():
    assert chat_prompt.split(_tokenizer(None)) is None
    with pytest.raises(MobilecError, match="has no chat template; drop --chat"):
        chat_prompt.render({"chat_prompt": None}, "hi")
    good = _config("{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}<a>")["chat_prompt"]
    assert chat_prompt.render({"chat_prompt": good}, "hi") == "<u>hi</u><a>"
    for bad in [{}, {"chat_prompt": {**good, "message": "lower"}}, {"chat_prompt": {**good, "before": ["x", 3]}},
                {"chat_prompt": {**good, "after": [{"strftime": "%Y", "x": 1}]}}, {"chat_prompt": "text"}]:
        with pytest.raises(MobilecError, match="chat_prompt entry is missing or malformed.*recompile"):
            chat_prompt.render(bad, "hi")


def test_smollm2_artifact_chat_prompt_equals_transformers(smollm2_q0f32):
    """The compiled artifact carries the split of SmolLM2's own template; its prompt ids are transformers'."""
    from compiler.loaders.tokenizer import load_tokenizer
    from compiler.runtime.generate import prompt_token_ids

    artifact = load_artifact(smollm2_q0f32)
    tokenizer = load_tokenizer(artifact.tokenizer_dir)
    assert artifact.config["chat_prompt"]["before"][0].startswith("<|im_start|>system\n")
    for message in MESSAGES[:4]:
        expected = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
        assert prompt_token_ids(tokenizer, message, True, artifact.config) == list(expected)
