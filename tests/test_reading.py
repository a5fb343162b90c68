"""Files a run or `handoff report` reads, read defensively (issue 33): malformed, huge, deeply
nested, non-finite or wrongly typed content is one line naming the file and the field; a
YAML config's size and alias expansion are bounded."""

import json

import pytest
from typer.testing import CliRunner

from handoff.calibrate import Rates
from handoff.cli import app
from handoff.config import load_config
from handoff.errors import ConfigError, HandoffError
from handoff.model_files import check_model_dir
from handoff.reading import expect, parse_json, read_json, read_yaml
from wrapped_text import flat

runner = CliRunner()

BAD_JSON = {
    "truncated": (b'{"a": [1, 2', "is not valid JSON"),
    "not utf-8": (b'{"a": "\xff\xfe"}', "is not UTF-8 text"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, "nests deeper than"),
    "deep within python's limit": (b"[" * 200 + b"]" * 200, "field .* nests deeper than 64"),
    "NaN": (b'{"a": NaN}', "NaN is not a finite number"),
    "Infinity": (b'{"a": [1, -Infinity]}', "-Infinity is not a finite number"),
    "1e999": (b'{"a": 1e999}', "1e999 is not a finite number"),
    "5000 digits": (b'{"a": ' + b"9" * 5000 + b"}", "holds a number that is not usable"),
    "a list": (b"[1, 2]", "holds a JSON list, not a JSON object"),
}



@pytest.mark.parametrize("case", sorted(BAD_JSON))
def test_bad_json_is_one_line_naming_the_file(tmp_path, case):
    content, match = BAD_JSON[case]
    path = tmp_path / "meta.json"
    path.write_bytes(content)
    with pytest.raises(HandoffError, match=match) as err:
        read_json(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_file_past_its_size_cap_is_refused_before_parsing(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"pad": "x" * 2000}))
    with pytest.raises(HandoffError, match=r"summary.json' is 0.0 MB, more than the 0 MB"):
        read_json(path, max_bytes=1000)
    assert read_json(path, max_bytes=5000)["pad"] == "x" * 2000


def test_expect_names_the_field_and_the_type(tmp_path):
    src = "x/config.json"
    assert expect({"n": 3}, "n", int, source=src) == 3
    assert expect({}, "n", int, source=src, default=7) == 7
    with pytest.raises(HandoffError, match="x/config.json lacks the field 'n'"):
        expect({}, "n", int, source=src)
    with pytest.raises(HandoffError, match="field 'n' is True, not a whole number"):
        expect({"n": True}, "n", int, source=src)
    with pytest.raises(HandoffError, match="field 'n' is '3', not a whole number or number"):
        expect({"n": "3"}, "n", (int, float), source=src)
    with pytest.raises(HandoffError, match="field 'n' is -1, below 0"):
        expect({"n": -1}, "n", int, source=src, lo=0)
    with pytest.raises(HandoffError, match=r"line 3: field a\.b\[1\] nests deeper than 2"):
        from handoff.reading import check_tree
        check_tree(parse_json('{"a": {"b": [0, [1]]}}', source="m.jsonl line 3"),
                   "m.jsonl line 3", max_depth=2)


def _yaml(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_a_billion_laughs_yaml_is_refused_before_it_expands(tmp_path):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 12)]
    with pytest.raises(ConfigError, match="more than 100 aliases"):
        load_config(_yaml(tmp_path, "\n".join(levels) + "\n"))
    # Fewer aliases, still a billion values when expanded: the walk stops at its cap.
    few = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    few += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, "
            f"*a{i - 1}, *a{i - 1}, *a{i - 1}]" for i in range(1, 10)]
    assert sum(line.count("*") for line in few) == 81
    with pytest.raises(ConfigError, match="holds more than 100000 values"):
        load_config(_yaml(tmp_path, "\n".join(few) + "\n"))


