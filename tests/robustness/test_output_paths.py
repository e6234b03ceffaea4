"""Output paths never cost a user a file: `compile --output` writes only into a new path, an empty directory or an
artifact (replaced only with --overwrite, and only when nothing else is in it); `inspect --dump` and
`--json`/`--plot` follow the same rule for their own kind of output. Refusals are one line, come before anything
is loaded or built, and leave every file and directory as it was; the valid cases still work."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from compiler import validate
from compiler.artifacts.artifact import CONFIG_FILE, load_artifact
from compiler.artifacts.export import atomic_directory
from compiler.errors import MobilecError
from tests.robustness.conftest import CONTEXT, one_line_error, run_cli

pytestmark = pytest.mark.slow  # compiles into each kind of output path: ~1.5 minutes


def _compile(checkpoint, out, *extra):
    return run_cli(["compile", "--model", checkpoint, "--quant", "q0f32", "--context-window", CONTEXT, "-o", out,
                    "--json", *extra])


def _tree(root):
    """Every path below root with its bytes (files) or None (directories): what must not change."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _assert_no_leftovers(parent):
    assert not [p.name for p in parent.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_directory_of_user_files_is_refused_and_untouched(tiny_checkpoint, tmp_path):
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("precious")
    (mine / "sub" / "data.bin").write_bytes(b"\0\1")
    before = _tree(mine)
    started = time.monotonic()
    one_line_error(_compile(tiny_checkpoint, mine), "--output", "not a mobilec artifact", "notes.txt")
    assert time.monotonic() - started < 20  # refused before the model is imported or anything built
    assert _tree(mine) == before
    _assert_no_leftovers(tmp_path)


def test_dot_in_a_non_empty_current_directory_is_refused(tiny_checkpoint, tmp_path, monkeypatch):
    (tmp_path / "keep.py").write_text("print('mine')")
    monkeypatch.chdir(tmp_path)
    one_line_error(_compile(tiny_checkpoint, "."), "--output .", "keep.py")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.py"]


def test_regular_file_is_refused_and_kept(tiny_checkpoint, tmp_path):
    target = tmp_path / "report.txt"
    target.write_text("mine")
    one_line_error(_compile(tiny_checkpoint, target), "existing file", "report.txt")
    assert target.read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.txt"]  # no hidden .report.txt.old-*


def test_path_below_a_file_is_refused(tiny_checkpoint, tmp_path):
    (tmp_path / "f").write_text("x")
    one_line_error(_compile(tiny_checkpoint, tmp_path / "f" / "out"), "not a directory")
    assert (tmp_path / "f").read_text() == "x"


def test_existing_artifact_needs_overwrite_and_no_foreign_files(tiny_checkpoint, artifact_copy, tmp_path):
    before = _tree(artifact_copy)
    one_line_error(_compile(tiny_checkpoint, artifact_copy), "already holds a mobilec artifact", "--overwrite")
    assert _tree(artifact_copy) == before
    (artifact_copy / "my-notes.md").write_text("mine")
    one_line_error(_compile(tiny_checkpoint, artifact_copy, "--overwrite"), "other files", "my-notes.md")
    assert (artifact_copy / "my-notes.md").read_text() == "mine"
    (artifact_copy / "tokenizer" / "extra.txt").write_text("mine too")  # below the top level as well
    (artifact_copy / "my-notes.md").unlink()
    one_line_error(_compile(tiny_checkpoint, artifact_copy, "--overwrite"), "tokenizer/extra.txt")
    _assert_no_leftovers(tmp_path)


def test_a_directory_that_only_looks_like_an_artifact_is_not_one(tiny_checkpoint, tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / CONFIG_FILE).write_text("not json")
    one_line_error(_compile(tiny_checkpoint, fake, "--overwrite"), "not a mobilec artifact")
    assert (fake / CONFIG_FILE).read_text() == "not json"


def test_unwritable_places_are_one_line(tiny_checkpoint, tmp_path):
    # procfs refuses a new directory even to root: the real OSError, turned into one line
    one_line_error(_compile(tiny_checkpoint, "/proc/mobilec-no-such/out"), "cannot write --output")


@contextlib.contextmanager
def _read_only_directory(path):
    """A directory nobody may write: mode 0555 for a normal user; for root (who ignores modes) a read-only bind
    mount of it."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"root cannot bind-mount here: {mounted.stderr.decode().strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True, capture_output=True)
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False, capture_output=True)


def test_read_only_directory_is_one_line(tiny_checkpoint, tmp_path):
    with _read_only_directory(tmp_path / "locked") as locked:
        one_line_error(_compile(tiny_checkpoint, locked / "out"), "cannot write --output", "not writable")
        # an empty read-only directory given itself, and the real OSError when the pre-check cannot see it
        one_line_error(_compile(tiny_checkpoint, locked), "cannot write --output", "not writable")
        assert list(locked.iterdir()) == []


def test_empty_directory_is_filled_in_place_with_umask_permissions(tiny_checkpoint, tmp_path, monkeypatch):
    """The valid cases: an empty current directory (`-o .`) is filled, the directory itself kept; permissions
    follow the umask (not the private temporary directory's 0700); --overwrite then replaces the artifact."""
    empty = tmp_path / "empty"
    empty.mkdir()
    inode = empty.stat().st_ino
    monkeypatch.chdir(empty)
    old_umask = os.umask(0o027)
    try:
        result = _compile(tiny_checkpoint, ".")
    finally:
        os.umask(old_umask)
    assert result.exit_code == 0, result.output
    assert empty.stat().st_ino == inode and (empty / CONFIG_FILE).is_file()
    for sub in ("lib", "params", "tokenizer"):
        assert stat.S_IMODE((empty / sub).stat().st_mode) == 0o750, sub
    load_artifact(empty)
    created = json.loads((empty / CONFIG_FILE).read_text())["created"]

    out = tmp_path / "new"
    old_umask = os.umask(0o022)
    try:
        assert _compile(tiny_checkpoint, out).exit_code == 0
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755  # the renamed temporary directory itself
    time.sleep(1.1)  # "created" has whole seconds
    result = _compile(tiny_checkpoint, out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert json.loads((out / CONFIG_FILE).read_text())["created"] != created
    load_artifact(out)
    _assert_no_leftovers(tmp_path)


def test_output_rule_is_checked_again_when_the_compile_ends(tmp_path):
    """A user file appearing in the (empty) output while a compile runs is not replaced either."""
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(MobilecError, match="not a mobilec artifact"), atomic_directory(out) as tmp:
        (tmp / "lib").mkdir()
        (out / "arrived.txt").write_text("mine")
    assert sorted(p.name for p in out.iterdir()) == ["arrived.txt"]
    _assert_no_leftovers(tmp_path)


def test_inspect_dump_refuses_user_files_and_replaces_only_its_own(tiny_checkpoint, tmp_path):
    mine = tmp_path / "scripts"
    mine.mkdir()
    (mine / "01-intro.py").write_text("print('lesson one')\n")  # named like a dump file, but not TVMScript
    one_line_error(run_cli(["inspect", "--model", tiny_checkpoint, "--quant", "q0f32", "--dump", mine]),
                   "--dump", "not an IR dump")
    assert (mine / "01-intro.py").read_text() == "print('lesson one')\n"
    dump = tmp_path / "ir"
    result = run_cli(["inspect", "--model", tiny_checkpoint, "--quant", "q0f32", "--context-window", CONTEXT,
                      "--dump", dump, "--json"])
    assert result.exit_code == 0, result.output
    first = sorted(p.name for p in dump.iterdir())
    assert first[0].startswith("00-import")
    # an earlier dump is ours: replaced without a flag; a user's file put in it makes it not ours alone
    (dump / "mine.txt").write_text("x")
    one_line_error(run_cli(["inspect", "--model", tiny_checkpoint, "--dump", dump]), "other files", "mine.txt")
    (dump / "mine.txt").unlink()
    (dump / "99-stale.py").write_text("# from tvm.script import ir as I\n")
    result = run_cli(["inspect", "--model", tiny_checkpoint, "--quant", "q0f32", "--context-window", CONTEXT,
                      "--dump", dump, "--pass", "import", "--json"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in dump.iterdir()) == [first[0]]


@pytest.mark.parametrize("kind, good, bad", [("png", b"\x89PNG\r\n\x1a\n....", b"GIF89a")])
def test_result_files_replace_only_their_own_kind(tmp_path, kind, good, bad):
    mine = tmp_path / f"mine.{kind}"
    mine.write_bytes(bad)
    with pytest.raises(MobilecError, match="is not a"):
        validate.output_file(mine, f"--{kind}", kind)
    assert mine.read_bytes() == bad
    previous = tmp_path / f"previous.{kind}"
    previous.write_bytes(good)
    assert validate.output_file(previous, f"--{kind}", kind) == previous  # negative control: replaced
    assert validate.output_file(tmp_path / f"new.{kind}", f"--{kind}", kind) == tmp_path / f"new.{kind}"
    with pytest.raises(MobilecError, match="is a directory"):
        validate.output_file(tmp_path, f"--{kind}", kind)


def test_bench_plot_into_a_user_file_is_refused_before_running(tiny_artifact, tmp_path):
    notes = tmp_path / "notes.md"
    notes.write_text("# mine\n")
    started = time.monotonic()
    one_line_error(run_cli(["bench", tiny_artifact, "--sustained", "1", "--plot", notes]), "--plot", "not a PNG")
    assert time.monotonic() - started < 10 and notes.read_text() == "# mine\n"


def test_scripts_that_recompile_pass_overwrite():
    text = (Path(__file__).resolve().parents[2] / "scripts" / "quickstart.sh").read_text()
    assert "--output build/smollm2-host --overwrite" in text
