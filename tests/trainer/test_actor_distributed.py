"""Two gloo processes vs a single-process plain-torch GRPO on the same global batches.

The reference below is written out in plain torch (log_softmax, torch.optim.AdamW,
clip_grad_norm_), independent of handoff.trainer.grpo: FSDP2 sharding, micro-batching with
uneven row counts per rank, token-mean aggregation across ranks, clipping and the
fp32-master AdamW must all add up to the same loss, gradients and weights.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dist_train_job as job
from handoff.modelzoo import init_model
from rank_jobs import run_ranks

HERE = Path(__file__).parent
ATOL = 2e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    ckpt = str(init_model("tiny-qwen3", tmp_path_factory.mktemp("m"), dtype="float32", seed=3))
    out = tmp_path_factory.mktemp("out")
    run_ranks(HERE / "dist_train_job.py", [ckpt, str(out)], timeout_s=240)
    return ckpt, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _grpo_reference_step(model, opt, batch, old_logprobs, loss_agg="token_mean"):
    """Token-mean (or seq_mean: each sequence's token mean, averaged over sequences) GRPO loss
    over the whole batch, backward, clip, AdamW; returns metrics."""
    cfg = job.ACTOR
    ids, mask = batch.input_ids, batch.response_mask[:, 1:]
    logits = model(input_ids=ids).logits[:, :-1]
    logsm = torch.log_softmax(logits, -1)
    logp = logsm.gather(-1, ids[:, 1:, None])[..., 0]
    ent = -(logsm.exp() * logsm).sum(-1)
    r = batch.rewards.view(-1, job.GROUP)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1, 1)
    adv = torch.where(r.view(-1, 1) == r.mean(1, keepdim=True).repeat_interleave(job.GROUP, 0),
                      0.0, adv)
    old = logp.detach() if old_logprobs is None else old_logprobs[:, 1:]
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - cfg["clip_low"], 1 + cfg["clip_high"]))
    d = batch.ref_logprobs[:, 1:] - logp
    kl = torch.exp(d) - d - 1
    n = mask.sum()
    loss_BT = pg + cfg["kl_coef"] * kl - cfg["entropy_coef"] * ent
    if loss_agg == "seq_mean":
        loss = ((loss_BT * mask).sum(1) / mask.sum(1)).mean()
    else:
        loss = (loss_BT * mask).sum() / n
    opt.zero_grad()
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
    opt.step()
    clipped = (-adv * ratio.clamp(1 - cfg["clip_low"], 1 + cfg["clip_high"]) > -adv * ratio)
    metrics = {"loss": loss.item(), "pg_loss": ((pg * mask).sum() / n).item(),
               "kl": ((kl * mask).sum() / n).item(), "entropy": ((ent * mask).sum() / n).item(),
               "clip_frac": ((clipped * mask).sum() / n).item(), "grad_norm": norm.item()}
    return metrics, grads, logp


@pytest.fixture(scope="module")
def reference(run):
    from transformers import AutoModelForCausalLM

    ckpt, _ = run
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=job.ACTOR["lr"], weight_decay=0.0,
                            eps=job.ADAM_EPS)
    snap = lambda: {k: p.detach().clone() for k, p in model.named_parameters()}  # noqa: E731
    m1, grads1, _ = _grpo_reference_step(model, opt, job.global_batch(1), None)
    full1 = snap()
    old2 = torch.cat([r["old2"] for r in run[1]])
    m2, _, _ = _grpo_reference_step(model, opt, job.global_batch(2), old2)
    return {"m1": m1, "grads1": grads1, "full1": full1, "m2": m2, "full2": snap()}


def test_full_params_reassemble_the_unsharded_checkpoint(run):
    ckpt, ranks = run
    saved = load_file(f"{ckpt}/model.safetensors")
    assert set(ranks[0]["full0"]) == set(saved) - {"lm_head.weight"}
    for name, t in ranks[0]["full0"].items():
        assert torch.equal(t, saved[name]), name


def test_loss_and_gradients_match_the_single_process_reference(run, reference):
    _, ranks = run
    sums = ranks[0]["sums1"]
    assert torch.equal(sums, ranks[1]["sums1"])                 # all-reduced on both ranks
    assert sums[0].item() / sums[5].item() == pytest.approx(reference["m1"]["loss"], abs=1e-6)
    assert ranks[0]["grad_norm1"] == pytest.approx(reference["m1"]["grad_norm"], rel=1e-5)
    assert reference["m1"]["grad_norm"] > job.ACTOR["grad_clip"]   # clipping was exercised
    for name, g in reference["grads1"].items():
        assert torch.allclose(ranks[0]["grads1"][name], g, atol=ATOL), name


def test_seq_mean_gradients_are_the_whole_batchs_across_uneven_ranks(run):
    from transformers import AutoModelForCausalLM

    ckpt, ranks = run
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=job.ACTOR["lr"])
    _, want, _ = _grpo_reference_step(model, opt, job.global_batch(1), None, loss_agg="seq_mean")
    for name, g in want.items():
        assert torch.allclose(ranks[0]["grads1_seq_mean"][name], g, atol=ATOL), name
        assert torch.equal(ranks[0]["grads1_seq_mean"][name], ranks[1]["grads1_seq_mean"][name])
    name = "model.embed_tokens.weight"   # and it is not the token mean's gradient
    assert not torch.allclose(ranks[0]["grads1_seq_mean"][name], ranks[0]["grads1"][name],
                              atol=ATOL)


def test_updated_weights_and_metrics_match_the_reference(run, reference):
    _, ranks = run
    for step in ("full1", "full2"):
        for name, w in reference[step].items():
            assert torch.allclose(ranks[0][step][name], w, atol=ATOL), (step, name)
            assert torch.equal(ranks[0][step][name], ranks[1][step][name])
    got = ranks[0]["metrics2"]
    assert got == ranks[1]["metrics2"]
    assert 0 < got["clip_frac"] < 1                               # the off-policy step clips
    for key, want in reference["m2"].items():
        assert got[key] == pytest.approx(want, abs=1e-5, rel=1e-5), key


def test_offload_round_trip_at_world_size_two(run):
    for res in run[1]:
        parts = res["parts"]
        assert res["world"] == 2
        assert {k: v["bytes"] for k, v in res["moved"].items()} == {
            "params": parts["params"], "optimizer": parts["optimizer"]}
        assert res["freed"] == 0 and res["exact"]
        assert res["back"]["params"]["bytes"] == parts["params"]
    # each rank holds half of every (even) dim 0
    assert run[1][0]["parts"]["params"] * 2 == job_total_param_bytes(run[0])


def job_total_param_bytes(ckpt: str) -> int:
    saved = load_file(f"{ckpt}/model.safetensors")
    return sum(t.numel() * 4 for k, t in saved.items() if k != "lm_head.weight")


def test_resume_reproduces_the_next_step(run):
    for res in run[1]:
        assert res["info"]["step"] == 2 and res["info"]["extra"] == {"data_pos": 12}
        assert res["metrics3_resumed"] == res["metrics3"]
        assert torch.equal(res["noise3_resumed"], res["noise3"])
