"""`mobilec serve`'s options: each bad value is one line naming it, before anything loads."""

import pytest
from click.testing import CliRunner

from compiler.commands.cli import main


@pytest.mark.parametrize("args,needle", [
    (["--max-sessions", "9"], "--max-sessions must be at most 8"),
    (["--max-sessions", "0"], "--max-sessions must be at least 1"),
    (["--port", "0"], "--port must be at least 1"),
    (["--port", "70000"], "--port must be at most 65535"),
    (["--max-queue", "0"], "--max-queue must be at least 1"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be a positive number"),
    (["--api-key", " "], "--api-key is empty"),
    ([], "does not exist"),
])
def test_bad_option_is_one_line(tmp_path, args, needle):
    result = CliRunner().invoke(main, ["serve", str(tmp_path / "no-artifact"), *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mobilec: error: ") and needle in lines[0], result.stderr


def test_help_names_the_endpoints():
    text = CliRunner().invoke(main, ["serve", "--help"]).output
    for needle in ("/v1/chat/completions", "/v1/completions", "/metrics", "--max-sessions", "--api-key"):
        assert needle in text
