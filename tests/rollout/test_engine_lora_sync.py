"""The trainer's adapters synced into the engine (switch/lora.py: sync_lora) generate what
transformers + peft generate with the same adapter: the engine-side check of
test_engine_lora.py (its peft model, adapter and greedy reference), reached through a LoRA
actor whose base is the engine's own weights."""

import pytest
import torch

from handoff.config import ActorConfig, LoraConfig
from handoff.rollout.engine import Engine
from handoff.switch.lora import sync_lora
from handoff.trainer.actor import Actor
from handoff.trainer.lora import adapter_parameters
from test_engine_lora import ALPHA, PROMPTS, RANK, _adapter, _peft_greedy, _tokens


@pytest.mark.parametrize("which", ["qwen3_dir", "llama_dir"])
def test_greedy_after_the_trainers_sync_equals_peft(which, ref, request):
    path = request.getfixturevalue(which)
    engine = Engine(str(path), ref.cfg(), lora_max_rank=RANK)
    base = _tokens(engine)   # zero adapter buffers: the base's completions
    actor = Actor(str(path), actor=ActorConfig(lora=LoraConfig(rank=RANK, alpha=ALPHA)),
                  dtype="float32", engine_base=engine.export_weight)
    # peft's save_pretrained names, as the actor holds them (the adapter name `default`).
    saved = {k.removeprefix("base_model.model.").replace(".weight", ".default.weight"): v
             for k, v in _adapter(path).items()}
    with torch.no_grad():
        for name, param in adapter_parameters(actor.module):
            param.copy_(saved.pop(name))
    assert saved == {}
    sync_lora(actor, engine)
    synced = _tokens(engine)
    assert synced == [_peft_greedy(path, p) for p in PROMPTS]
    assert synced != base, "the adapter changes nothing: the test would prove nothing"
