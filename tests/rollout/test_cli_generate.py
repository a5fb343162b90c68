"""`handoff generate` end to end on a tiny checkpoint (CPU)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from handoff.cli import app


def test_generate_json_lists_every_sample(qwen3_dir, ref):
    args = ["generate", "--model", str(qwen3_dir), "--prompt", "abc", "--prompt", "hello world",
            "--max-tokens", "6", "--temperature", "0", "--n", "2", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    samples = json.loads(result.stdout)
    assert [s["prompt"] for s in samples] == ["abc", "abc", "hello world", "hello world"]
    for s in samples:
        assert set(s) == {"prompt", "token_ids", "text", "logprobs", "finish_reason"}
        assert len(s["token_ids"]) == len(s["logprobs"]) <= 6
        assert s["finish_reason"] in ("stop", "length")
    prompt_ids = list("abc".encode())  # the byte-level tokenizer: ids are the bytes
    assert samples[0]["token_ids"] == ref.greedy(qwen3_dir, prompt_ids, 6)[:len(samples[0]["token_ids"])]
    assert samples[0]["token_ids"] == samples[1]["token_ids"]  # greedy: both samples agree


def test_generate_plain_output_and_friendly_error(qwen3_dir, tmp_path):
    result = CliRunner().invoke(app, ["generate", "--model", str(qwen3_dir), "--prompt", "hi",
                                      "--max-tokens", "3", "--seed", "1"])
    assert result.exit_code == 0 and "'hi' ->" in result.stdout
    result = CliRunner().invoke(app, ["generate", "--model", str(tmp_path), "--prompt", "hi"])
    assert result.exit_code == 2 and "config.json" in result.output
