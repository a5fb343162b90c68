"""The trainer's compute in the plan: FLOPs, the modelled step time, the micro-batch choice."""

import dataclasses

import pytest

from handoff.config import ConfigError, load_config
from handoff.errors import HandoffError
from handoff.plan.hardware import hardware_profile
from handoff.plan.ledger import Dtypes
from handoff.plan.report import build_plan
from handoff.plan.shapes import load_shape
from handoff.plan.trainer import (ACTIVATION_SHARE, MIN_TOKENS_WITHOUT_RECOMPUTE,
                                  activation_bytes_per_token, matmul_params, model_flops, pick_micro_batch, train_seconds)

H200 = hardware_profile("h200")


def test_model_flops_are_6nt_plus_2nt_per_extra_forward():
    q4 = load_shape("qwen3-4b")                       # tied: the table is the head's GEMM
    assert matmul_params(q4) == q4.num_params
    assert model_flops(q4, 75_000) == pytest.approx(8 * 4.022e9 * 75_000, rel=1e-3)
    assert model_flops(q4, 10, ref=False, old_logprobs=True) == 8 * q4.num_params * 10
    llama = load_shape("llama3-8b")                   # untied: the input embedding is a lookup
    assert matmul_params(llama) == llama.num_params - 128256 * 4096
    # the 4B colocated step of 2026-12-04: 82,432 tokens trained in 8.35 s of compute
    assert train_seconds(q4, 82_432, H200) == pytest.approx(8.35, rel=0.02)


def test_plan_models_the_step_when_none_is_given():
    base = ["model.path=qwen3-4b", "hardware.name=h200", "workload.prompt_len=36",
            "workload.response_len=256", "workload.tokens_per_step=65536"]
    r = build_plan(load_config(None, base))
    st = r["step"]
    assert st["source"] == "modelled"
    assert st["train_tokens_per_card"] == pytest.approx(65536 * (1 + 36 / 256))
    assert st["seconds"] == pytest.approx(st["generation_seconds"] + st["switch_seconds"]
                                          + st["train_seconds"])
    assert r["switch"]["share_of_step"] == pytest.approx(r["switch"]["total_seconds"]
                                                         / st["seconds"])
    fast = build_plan(load_config(None, base + ["hardware.train_tflops=450"]))["step"]
    assert fast["train_seconds"] == pytest.approx(st["train_seconds"] * 315 / 450)
    given = build_plan(load_config(None, base + ["workload.step_seconds=20"]))
    assert given["step"]["source"] == "given" and given["step"]["seconds"] == 20
    assert given["switch"]["share_of_step"] == pytest.approx(given["switch"]["total_seconds"] / 20)


def test_the_4b_on_an_h200_trains_packed_without_recompute_and_a_small_card_recomputes():
    q4 = load_shape("qwen3-4b")
    c = pick_micro_batch(q4, H200, dtypes=Dtypes(), shard=1, logprob_chunk_tokens=2048,
                         longest_sequence=1024)
    assert not c.checkpointing and c.tokens >= MIN_TOKENS_WITHOUT_RECOMPUTE
    assert c.tokens % 256 == 0
    assert c.tokens * c.bytes_per_token + c.fixed_bytes <= c.room_bytes
    small = dataclasses.replace(H200, hbm_bytes=100e9)   # 64 GB of state leaves ~24 GB
    s = pick_micro_batch(q4, small, dtypes=Dtypes(), shard=1, logprob_chunk_tokens=2048,
                         longest_sequence=1024)
    assert s.checkpointing and s.tokens > MIN_TOKENS_WITHOUT_RECOMPUTE
    # the full logits cost ~18 B x vocabulary per token: a much smaller budget
    full = pick_micro_batch(q4, H200, dtypes=Dtypes(), shard=1, checkpointing=True)
    chunked = pick_micro_batch(q4, H200, dtypes=Dtypes(), shard=1, checkpointing=True,
                               logprob_chunk_tokens=2048)
    assert full.tokens < chunked.tokens / 3
    assert activation_bytes_per_token(q4, checkpointing=False, chunked_head=True) > \
        10 * activation_bytes_per_token(q4, checkpointing=True, chunked_head=True)


def test_an_explicit_budget_is_kept_and_one_too_small_for_a_sequence_is_refused():
    q4 = load_shape("qwen3-4b")
    kept = pick_micro_batch(q4, H200, dtypes=Dtypes(), shard=1, tokens=4096,
                            logprob_chunk_tokens=2048)
    assert kept.tokens == 4096 and not kept.checkpointing
    huge = pick_micro_batch(q4, H200, dtypes=Dtypes(), shard=1, tokens=200_000,
                            logprob_chunk_tokens=2048)
    assert huge.checkpointing                      # 200K tokens only fit with recompute
    tight = dataclasses.replace(H200, hbm_bytes=72e9)
    with pytest.raises(HandoffError, match="longest sequence"):
        pick_micro_batch(q4, tight, dtypes=Dtypes(), shard=1, checkpointing=False,
                         longest_sequence=32768)


def test_auto_is_accepted_only_where_a_field_allows_it():
    cfg = load_config(None, ["actor.micro_batch_tokens=auto", "actor.gradient_checkpointing=auto",
                             "actor.logprob_chunk_tokens=1024"])
    assert cfg.actor.micro_batch_tokens == "auto" and cfg.actor.gradient_checkpointing == "auto"
    assert load_config(None, ["actor.micro_batch_tokens=8192"]).actor.micro_batch_tokens == 8192
    with pytest.raises(ConfigError, match="micro_batch_size"):
        load_config(None, ["actor.micro_batch_size=auto"])
    with pytest.raises(ConfigError, match="not an integer"):
        load_config(None, ["actor.micro_batch_tokens=many"])
    with pytest.raises(ConfigError, match="out of range"):
        load_config(None, ["actor.micro_batch_tokens=-1"])


def test_a_lora_run_sizes_its_micro_batch_beside_the_base_and_the_adapters_not_16n():
    """Full-parameter state of an 8B (131 GB) leaves an H200 no activations; under LoRA the
    card holds the base once (16.4 GB) and megabytes of adapters, so the budget is large."""
    from handoff.config.sections import LORA_TARGETS
    from handoff.plan.lora import adapter_params
    from handoff.runplan import RunPlan

    common = ["model.path=qwen3-8b", "hardware.name=h200", "actor.micro_batch_tokens=auto",
              "actor.logprob_chunk_tokens=2048", "rollout.max_model_len=1024"]
    full = RunPlan.build(load_config(None, common))
    with pytest.raises(HandoffError, match="for activations"):
        full.actor_config()
    shared = RunPlan.build(load_config(None, common + ["actor.lora.rank=16"]))
    twice = RunPlan.build(load_config(None, common + ["actor.lora.rank=16",
                                                      "actor.lora.share_base=false"]))
    q8 = load_shape("qwen3-8b")
    adapters = adapter_params(q8, 16, LORA_TARGETS)   # bf16 params + grads, fp32 master + Adam
    assert shared.train_state_bytes() == q8.num_params * 2 + adapters * 16
    assert twice.train_state_bytes() == q8.num_params * 2 + adapters * 16   # one card: whole
    assert full.train_state_bytes() == q8.num_params * 16
    actor, choice = shared.actor_config()
    assert choice.tokens >= MIN_TOKENS_WITHOUT_RECOMPUTE and not actor.gradient_checkpointing
    assert choice.room_bytes == pytest.approx(ACTIVATION_SHARE * (
        H200.hbm_bytes - H200.resident_bytes - shared.train_state_bytes()))
