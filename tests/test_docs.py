"""The docs cannot drift from the CLI: every command block marked runnable runs against a tiny model, and the site
builds strictly (broken links and anchors fail it). docs/architecture.md, "Runnable command blocks", is the rule."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from compiler.testing.local_rpc import free_port
from tests.helpers.tiny_models import build_model, write_gguf

ROOT = Path(__file__).resolve().parent.parent
# In the order of mkdocs.yml's nav, a reader's order: the blocks share one workspace, so a later page uses the
# artifact getting-started.md compiles.
PAGES = [ROOT / "docs" / name for name in re.findall(r"^  - [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(),
                                                     re.MULTILINE)]
MARKER = re.compile(r'^<!-- runnable(?: expect="(?P<expect>[^"]*)")? -->\n```bash\n(?P<body>.*?)^```$',
                    re.MULTILINE | re.DOTALL)
# The port the docs' `mobilec serve` examples use; each run gets a free one instead.
DOCS_PORT = "8000"
# `--chat` needs a template; this one joins the messages' text (the tiny tokenizer's letters and spaces).
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int
    body: str
    expect: str | None

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def runnable_blocks() -> list[Block]:
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for match in MARKER.finditer(text):
            blocks.append(Block(page.name, text.count("\n", 0, match.start()) + 1, match["body"], match["expect"]))
    return blocks


BLOCKS = runnable_blocks()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A directory the blocks run in (their build/ lands here), with the tiny model `--model default` becomes and
    the README (`eval --text README.md`)."""
    root = tmp_path_factory.mktemp("docs")
    model = write_gguf(build_model("llama_gqa"), root / "tiny.gguf", tokenizer=True, chat_template=CHAT_TEMPLATE)
    (root / "README.md").symlink_to(ROOT / "README.md")
    return root, model


def run_block(block: Block, workspace) -> subprocess.CompletedProcess:
    root, model = workspace
    script = block.body.replace("--model default", f"--model {model}").replace(DOCS_PORT, str(free_port()))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}
    # A session of its own, so a server the block leaves behind ends with it.
    proc = subprocess.Popen(["bash", "-c", "set -euo pipefail\n" + script], cwd=root, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, output)


def failures(block: Block, result: subprocess.CompletedProcess) -> list[str]:
    found = []
    if result.returncode != 0:
        found.append(f"exit code {result.returncode}")
    if block.expect is not None and block.expect not in result.stdout:
        found.append(f"no {block.expect!r} in the output")
    return found


def test_the_docs_have_runnable_blocks_and_no_stray_markers():
    assert sorted(PAGES) == sorted((ROOT / "docs").glob("*.md")), "every page of docs/ is in mkdocs.yml's nav"
    assert len(BLOCKS) >= 4, [str(b) for b in BLOCKS]
    markers = sum(len(re.findall(r"^<!-- runnable", page.read_text(), re.MULTILINE)) for page in PAGES)
    assert markers == len(BLOCKS), "a <!-- runnable --> marker is not followed by a ```bash block"


@pytest.mark.slow  # each block runs the CLI on a tiny model: the blocks together ~2 minutes
@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_runnable_block(block, workspace):
    result = run_block(block, workspace)
    problems = failures(block, result)
    assert not problems, f"{block}: {', '.join(problems)}\n{block.body}\n--- output ---\n{result.stdout[-4000:]}"


@pytest.mark.slow
def test_a_block_with_a_wrong_flag_fails_the_check(workspace):
    """Negative controls: the check fails on a mistyped flag in a docs command line, and on output that does not
    say what the block states."""
    line = next(line for b in BLOCKS for line in b.body.splitlines() if line.startswith("mobilec generate"))
    wrong_flag = Block("control", 1, line.replace("mobilec generate", "mobilec generate --no-such-flag", 1), None)
    assert failures(wrong_flag, run_block(wrong_flag, workspace)) == ["exit code 2"]
    as_written = Block("control", 1, line, None)  # and the same line without the flag passes (after the blocks)
    assert failures(as_written, run_block(as_written, workspace)) == []
    wrong_output = Block("control", 1, "mobilec targets\n", expect="a target that does not exist")
    assert failures(wrong_output, run_block(wrong_output, workspace)) == [
        "no 'a target that does not exist' in the output"]


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed: pip install -e '.[docs]' (scripts/setup.sh should install it)")
def test_the_site_builds_strictly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "getting-started" / "index.html").is_file()


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="mkdocs is not installed")
def test_a_broken_anchor_fails_the_build(tmp_path):
    """Negative control for the strict build: a copy of the docs with one anchor that does not exist."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for page in PAGES:
        (docs / page.name).write_text(page.read_text())
    index = docs / "index.md"
    index.write_text(index.read_text() + "\n[gone](getting-started.md#no-such-section)\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((ROOT / "mkdocs.yml").read_text())
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                             "--site-dir", str(tmp_path / "site")], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "no-such-section" in result.stderr
