"""What every task gives the loop: problems drawn from a resumable stream, and a reward.

A task is a deterministic, random-access sequence of problems: problem `i` depends only on
the task's seed and `i`. The loop takes the next `prompts_per_step` problems with `sample()`,
and a resumed run restores the stream position with `load_state_dict()`, so it sees exactly
the problems it would have seen without the interruption (no rng state to pickle, and ranks
can split a batch by index).

    task = build_task(cfg.data, seed=cfg.run.seed)
    problems = task.sample(8)
    ids = task.encode_prompt(problems[0], tokenizer, chat=cfg.data.chat_template)
    score = task.score(problems[0], "42")  # Score(reward=1.0, correct=True, formatted=True, ..)
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from handoff.errors import HandoffError


@dataclass(frozen=True)
class Problem:
    """One prompt and what a correct response must contain."""

    messages: tuple[dict[str, str], ...]  # chat messages, ending with the user turn
    answer: str  # reference answer, already normalised by the task
    index: int  # position in the task's stream
    metadata: dict[str, Any] = field(default_factory=dict, compare=False)
    # The data gave chat messages (TRL's conversational form): reward functions then get the
    # messages and each completion as an assistant message, else the text (TRL's standard
    # form), whether or not the chat template renders the prompt for the model.
    conversational: bool = False

    @property
    def prompt(self) -> str:
        """The plain-text prompt (the last user message), used when there is no chat template."""
        return self.messages[-1]["content"]


@dataclass(frozen=True)
class Score:
    """A reward with its parts, so the loop can log accuracy and format rate apart."""

    reward: float
    correct: bool  # the extracted answer equals the reference
    formatted: bool  # the answer was found in the format the prompt asked for
    extracted: str | None  # the answer the reward read from the response (None: none found)


class Task(abc.ABC):
    """A resumable stream of problems plus a verifiable reward."""

    name: str = "task"
    has_answers: bool = True   # False: prompts only, no reference for a grader

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = seed
        self.position = 0

    @abc.abstractmethod
    def get(self, index: int) -> Problem:
        """Problem number `index` of this task's stream (a pure function of seed and index)."""

    @abc.abstractmethod
    def score(self, problem: Problem, response: str) -> Score:
        """Grade one response to `problem`."""

    def reward(self, problem: Problem, response: str) -> float:
        return self.score(problem, response).reward

    def sample(self, num_prompts: int) -> list[Problem]:
        """The next `num_prompts` problems of the stream; advances the position."""
        if num_prompts < 1:
            raise HandoffError(f"num_prompts={num_prompts}: ask for at least one prompt "
                               "(data.prompts_per_step >= 1)")
        start = self.position
        self.position += num_prompts
        return [self.get(i) for i in range(start, start + num_prompts)]

    def render_prompt(self, problem: Problem, tokenizer: Any = None, *, chat: bool = True) -> str:
        return render_prompt(problem, tokenizer, chat=chat)

    def encode_prompt(self, problem: Problem, tokenizer: Any, *, chat: bool = True) -> list[int]:
        return encode_prompt(problem, tokenizer, chat=chat)

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name or state.get("seed") != self.seed:
            raise HandoffError(
                f"checkpoint's data stream is task={state.get('name')!r} seed={state.get('seed')} "
                f"but this run has task={self.name!r} seed={self.seed}: resume with the same "
                "data.task and run.seed, or start a fresh run.out_dir")
        self.position = state["position"]


def checkpoint_task_state(meta: dict, where: str) -> dict:
    """The Task.state_dict a checkpoint's meta.json records (its data position), checked:
    one line unless it is one; `where` names the file."""
    extra = meta.get("extra")
    state = extra.get("task") if isinstance(extra, dict) else None
    if not isinstance(state, dict):
        raise HandoffError(f"{where} records no data position (extra.task): it was not "
                           "written by `handoff train`; start over with --overwrite")
    position = state.get("position")
    if type(position) is not int or position < 0:
        raise HandoffError(f"{where} records no valid data position (extra.task.position "
                           f"{position!r}, a whole number >= 0): it was edited by hand; point "
                           "`latest` at another checkpoint, or restore meta.json")
    return state


def render_prompt(problem: Problem, tokenizer: Any = None, *, chat: bool = True) -> str:
    """The text the model continues: the chat template applied when asked for and present.

    Without a template (or with `chat=False`) the system messages and the user turn
    are joined as plain text, which is what a base model without a template expects.
    """
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if chat and template:
        from jinja2 import TemplateError

        try:
            return tokenizer.apply_chat_template(list(problem.messages), tokenize=False,
                                                 add_generation_prompt=True)
        except TemplateError as e:
            raise chat_template_error(tokenizer, e, off="set data.chat_template=false") from None
    return "\n\n".join(m["content"] for m in problem.messages) + "\n"


def chat_template_error(tokenizer: Any, error: Exception, *, off: str) -> HandoffError:
    """The one line for a chat template that does not parse, or raises (raise_exception),
    naming the model directory's file that holds it; `off`: how to skip it."""
    model = Path(getattr(tokenizer, "name_or_path", "") or ".")
    # transformers reads chat_template.jinja over tokenizer_config.json's chat_template
    where = next((str(model / name) for name in ("chat_template.jinja", "tokenizer_config.json")
                  if (model / name).is_file()), f"the chat template of {model}")
    line = f" at line {error.lineno}" if getattr(error, "lineno", None) else ""
    said = " ".join(str(error).split())[:200]
    return HandoffError(f"{where} cannot be rendered ({type(error).__name__}: {said}{line}): fix "
                        f"the template, or {off} to send prompts as plain text")


def encode_prompt(problem: Problem, tokenizer: Any, *, chat: bool = True) -> list[int]:
    """Token ids of `render_prompt`; a rendered template already carries its special tokens."""
    text = render_prompt(problem, tokenizer, chat=chat)
    templated = chat and bool(getattr(tokenizer, "chat_template", None))
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])
