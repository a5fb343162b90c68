"""`handoff generate`: try the engine on a checkpoint from the shell.

    handoff generate --model ckpt/ --prompt "2+2=" --prompt "Hello" --max-tokens 32 \
        --temperature 0.7 --n 2 --json

A prompt that is not UTF-8 text (a lone surrogate, from invalid bytes in the argument) is
refused. Each prompt is sent as one user turn through the tokenizer's chat template when it has one
(an instruct model answers nothing useful to raw text), or as raw text with --no-chat or
without a template; --prompt-file FILE adds one prompt per line (blank lines skipped). Every
sample is printed, or with --json a list of {prompt, prompt_token_ids, token_ids, text,
logprobs, finish_reason} (prompt_token_ids are what the engine was given; token_ids the
generated ones, the stop token included; text is their decoding without special tokens).

Tensor parallel: `torchrun --nproc-per-node 2 -m handoff generate ... --tp 2`: the processes
form one engine of TP 2 (gloo on CPU, NCCL on GPUs); every rank generates, rank 0 prints.
"""

from __future__ import annotations

from handoff.errors import HandoffError


def generate_samples(model: str, prompts: list[str], *, max_tokens: int, temperature: float,
                     n: int = 1, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                     device: str | None = None, max_model_len: int | None = None,
                     tp: int = 1, chat: bool = True) -> list[dict]:
    """Run the engine on text prompts; one dict per sample, grouped by prompt (every rank
    returns them all under TP). `chat`: through the tokenizer's chat template, if it has one."""
    from handoff.config import RolloutConfig
    from handoff.model_files import ModelFiles, check_model_dir, load_tokenizer
    from handoff.rollout.engine import Engine
    from handoff.rollout.sampling import SamplingParams, seeded_per_prompt

    from handoff.dist import launch_env

    if not prompts:
        raise HandoffError("no prompt given: pass --prompt TEXT (repeat it for several) or "
                           "--prompt-file FILE (one prompt a line)")
    launch_env()   # torchrun's variables whole, or one line
    check_prompts(prompts)
    _check_launch(tp)
    check_model_dir(model)  # config, tokenizer and weights named before a loader complains
    files = ModelFiles.open(model)   # config.json read once more, then kept for the engine
    tokenizer = load_tokenizer(model)
    token_lists = [encode_prompt(tokenizer, p, chat=chat) for p in prompts]
    longest = max(len(t) for t in token_lists) + max_tokens
    _note_position_cap(files.config, longest)
    cfg = RolloutConfig(max_model_len=max_model_len or max(longest + 1, 2),
                        max_num_seqs=max(len(prompts) * n, 1), n=n, max_tokens=max_tokens)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, n=n,
                            max_tokens=max_tokens)
    if seed is not None:
        params = seeded_per_prompt(params, seed, range(len(prompts)))
    device, group = _join_tp_group(device, tp)
    outputs = Engine(files, cfg, device=device, tp=group).generate(token_lists, params)
    return [{"prompt": text, "prompt_token_ids": ids, "token_ids": s.token_ids,
             "text": tokenizer.decode(s.token_ids, skip_special_tokens=True),
             "logprobs": s.logprobs, "finish_reason": s.finish_reason}
            for text, ids, out in zip(prompts, token_lists, outputs) for s in out.outputs]


def _note_position_cap(config: dict, longest: int) -> None:
    """Say (stderr, rank 0) when a prompt and --max-tokens pass the model's positions
    (config.json's): the engine ends those samples at the limit, with finish_reason
    'length'."""
    import os

    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and longest > positions and os.environ.get("RANK", "0") == "0":
        from rich.console import Console

        Console(stderr=True).print(
            f"[yellow]note: the longest prompt and --max-tokens make {longest} tokens, past the "
            f"model's max_position_embeddings={positions}: its samples end at {positions} "
            "tokens (finish_reason 'length')[/]", highlight=False, soft_wrap=True)


def encode_prompt(tokenizer, text: str, *, chat: bool) -> list[int]:
    """Token ids of one prompt: a user turn of the chat template (which carries its own
    special tokens) when `chat` and the tokenizer has one, else the raw text."""
    if chat and getattr(tokenizer, "chat_template", None):
        from jinja2 import TemplateError

        from handoff.tasks.base import chat_template_error

        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 tokenize=False, add_generation_prompt=True)
        except TemplateError as e:
            raise chat_template_error(tokenizer, e, off="pass --no-chat") from None
    return tokenizer.encode(text, add_special_tokens=False)


def read_prompt_file(path: str) -> list[str]:
    """The prompts of a text file, one a line (blank lines skipped); one line if unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise HandoffError(f"--prompt-file {path!r} cannot be read ({e.__class__.__name__}: "
                           f"{e}): pass a UTF-8 text file with one prompt a line") from None
    return [line for line in lines if line.strip()]


def check_prompts(prompts: list[str]) -> None:
    """Refuse a prompt that is not text: invalid UTF-8 bytes in a shell argument reach Python
    as lone surrogates, which no tokenizer encodes and no terminal prints."""
    for i, text in enumerate(prompts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise HandoffError(f"prompt {i} is not valid UTF-8 text (character {e.start} is "
                               f"{text[e.start]!r}, a lone surrogate: invalid bytes in the "
                               "argument?): pass the prompt as UTF-8 text") from None


def is_main_process() -> bool:
    """Rank 0 of a torchrun launch, or a lone process: the one that prints."""
    from handoff.dist import world_rank_size

    return world_rank_size()[0] == 0


def _check_launch(tp: int) -> None:
    from handoff.dist import world_rank_size

    world = world_rank_size()[1]
    if tp < 1:
        raise HandoffError(f"--tp {tp} is not positive: use 1 or the number of processes")
    if world != tp:
        raise HandoffError(f"--tp {tp} but {world} process(es) were started: launch "
                           f"`torchrun --nproc-per-node {tp} -m handoff generate ... --tp {tp}` "
                           "(one process per TP rank)")


def _join_tp_group(device: str | None, tp: int):
    """(device, TP group): the processes torchrun started form one engine of `tp` ranks."""
    from handoff.rollout.parallel import SINGLE, init_tp_group
    from handoff.dist import init_process_group, resolve_device

    if tp == 1:  # resolved here so a wrong --device is one line, not a traceback
        return (resolve_device(device) if device else None), SINGLE

    dev = resolve_device(device or "auto")
    init_process_group(dev)
    return dev, init_tp_group(tp)