@pytest.mark.parametrize("text,match", [
    ("run:\n  steps: 3\n" + "# pad\n" * 300_000, "is 1.8 MB, more than the 1 MB"),
    ("a: " + "[" * 100_000 + "]" * 100_000 + "\n", "nests deeper than"),
    ("a: " + "[" * 70 + "]" * 70 + "\n", "nests deeper than 64 levels"),
    ("run:\n  seed: " + "9" * 5000 + "\n", "holds a value that is not usable"),
    ("run: [1, 2\n", "is not valid YAML"),
])
def test_a_yaml_config_that_is_huge_deep_or_broken_is_one_line(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_config(_yaml(tmp_path, text))
    assert "run.yaml" in str(err.value) and "\n" not in str(err.value)


def test_yaml_keeps_anchors_a_config_uses_and_non_finite_values_for_the_fields(tmp_path):
    ok = _yaml(tmp_path, "rollout: &r {n: 4}\nrun: {steps: 3}\n")
    assert read_yaml(ok)["rollout"] == {"n": 4}
    with pytest.raises(ConfigError, match="actor.lr='nan' is not a finite number|actor.lr=nan"):
        load_config(_yaml(tmp_path, "actor:\n  lr: .nan\n"))


def test_a_key_given_twice_is_refused_naming_both_lines_and_a_merge_still_overrides(tmp_path):
    with pytest.raises(ConfigError, match=r"key 'lr' appears twice, lines 2 and 3: keep one"):
        load_config(_yaml(tmp_path, "actor:\n  lr: 1.0e-5\n  lr: 1.0e-3\n"))
    merged = read_yaml(_yaml(tmp_path, "base: &b {n: 4, max_tokens: 8}\n"
                                       "rollout: {<<: *b, n: 2}\n"))
    assert merged["rollout"] == {"n": 2, "max_tokens": 8}


@pytest.mark.parametrize("file", ["config.json", "generation_config.json", "tokenizer.json",
                                  "tokenizer_config.json"])
@pytest.mark.parametrize("content,match", [
    (b'{"vocab_size": 320,', "is not valid JSON"),
    (b'{"eos_token_id": Infinity}', "Infinity is not a finite number"),
    (b"[" * 100 + b"]" * 100, "nests deeper than 64"),
    (b'"just a string"', "holds a JSON str, not a JSON object"),
])
def test_a_damaged_model_file_is_named_by_train_and_generate(model, tmp_path, file, content,
                                                            match):
    (model / file).write_bytes(content)
    with pytest.raises(HandoffError, match=match) as err:
        check_model_dir(model)
    assert file in str(err.value)
    res = runner.invoke(app, ["generate", "--model", str(model), "--prompt", "hi"],
                        terminal_width=400)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and file in lines[0], res.output


def _run_dir(tmp_path, summary: bytes | None, reward=0.5):
    row = {"step": 1, "reward_mean": reward, "response_length": 3.0, "timing_s/gen": 0.1,
           "timing_s/step": 0.5}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    if summary is not None:
        (tmp_path / "summary.json").write_bytes(summary)
    return tmp_path


@pytest.mark.parametrize("summary,said", [
    (b'{"planned": ', "summary.json is not valid JSON"),
    (b'{"planned": NaN}', "NaN is not a finite number"),
    (b"[" * 100 + b"]" * 100, "nests deeper than 64"),
    (b"[]", "holds a JSON list, not a JSON object"),
    (b'{"planned": "x"}', "summary.json is damaged (field"),
])
def test_report_names_a_damaged_summary_and_shows_the_metrics(tmp_path, summary, said):
    res = runner.invoke(app, ["report", str(_run_dir(tmp_path, summary))], terminal_width=400)
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    assert flat(said) in flat(res.output) and "1 steps" in res.output


def test_report_names_a_metrics_field_of_the_wrong_type(tmp_path):
    res = runner.invoke(app, ["report", str(_run_dir(tmp_path, None, reward="high"))],
                        terminal_width=400)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "metrics.jsonl (step 1): field 'reward_mean' is 'high', not a whole number or " \
           "number" in lines[0]


@pytest.mark.parametrize("content,match", [
    (b'{"rates": {"d2h_bps": 1e9', "is not valid JSON"),
    (b'{"rates": {"d2h_bps": Infinity}}', "Infinity is not a finite number"),
    (b'{"rates": {"d2h_bps": "fast"}}', "field 'd2h_bps' is 'fast', not a whole number or number"),
    (b'{"rates": {"d2h_bps": -5.0}}', "field 'd2h_bps' is -5.0, below 0"),
    (b'{"rates": {"map_bps": 1.0}}', "holds no measured rates"),
    (b"[1]", "holds a JSON list, not a JSON object"),
])
def test_a_damaged_rates_file_is_named(tmp_path, content, match):
    path = tmp_path / "summary.json"
    path.write_bytes(content)
    with pytest.raises(HandoffError, match=match) as err:
        Rates.load(path)
    assert "run.rates_file" in str(err.value)
    path.write_text(json.dumps({"rates": {"d2h_bps": 1e9, "map_bps": 2e9}}))
    assert Rates.load(path).get("map_bps") == 2e9
