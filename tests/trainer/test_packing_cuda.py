"""Packed micro-batches on a GPU: varlen attention and the chunked head against the padded path.

bf16 tiny Qwen3: the varlen kernel (FlashAttention-2 varlen) must be the backend chosen, and
its log-probs, loss and gradients must match the padded SDPA path within bf16 tolerance.
"""

import pytest
import torch

from handoff.config import ActorConfig
from handoff.modelzoo import init_model
from handoff.trainer.actor import Actor
from handoff.trainer.batch import RolloutBatch
from handoff.trainer import attention
from handoff.trainer.grpo import group_advantages
from handoff.trainer.logprobs import chunked_token_logprobs

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(init_model("tiny-qwen3", tmp_path_factory.mktemp("m"), dtype="bfloat16"))


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [[256, 1, 2, 3]] * 4 + [[256, 9]] * 4
    responses = [torch.randint(0, 256, (int(torch.randint(2, 60, (1,), generator=g)),),
                               generator=g).tolist() for _ in range(8)]
    b = RolloutBatch.from_tokens(prompts, responses, [1, 0, 0, 1, 1, 1, 0, 0],
                                 group_size=4, pad_id=259)
    b.advantages = group_advantages(b.rewards, b.group_size)
    return b.to("cuda")


def test_varlen_is_the_packed_backend_on_this_gpu():
    assert attention.backend_for(torch.device("cuda"), torch.bfloat16) == "varlen"
    assert attention.backend_for(torch.device("cuda"), torch.float32) == "padded_sdpa"


def test_packed_varlen_and_chunked_head_match_the_padded_path(ckpt):
    b = batch()
    results = []
    for extra in ({}, dict(micro_batch_tokens=96, logprob_chunk_tokens=32)):
        actor = Actor(ckpt, actor=ActorConfig(micro_batch_size=4, entropy_coef=0.01, **extra),
                      device="cuda")
        logp, ent = actor.log_probs(b)
        sums = actor.accumulate(b)
        grads = {n: p.grad.full_tensor().float() for n, p in actor.module.named_parameters()}
        results.append((logp, ent, sums, grads))
    valid = b.attention_mask.bool()
    (lp0, en0, s0, g0), (lp1, en1, s1, g1) = results
    assert torch.allclose(lp1[valid], lp0[valid], atol=5e-2, rtol=2e-2)
    assert torch.allclose(en1[valid], en0[valid], atol=5e-2, rtol=2e-2)
    assert torch.allclose(s1, s0, rtol=2e-2, atol=1e-2)
    for name, g in g0.items():
        cos = torch.nn.functional.cosine_similarity(g1[name].flatten(), g.flatten(), dim=0)
        assert cos > 0.99, name


def test_chunked_head_in_bf16_matches_full_logits():
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(300, 64, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (0.1 * torch.randn(1000, 64, device="cuda", generator=g)).bfloat16().requires_grad_()
    t = torch.randint(0, 1000, (300,), device="cuda", generator=g)
    logits = (h @ w.t()).float()
    logp_ref = torch.log_softmax(logits, -1).gather(-1, t[:, None])[:, 0]
    logp_ref.sum().backward()
    refs = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    logp, _ = chunked_token_logprobs(h, w, t, chunk_tokens=128, with_entropy=False)
    logp.sum().backward()
    assert torch.allclose(logp, logp_ref, atol=1e-3)
    for got, want in zip((h.grad, w.grad), refs):
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
