"""Prompt rendering: the tokenizer's chat template when present and wanted, else plain text."""

from handoff.modelzoo import IM_START_ID, build_byte_tokenizer
from handoff.tasks import ArithmeticTask, encode_prompt, render_prompt


def test_chat_template_is_applied_with_generation_prompt():
    tok = build_byte_tokenizer()
    problem = ArithmeticTask(seed=0).get(0)
    text = render_prompt(problem, tok, chat=True)
    assert text.startswith("<|im_start|>user\n" + problem.prompt)
    assert text.endswith("<|im_start|>assistant\n")
    ids = encode_prompt(problem, tok, chat=True)
    assert ids.count(IM_START_ID) == 2  # the markers are special tokens, not their bytes
    assert tok.decode(ids) == text


def test_plain_text_without_template_or_when_turned_off():
    tok = build_byte_tokenizer()
    task = ArithmeticTask(seed=0, system_prompt="Be brief.")
    problem = task.get(0)
    plain = task.render_prompt(problem, tok, chat=False)
    assert plain == f"Be brief.\n\n{problem.prompt}\n"
    assert IM_START_ID not in task.encode_prompt(problem, tok, chat=False)
    tok.chat_template = None
    assert render_prompt(problem, tok, chat=True) == plain
    assert render_prompt(problem, None) == plain
