"""The native chat prompt (native/runtime/chat_prompt.cc) renders what compiler/model_import/chat_prompt.py renders from
the same artifact config entry: released models' templates (tests/data/chat_templates), dates, Python's whitespace
strip, and the same one-line refusals.

The C++ is built once per session with the system compiler into a test driver (tests/native/chat_prompt_main.cc)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from compiler.errors import MobilecError
from compiler.model_import import chat_prompt
from tests.test_chat_prompt import BAD_TEMPLATES, FIXED_NOW, MESSAGES, TEMPLATE_FILES, _config

REPO = Path(__file__).resolve().parents[2]
RUNTIME = REPO / "native" / "runtime"
COMPILER = shutil.which("g++") or shutil.which("c++")

pytestmark = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler (g++ or c++) to build the native runtime")

# Whitespace Python strips (every code point str.isspace accepts, in UTF-8 of 1 to 3 bytes) and characters it keeps
# (zero-width space, U+180E, a 4-byte emoji), at both ends of a message
STRIP_MESSAGES = [
    "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2005\u200a\u2028\u2029\u202f\u205f\u3000x y"
    "\u3000\u205f\u202f\u2029\u2028\u200a\u2005\u2000\u1680\xa0\x85 \x1f\x1e\x1d\x1c\r\x0c\x0b\n\t",
    "\u200bkept zero width\u200b", "\u180emongolian vowel separator\u180e", "🙂 emoji 🙂", " \u3000", "\U0001F600",
]


@pytest.fixture(scope="session")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tvm_ffi

    ffi_root = Path(tvm_ffi.__file__).parent
    out = tmp_path_factory.mktemp("chat_prompt_driver") / "chat_prompt_main"
    command = [COMPILER, "-std=c++17", "-O2", str(REPO / "tests" / "native" / "chat_prompt_main.cc"),
               str(RUNTIME / "chat_prompt.cc"), "-I", str(RUNTIME), "-I", str(ffi_root / "include"),
               f"-L{ffi_root / 'lib'}", "-ltvm_ffi", f"-Wl,-rpath,{ffi_root / 'lib'}", "-o", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"building the driver failed:\n{' '.join(command)}\n{result.stderr[-4000:]}"
    return out


def native_renderings(driver: Path, config: dict, messages: list[str], now: float, tmp_path: Path) -> list[str]:
    config_file = tmp_path / "mobilec-config.json"
    config_file.write_text(json.dumps(config))
    requests = "".join(json.dumps({"message": m, "now": int(now)}) + "\n" for m in messages)
    result = subprocess.run([str(driver), str(config_file)], input=requests.encode(), capture_output=True,
                            check=True, timeout=60)
    lines = result.stdout.decode().splitlines()
    assert len(lines) == len(messages)
    return [line if line.startswith("unavailable: ") else bytes.fromhex(line).decode() for line in lines]


@pytest.mark.parametrize("path", TEMPLATE_FILES, ids=lambda p: p.stem)
def test_native_renders_what_python_renders(driver, path, tmp_path):
    config = _config(path.read_text())
    messages = MESSAGES + STRIP_MESSAGES
    for now in (FIXED_NOW, FIXED_NOW + 40 * 86400):
        expected = [chat_prompt.render(config, m, now) for m in messages]
        assert native_renderings(driver, config, messages, now, tmp_path) == expected


def test_a_perturbed_entry_renders_differently(driver, tmp_path):
    """Negative control: the driver really renders the entry it is given."""
    config = _config((TEMPLATE_FILES[0]).read_text())
    config["chat_prompt"]["after"] = config["chat_prompt"]["after"] + ["!"]
    assert native_renderings(driver, config, ["hi"], FIXED_NOW, tmp_path)[0].endswith("!")
    config["chat_prompt"]["message"] = "strip"
    assert "\nhi" in native_renderings(driver, config, ["\u3000hi"], FIXED_NOW, tmp_path)[0]


def _python_refusal(config: dict) -> str:
    with pytest.raises(MobilecError) as refused:
        chat_prompt.render(config, "hi")
    return str(refused.value)


@pytest.mark.parametrize("name", sorted(BAD_TEMPLATES))
def test_unsupported_templates_refused_with_pythons_words(driver, name, tmp_path):
    config = _config(BAD_TEMPLATES[name][0])
    assert native_renderings(driver, config, ["hi"], FIXED_NOW, tmp_path) == [
        f"unavailable: {_python_refusal(config)}"]


@pytest.mark.parametrize("entry", [
    None, "missing", "text", {"unsupported": 3}, {"before": [], "after": [], "message": "lower"},
    {"before": ["a", {"strftime": 1}], "after": [], "message": "as-is"},
    {"before": [], "after": [], "message": "as-is", "extra": 1}])
def test_no_template_and_malformed_entries(driver, entry, tmp_path):
    config = {} if entry == "missing" else {"chat_prompt": entry}
    assert native_renderings(driver, config, ["hi"], FIXED_NOW, tmp_path) == [
        f"unavailable: {_python_refusal(config)}"]
