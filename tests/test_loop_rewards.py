"""Rewards you write, trained with: a TRL-style file, a verl-style one and one of TRL's own
shipped rewards train the tiny model unchanged; the rows log what they returned; the
dataset's extra columns reach them; a reward that fails stops the run with one line and the
run resumes once it is fixed."""

import gc
import json

import pytest

import handoff
from handoff.config import load_config
from handoff.errors import HandoffError
from handoff.modelzoo import init_model

# The user's files, as they would write them. Each appends what it returned to a log so the
# test can compare the run's rows with the functions' own values.
TRL_FILE = '''
import json, os

def digits_times_difficulty(prompts, completions, completion_ids, difficulty, answer,
                            **kwargs):
    values = [float(sum(ch.isdigit() for ch in c)) * d
              for c, d in zip(completions, difficulty)]
    if os.environ.get("HANDOFF_TEST_BREAK") and kwargs["trainer_state"].global_step == 1:
        values[2] = float("nan")
    with open(os.environ["HANDOFF_TEST_LOG"], "a") as f:
        f.write(json.dumps({"fn": "trl", "values": values, "answer": answer,
                            "step": kwargs["trainer_state"].global_step}) + "\\n")
    return values
'''
VERL_FILE = '''
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    score = 1.0 if str(ground_truth) in solution_str else 0.0
    score += extra_info.get("bonus", 0.0) if data_source == "mine" else 0.0
    with open(os.environ["HANDOFF_TEST_LOG"], "a") as f:
        f.write(json.dumps({"fn": "verl", "value": score}) + "\\n")
    return {"score": score}
'''


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("tiny-qwen3", tmp_path_factory.mktemp("rewards-model"), dtype="float32")


