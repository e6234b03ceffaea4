"""Every command's --json is strict JSON: one function prints it (cli.echo_json), and a figure that does not exist
(NaN, an infinity) is null there, at any depth."""

import ast
import json
import math
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from compiler.commands import cli
from tests.helpers.assertions import strict_json

CLI_SOURCE = Path(cli.__file__)


def test_non_finite_figures_are_null_at_any_depth():
    result = {"decode_tok_s": math.nan, "runs": [{"tok_s": math.inf}, {"tok_s": 2.5}], "pair": (-math.inf, 1),
              "name": "x", "count": 3, "ok": True, "none": None}
    assert cli.finite_or_null(result) == {"decode_tok_s": None, "runs": [{"tok_s": None}, {"tok_s": 2.5}],
                                          "pair": [None, 1], "name": "x", "count": 3, "ok": True, "none": None}


def test_echo_json_prints_strict_json():
    @click.command()
    def figures():
        cli.echo_json({"decode_tok_s": float("nan"), "prefill_tok_s": 12.5})

    out = CliRunner().invoke(figures).stdout
    assert strict_json(out) == {"decode_tok_s": None, "prefill_tok_s": 12.5}
    with pytest.raises(AssertionError, match="NaN"):  # the negative control: Python's own json writes NaN
        strict_json(json.dumps({"decode_tok_s": float("nan")}))


def test_every_json_output_of_the_cli_goes_through_echo_json():
    """json.dumps in cli.py only inside echo_json, so no command prints JSON of its own (which could hold NaN)."""
    tree = ast.parse(CLI_SOURCE.read_text())
    owners = []
    for func in ast.walk(tree):
        if isinstance(func, ast.FunctionDef):
            for node in ast.walk(func):
                if isinstance(node, ast.Attribute) and node.attr == "dumps":
                    owners.append(func.name)
    assert owners == ["echo_json"]
