"""``infinite-llm bench`` flags: every one is documented, bad ones exit 2, an unreachable target exits 1."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from infinite_llm.cli import app
from infinite_llm.state.etcd_launcher import free_port

runner = CliRunner()


def test_every_bench_flag_has_help():
    command = typer.main.get_command(app).commands["bench"]
    names = {p.name: p.help for p in command.params}
    assert set(names) >= {
        "backend", "target", "dataset", "dataset_path", "input_len", "output_len", "range_ratio", "num_requests",
        "concurrency", "request_rate", "seed", "temperature", "ignore_eos", "timeout", "output_json", "json_output",
    }  # fmt: skip
    assert [name for name, text in names.items() if not text] == []


def test_a_file_dataset_without_a_path_exits_2():
    result = runner.invoke(app, ["bench", "--dataset", "jsonl"])
    assert result.exit_code == 2
    assert "--dataset jsonl needs --dataset-path" in result.output


def test_a_zero_request_rate_exits_2():
    result = runner.invoke(app, ["bench", "--request-rate", "0"])
    assert result.exit_code == 2
    assert "request rate must be positive (or inf), got 0.0" in result.output


def test_an_unreachable_router_exits_1_before_sending_anything():
    args = ["bench", "--target", f"127.0.0.1:{free_port()}", "--num-requests", "1", "--insecure"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "did not tokenize the prompts: Unavailable" in " ".join(result.output.split())


def test_an_input_len_the_model_cannot_take_exits_2_naming_the_flag(router_address):
    """A real router (of an 8192-token model) refuses to tokenize the text such prompts are cut from: the
    flag is at fault, not the router."""
    args = ["bench", "--target", router_address, "--num-requests", "1", "--input-len", "100000", "--insecure"]
    result = runner.invoke(app, args)
    flat = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2, result.output
    assert "Invalid value for --dataset-path / --input-len: the router refuses the prompts' text: " in flat
    assert "did not tokenize" not in flat


def test_a_jsonl_file_that_is_not_json_exits_2_naming_only_its_flag(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("not json\n")
    args = ["bench", "--dataset", "jsonl", "--dataset-path", str(path), "--target", f"127.0.0.1:{free_port()}"]
    result = runner.invoke(app, [*args, "--insecure"])
    flat = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2, result.output
    assert "Invalid value for --dataset-path: " in flat and "not JSON (Expecting value)" in flat, flat
    assert "--input-len" not in flat
