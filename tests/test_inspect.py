"""`mobilec inspect`'s summary: the kernel launches of one decode step and of one prefill chunk, per layer, as its
table and its JSON say them (the counting itself: tests/passes/test_chain_kernels.py)."""

import json
import re

from click.testing import CliRunner

from compiler.commands.cli import main
from tests.helpers.tiny_models import build_model, save_compilable_checkpoint


def test_inspect_reports_decode_and_prefill_launches_per_layer(tmp_path):
    model = build_model("llama_gqa")
    checkpoint = save_compilable_checkpoint(model, tmp_path / "hf")
    args = ["inspect", "--model", str(checkpoint), "--target", "host", "--quant", "q0f32", "--context-window", "64"]
    table = CliRunner().invoke(main, args)
    assert table.exit_code == 0, table.output
    rows = json.loads(CliRunner().invoke(main, [*args, "--json"]).stdout)
    last, layers = rows[-1], model.config.num_hidden_layers
    for function, unit in (("decode", "token"), ("prefill", "prompt chunk")):
        launches = last[f"{function}_launches"]
        assert launches > layers and last[f"{function}_launches_per_layer"] == launches / layers
        line = re.search(rf"^{function}: (\d+) kernel launches per {unit}, ([\d.]+) per layer", table.output, re.M)
        assert line and int(line[1]) == launches and float(line[2]) == round(launches / layers, 1), table.output
    # both chained, prefill also launches its shapes' host function (negative control on the two counts being one)
    assert last["decode_launches"] < last["prefill_launches"]
