"""ArithmeticTask: deterministic stream, resumable position, difficulty, and its reward."""

import pytest

from handoff.errors import HandoffError
from handoff.tasks import ArithmeticTask


def _value(p):
    a, b, op = p.metadata["a"], p.metadata["b"], p.metadata["op"]
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_problems_are_right_and_within_difficulty():
    for digits, ops in [(1, "+-"), (2, "+"), (3, "*-")]:
        task = ArithmeticTask(digits=digits, ops=ops, seed=3)
        problems = task.sample(200)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        for p in problems:
            assert p.answer == str(_value(p))
            assert int(p.answer) >= 0
            assert low <= p.metadata["a"] < 10 ** digits and low <= p.metadata["b"] < 10 ** digits
            assert p.metadata["op"] in ops
            assert f"{p.metadata['a']} {p.metadata['op']} {p.metadata['b']}" in p.prompt
        assert {p.metadata["op"] for p in problems} == set(ops)


def test_same_seed_same_stream_other_seed_other_stream():
    a = [p.prompt for p in ArithmeticTask(seed=1).sample(20)]
    assert a == [p.prompt for p in ArithmeticTask(seed=1).sample(20)]
    assert a != [p.prompt for p in ArithmeticTask(seed=2).sample(20)]


def test_resume_continues_the_stream():
    full = ArithmeticTask(digits=2, seed=7)
    expected = [p.prompt for p in full.sample(5)] + [p.prompt for p in full.sample(5)]
    first = ArithmeticTask(digits=2, seed=7)
    head = [p.prompt for p in first.sample(5)]
    state = first.state_dict()
    resumed = ArithmeticTask(digits=2, seed=7)
    resumed.load_state_dict(state)
    assert head + [p.prompt for p in resumed.sample(5)] == expected
    assert resumed.get(3).prompt == expected[3]  # random access agrees with the stream


def test_resume_with_another_seed_is_refused():
    state = ArithmeticTask(seed=1).state_dict()
    with pytest.raises(HandoffError, match="run.seed"):
        ArithmeticTask(seed=2).load_state_dict(state)


@pytest.mark.parametrize("response, reward, correct, formatted", [
    ("10", 1.0, True, True),
    (" 10.\n", 1.0, True, True),
    ("+10", 1.0, True, True),
    ("{a} + {b} = 10", 1.0, True, True),
    ("{a}+{b}=10.", 1.0, True, True),
    ("11", 0.1, False, True),
    ("{a} + {b} = 11", 0.1, False, True),
    ("{b} + {a} = 10", 0.0, True, False),  # an equation, but not this problem's
    ("{a} * {b} = 10", 0.0, True, False),
    ("{a} + {b} + 0 = 10", 0.0, True, False),
    ("{a} + {b} = 10\n\nThis is", 0.0, True, False),
    ("The answer is 10.", 0.0, True, False),
    ("ten", 0.0, False, False),
    ("", 0.0, False, False),
    ("10 10", 0.0, True, False),
])
def test_reward_exact_match_with_format(response, reward, correct, formatted):
    task = ArithmeticTask(seed=0, ops="+")
    p = next(q for q in task.sample(100) if q.answer == "10" and q.metadata["a"] != 5)
    response = response.format(**p.metadata)
    score = task.score(p, response)
    assert (score.reward, score.correct, score.formatted) == (reward, correct, formatted)
    assert task.reward(p, response) == reward


def test_multiplication_may_be_written_with_x():
    task = ArithmeticTask(seed=0, ops="*")
    p = task.get(0)
    a, b = p.metadata["a"], p.metadata["b"]
    assert task.reward(p, f"{a} x {b} = {a * b}") == 1.0
    assert task.reward(p, f"{a} \u00d7 {b} = {a * b}") == 1.0


def test_system_prompt_and_bad_settings():
    p = ArithmeticTask(system_prompt="Be brief.").get(0)
    assert [m["role"] for m in p.messages] == ["system", "user"]
    with pytest.raises(HandoffError, match="ops"):
        ArithmeticTask(ops="/")
    with pytest.raises(HandoffError, match="difficulty"):
        ArithmeticTask(digits=0)
    with pytest.raises(HandoffError, match="at least one"):
        ArithmeticTask().sample(0)


def test_a_filler_passage_lengthens_the_prompt_and_keeps_the_problem():
    plain, long = ArithmeticTask(seed=3), ArithmeticTask(seed=3, context_chars=500)
    for i in range(5):
        a, b = plain.get(i), long.get(i)
        assert b.answer == a.answer and b.metadata == a.metadata
        assert b.prompt.endswith(a.prompt) and len(b.prompt) == len(a.prompt) + 500 + 9
    assert long.get(0).prompt != long.get(1).prompt
