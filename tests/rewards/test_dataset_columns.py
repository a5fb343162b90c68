"""A dataset's extra columns travel from the file through the task's problems to the rewards:
TRL functions get them as keyword lists, verl functions as data_source / ground_truth /
extra_info."""

import json
from pathlib import Path

from handoff.config import RewardConfig
from handoff.rewards import RewardSet, Sample
from handoff.tasks import DatasetTask

FIXTURES = Path(__file__).parent / "fixtures"


def _scored(task: DatasetTask, texts: list[str], functions: list[str], *, chat: bool):
    problems = [task.get(i) for i in range(len(texts))]
    samples = [Sample(p, list(p.messages) if chat else p.prompt, t, [0] * len(t))
               for p, t in zip(problems, texts)]
    rewards = RewardSet.from_config(RewardConfig(functions=functions), task)
    return problems, rewards.score(samples)


def test_jsonl_columns_reach_a_trl_function(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(10 + i), "difficulty": i + 1} for i in range(3)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    task = DatasetTask(path, seed=1)
    texts = ["10", "a11", "ab"]
    problems, scored = _scored(task, texts,
                               [f"{FIXTURES}/trl_rewards.py:weighted_by_difficulty",
                                f"{FIXTURES}/trl_rewards.py:answer_in_completion"], chat=False)
    difficulty = [rows[p.metadata["row"]]["difficulty"] for p in problems]
    assert scored.per_function["weighted_by_difficulty"] == tuple(
        float(d) * len(t) for d, t in zip(difficulty, texts))
    answers = [rows[p.metadata["row"]]["answer"] for p in problems]
    assert scored.per_function["answer_in_completion"] == tuple(
        float(a in t) for a, t in zip(answers, texts))
    assert 0.0 < sum(scored.per_function["answer_in_completion"]) < 3.0


def test_a_verl_parquet_reaches_compute_score_unchanged(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": f"{i} + {i}?"}], "data_source": "toy",
             "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"bonus": 0.25 * i}} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    task = DatasetTask(tmp_path / "train.parquet", answer_field="reward_model.ground_truth")
    texts = ["#### 0", "#### 2", "#### 5", "#### 6"]
    problems, scored = _scored(task, texts, [f"{FIXTURES}/verl_score.py:compute_score",
                                             "handoff:task"], chat=True)
    expected = []
    for p, text in zip(problems, texts):
        row = rows[p.metadata["row"]]
        right = text.split("####")[-1].strip() == row["reward_model"]["ground_truth"]
        expected.append(float(right) + row["extra_info"]["bonus"])
    assert scored.per_function["compute_score"] == tuple(expected)
    assert scored.correct == tuple(task.score(p, t).correct for p, t in zip(problems, texts))