@pytest.fixture()
def user_files(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(TRL_FILE)
    (tmp_path / "verl_reward.py").write_text(VERL_FILE)
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b), "difficulty": 1 + a % 3,
             "data_source": "mine", "extra_info": {"bonus": 0.5}} for a, b in
            [(1, 2), (3, 4), (2, 2), (5, 1), (0, 7), (6, 2), (4, 4), (1, 1)]]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("HANDOFF_TEST_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    gc.unfreeze()


def _cfg(model_dir, out_dir, *extra):
    return load_config(_example(),
                       [f"model.path={model_dir}", f"run.out_dir={out_dir}",
                        "data.task=file", "data.path=data.jsonl", "actor.kl_coef=0", "data.chat_template=false",
                        "run.checkpoint=true", "run.save_every=1", *extra])


def _example():
    from pathlib import Path
    return str(Path(__file__).resolve().parents[1] / "examples" / "cpu-tiny.yaml")


def _calls(tmp_path):
    return [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]


def test_trl_verl_and_trls_own_rewards_train_unchanged_and_their_values_are_logged(
        model_dir, user_files):
    from trl.rewards import get_soft_overlong_punishment

    overlong = get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)
    cfg = _cfg(model_dir, user_files / "run", "reward.functions=[my_rewards.py:"
               "digits_times_difficulty,verl_reward.py:compute_score]",
               "reward.weights=[0.5,2.0,1.0]")
    handoff.train(cfg, reward_funcs=[overlong])
    rows = [json.loads(line) for line in (user_files / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    calls = _calls(user_files)
    trl_calls = [c for c in calls if c["fn"] == "trl"]
    verl_values = [c["value"] for c in calls if c["fn"] == "verl"]
    assert [c["step"] for c in trl_calls] == [0, 1]          # once a step, TRL's way
    samples = len(trl_calls[0]["values"])
    assert samples == 16 and len(verl_values) == 2 * samples  # verl: once a sample
    # The dataset's extra columns reached the TRL function, one value per sample.
    assert set(trl_calls[0]["answer"]) <= {"3", "7", "4", "6", "8", "2"}
    for step, row in enumerate(rows):
        trl_mean = sum(trl_calls[step]["values"]) / samples
        verl_mean = sum(verl_values[step * samples:(step + 1) * samples]) / samples
        assert row["reward/digits_times_difficulty"] == pytest.approx(trl_mean)
        assert row["reward/compute_score"] == pytest.approx(verl_mean)
        # The weighted sum is what the run trains on (means are linear in it).
        assert row["reward_mean"] == pytest.approx(
            0.5 * trl_mean + 2.0 * verl_mean + row["reward/soft_overlong_punishment_reward"])
        assert row["timing_s/reward"] > 0


def test_a_reward_that_returns_nan_stops_with_one_line_and_the_run_resumes(
        model_dir, user_files, monkeypatch):
    cfg = _cfg(model_dir, user_files / "run",
               "reward.functions=[my_rewards.py:digits_times_difficulty]")
    monkeypatch.setenv("HANDOFF_TEST_BREAK", "1")
    with pytest.raises(HandoffError) as e:
        handoff.train(cfg)
    line = str(e.value)
    assert "\n" not in line and "digits_times_difficulty" in line and "nan" in line.lower()
    assert "sample 2" in line
    metrics = user_files / "run" / "metrics.jsonl"
    assert [json.loads(r)["step"] for r in metrics.read_text().splitlines()] == [1]
    gc.unfreeze()
    monkeypatch.delenv("HANDOFF_TEST_BREAK")
    handoff.train(_cfg(model_dir, user_files / "run",
                       "reward.functions=[my_rewards.py:digits_times_difficulty]"),
                  resume=True)
    assert [json.loads(r)["step"] for r in metrics.read_text().splitlines()] == [1, 2]


FORMS_FILE = '''
import json, os

def forms(prompts, completions, **kwargs):
    with open(os.environ["HANDOFF_TEST_LOG"], "a") as f:
        f.write(json.dumps({"fn": "forms", "prompt": prompts[0], "completion": completions[0]})
                + "\\n")
    return [0.0] * len(completions)
'''


def test_trl_functions_get_the_datas_form_whatever_the_chat_template(model_dir, user_files):
    """As TRL passes them: text prompts give text completions, chat-message prompts give
    assistant messages; the chat template renders both for the model and changes neither."""
    from handoff.model_files import load_tokenizer

    assert load_tokenizer(model_dir).chat_template   # the template is on
    (user_files / "forms.py").write_text(FORMS_FILE)
    chat_rows = [{"prompt": [{"role": "user", "content": f"What is {a} + 1?"}],
                  "answer": str(a + 1)} for a in range(8)]
    (user_files / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_rows))
    for data, out in (("data.jsonl", "text"), ("chat.jsonl", "chat")):
        handoff.train(_cfg(model_dir, user_files / out, "data.chat_template=true",
                           f"data.path={data}", "run.steps=1", "run.checkpoint=false",
                           "reward.functions=[forms.py:forms]"))
    text, chat = [c for c in _calls(user_files) if c["fn"] == "forms"]
    assert isinstance(text["prompt"], str) and isinstance(text["completion"], str)
    assert chat["prompt"][-1]["role"] == "user"
    assert [m["role"] for m in chat["completion"]] == ["assistant"]
    assert isinstance(chat["completion"][0]["content"], str)


def test_a_prompt_only_dataset_trains_with_your_own_reward_and_refuses_a_grader(model_dir,
                                                                              user_files):
    """TRL takes datasets of prompts alone (format, length, judge rewards): with
    data.answer_field=null so does a run; a grader, which needs the answers, is refused."""
    (user_files / "forms.py").write_text(FORMS_FILE)
    rows = [{"prompt": f"Say something about {a}."} for a in range(8)]
    (user_files / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    only = ("data.path=prompts.jsonl", "data.answer_field=null", "run.steps=1",
            "run.checkpoint=false")
    summary = handoff.train(_cfg(model_dir, user_files / "own", *only,
                                 "reward.functions=[forms.py:forms]"))
    assert summary["steps"] == 1 and [c["fn"] for c in _calls(user_files)] == ["forms"]
    for extra in ("reward.functions=[handoff:numeric]", "reward.functions=[]"):
        with pytest.raises(HandoffError, match="data.answer_field is null"):
            handoff.train(_cfg(model_dir, user_files / "graded", *only, extra))
        assert not (user_files / "graded").exists()
