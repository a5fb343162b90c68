"""`handoff generate` end to end on a tiny checkpoint (CPU)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from handoff.cli import app


def test_generate_json_lists_every_sample(qwen3_dir, ref):
    args = ["generate", "--model", str(qwen3_dir), "--prompt", "abc", "--prompt", "hello world",
            "--max-tokens", "6", "--temperature", "0", "--n", "2", "--json", "--no-chat"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    samples = json.loads(result.stdout)
    assert [s["prompt"] for s in samples] == ["abc", "abc", "hello world", "hello world"]
    for s in samples:
        assert set(s) == {"prompt", "prompt_token_ids", "token_ids", "text", "logprobs",
                          "finish_reason"}
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


def test_a_seed_gives_each_prompt_its_own_stream_and_repeats_the_whole(qwen3_dir):
    """--seed S with the same prompt twice: the two prompts' samples differ (each prompt
    draws its own stream, as without a seed), and the same command gives the same output."""
    from handoff.rollout.cli_generate import generate_samples

    def sampled():
        return [s["token_ids"] for s in generate_samples(
            str(qwen3_dir), ["abc", "abc"], max_tokens=8, temperature=1.0, n=2, seed=5,
            chat=False, device="cpu")]

    first = sampled()
    assert first == sampled()
    assert first[0] != first[2] and first[1] != first[3]   # prompt 0's sample j vs prompt 1's


def _chat_ids(role_text: str) -> list[int]:
    """The byte tokenizer's ids of one user turn in modelzoo's ChatML template, by hand."""
    im_start, im_end = 258, 257
    return ([im_start] + list(f"user\n{role_text}".encode()) + [im_end] + list(b"\n")
            + [im_start] + list(b"assistant\n"))


def test_prompts_go_through_the_chat_template_unless_no_chat(qwen3_dir, tmp_path):
    import shutil

    from handoff.rollout.cli_generate import generate_samples

    kwargs = dict(max_tokens=2, temperature=0.0, device="cpu")
    templated = generate_samples(str(qwen3_dir), ["hi"], **kwargs)
    assert templated[0]["prompt_token_ids"] == _chat_ids("hi")
    raw = generate_samples(str(qwen3_dir), ["hi"], chat=False, **kwargs)
    assert raw[0]["prompt_token_ids"] == list(b"hi")
    # A tokenizer without a template gets the raw text, chat or not.
    plain = tmp_path / "plain"
    shutil.copytree(qwen3_dir, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    assert generate_samples(str(plain), ["hi"], **kwargs)[0]["prompt_token_ids"] == list(b"hi")


def test_a_broken_chat_template_is_one_line(qwen3_dir, tmp_path):
    import shutil

    from handoff.errors import HandoffError
    from handoff.rollout.cli_generate import generate_samples

    broken = tmp_path / "broken"
    shutil.copytree(qwen3_dir, broken)
    (broken / "chat_template.jinja").write_text("{{ raise_exception('this template refuses') }}")
    with pytest.raises(HandoffError, match=rf"^{broken}/chat_template.jinja cannot be rendered "
                                           r"\(TemplateError: this template refuses\): fix the "
                                           "template, or pass --no-chat"):
        generate_samples(str(broken), ["hi"], max_tokens=2, temperature=0.0, device="cpu")
    assert generate_samples(str(broken), ["hi"], max_tokens=2, temperature=0.0, device="cpu",
                            chat=False)


def test_a_prompt_file_gives_one_prompt_a_line(tmp_path):
    from handoff.errors import HandoffError
    from handoff.rollout.cli_generate import read_prompt_file

    file = tmp_path / "prompts.txt"
    file.write_text("2+2=\nhello world\n\n  \nWhat is 7*8?\n")
    assert read_prompt_file(str(file)) == ["2+2=", "hello world", "What is 7*8?"]
    file.write_bytes(b"\xff\xfe not utf-8")
    with pytest.raises(HandoffError, match="cannot be read .*: pass a UTF-8 text file"):
        read_prompt_file(str(file))


def test_a_prompt_and_max_tokens_past_the_models_positions_are_noted(qwen3_dir):
    """The engine ends such samples at the position limit: generate says so, not only
    finish_reason 'length'."""
    positions = json.loads((qwen3_dir / "config.json").read_text())["max_position_embeddings"]
    prompt = "x" * (positions - 10)   # the byte tokenizer: a token a byte
    args = ["generate", "--model", str(qwen3_dir), "--prompt", prompt, "--max-tokens", "40",
            "--temperature", "0", "--no-chat", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"max_position_embeddings={positions}" in result.stderr
    sample = json.loads(result.stdout)[0]
    assert len(sample["token_ids"]) < 40 and sample["finish_reason"] == "length"
    short = CliRunner().invoke(app, [*args[:4], "hi", *args[5:]])
    assert short.exit_code == 0 and "max_position_embeddings" not in short.stderr
