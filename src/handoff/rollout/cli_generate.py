"""`handoff generate`: try the engine on a checkpoint from the shell.

    handoff generate --model ckpt/ --prompt "2+2=" --prompt "Hello" --max-tokens 32 \
        --temperature 0.7 --n 2 --json

Prompts are tokenized as raw text with the checkpoint's tokenizer (no chat template); every
sample is printed, or with --json a list of {prompt, token_ids, text, logprobs, finish_reason}
(token_ids are the generated ones, the stop token included; text is their decoding without
special tokens).

Tensor parallel: `torchrun --nproc-per-node 2 -m handoff generate ... --tp 2`: the processes
form one engine of TP 2 (gloo on CPU, NCCL on GPUs); every rank generates, rank 0 prints.
"""

from __future__ import annotations

from handoff.errors import HandoffError


def generate_samples(model: str, prompts: list[str], *, max_tokens: int, temperature: float,
                     n: int = 1, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                     device: str | None = None, max_model_len: int | None = None,
                     tp: int = 1) -> list[dict]:
    """Run the engine on text prompts; one dict per sample, grouped by prompt (every rank
    returns them all under TP)."""
    from handoff.config import RolloutConfig
    from handoff.model_files import check_model_dir, load_tokenizer
    from handoff.rollout.engine import Engine
    from handoff.rollout.sampling import SamplingParams

    from handoff.dist import launch_env

    if not prompts:
        raise HandoffError("no prompt given: pass --prompt TEXT (repeat it for several)")
    launch_env()   # torchrun's variables whole, or one line
    _check_launch(tp)
    check_model_dir(model)  # config, tokenizer and weights named before a loader complains
    tokenizer = load_tokenizer(model)
    token_lists = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    longest = max(len(t) for t in token_lists) + max_tokens
    cfg = RolloutConfig(max_model_len=max_model_len or max(longest + 1, 2),
                        max_num_seqs=max(len(prompts) * n, 1), n=n, max_tokens=max_tokens)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, n=n,
                            max_tokens=max_tokens)
    device, group = _join_tp_group(device, tp)
    outputs = Engine(model, cfg, device=device, tp=group).generate(token_lists, params)
    return [{"prompt": text, "token_ids": s.token_ids,
             "text": tokenizer.decode(s.token_ids, skip_special_tokens=True),
             "logprobs": s.logprobs, "finish_reason": s.finish_reason}
            for text, out in zip(prompts, outputs) for s in out.outputs]


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
