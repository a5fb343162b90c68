"""Rewards you write, in the forms you already have, mixed with the built-in graders.

    reward:
      functions: [rewards.py:accuracy, verl_score.py:compute_score, handoff:numeric]
      weights: [1.0, 0.5, 1.0]
      workers: 4

How a function is called is read from its signature (`inspect.signature`, parameter names):

* a parameter named `solution_str` makes it a verl function, `compute_score(data_source,
  solution_str, ground_truth, extra_info=None) -> float | dict` (a dict's "score"), called
  once per sample: data_source is the sample's `data_source` column (None without one),
  ground_truth its `reward_model.ground_truth`, else its `ground_truth` column, else the
  task's reference answer, and extra_info its `extra_info` column ({} without one);
* any other is a TRL function, called once per step by keyword as TRL's GRPOTrainer calls
  it: `prompts=`, `completions=`, `completion_ids=`, `trainer_state=`, `log_extra=`,
  `log_metric=` and every other dataset column as a list; completions are strings for text
  prompts and `[{"role": "assistant", "content": ...}]` for prompts the data gives as chat
  messages (TRL's conversational form; the chat template does not change it); it returns one
  float or None per sample. Callable objects count too (trl.rewards' factories);
* `handoff:task | handoff:numeric | handoff:exact` are the built-in graders (builtin.py).

Modules: loading.py (specs -> functions), calling.py (one function on the samples, its
values checked), builtin.py (the graders), reward_set.py (RewardSet: one call per step).
"""

from handoff.rewards.loading import RewardFunction, from_callable, from_spec, style_of
from handoff.rewards.reward_set import RewardSet, Sample, StepRewards, dataset_columns

__all__ = ["RewardFunction", "RewardSet", "Sample", "StepRewards", "dataset_columns",
           "from_callable", "from_spec", "style_of"]
