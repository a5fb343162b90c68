"""The trainer's compute in the plan: FLOPs, seconds, and the micro-batch the card can hold.

    choice = pick_micro_batch(shape, hw, dtypes=Dtypes(), shard=1, checkpointing="auto",
                              logprob_chunk_tokens=2048, longest_sequence=4096)
    choice.tokens, choice.checkpointing, choice.reason
    seconds = train_seconds(shape, tokens=75_000, hw=hw, ref=True)

FLOPs: model FLOPs = (6 + 2 [ref forward] + 2 [old log-probs forward]) x N_mm x T, with T the
real (unpadded) prompt + response tokens trained on and N_mm the parameters that take part
in a matmul: all of them for tied embeddings (the table is the lm_head's GEMM), less the
input embedding's V x H when untied (a lookup); the active parameters for MoE. Attention's
score FLOPs and activation recompute are not model FLOPs (MFU convention), so a recomputing
run shows a lower MFU for the same GEMM efficiency. Seconds = model FLOPs / the profile's
train_flops_per_s, the model-FLOP rate a card's trainer reaches (`handoff bench
train-compute` measures it).

Memory: in the training phase the card holds the trainer state (full-parameter: 16N/n, the
params, grads, fp32 master + Adam; LoRA: the frozen base and the adapters' state, RunPlan's
train_state_bytes) and the resident bytes; activations get ACTIVATION_SHARE of what is left.
Per token (bf16, act = 2 bytes), from what autograd keeps for a Llama / Qwen3 layer: each
RMSNorm its fp32 input and bf16 output (6 B x width; q/k norms too), q and k after RoPE,
v, the attention output, and the MLP's gate, up, SiLU(gate) and product (8 B x intermediate):
  per layer  12H + 12 (heads x head_dim) + 12 (kv heads x head_dim) + 8I   bytes
  no recompute  (L + 1) x per layer;  recompute  L x 2H (the layer inputs) + 2 x per layer
  full logits   + ~18 x V per token (bf16 logits, their fp32 copy, log-softmax and softmax)
and per micro-batch, fixed: the chunked head's buffers (chunk x V x 14 B, the weight's fp32
gradient accumulator), FSDP's unsharded root (embedding/head) and two prefetched layers. A
rough model by design: `handoff bench train-compute` prints measured peak bytes per token
beside it, and an explicit actor.micro_batch_tokens always wins.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from handoff.errors import HandoffError
from handoff.plan.hardware import GB, HardwareProfile
from handoff.config import MemoryConfig
from handoff.plan.ledger import Dtypes, exposed_seconds
from handoff.plan.shapes import ModelShape

ACTIVATION_SHARE = 0.8                 # of the room left beside state + resident
MIN_TOKENS_WITHOUT_RECOMPUTE = 8192    # a micro-batch this large keeps the GEMMs efficient
TOKEN_ALIGN = 256
MAX_MICRO_BATCH_TOKENS = 1 << 17


def matmul_params(shape: ModelShape) -> int:
    """Parameters a token's forward multiplies by (see the module docstring)."""
    lookup = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
    return shape.active_params - lookup


def model_flops(shape: ModelShape, tokens: float, *, ref: bool = True,
                old_logprobs: bool = False, lora: bool = False) -> float:
    """6 N T for the actor's forward + backward, 2 N T per extra forward (ref, old policy);
    with `lora` 4 N T: a frozen base's backward computes the activations' gradients only (the
    adapters' own FLOPs, rank x (in + out) per token and projection, are left out)."""
    passes = (4 if lora else 6) + (2 if ref else 0) + (2 if old_logprobs else 0)
    return passes * matmul_params(shape) * tokens


def train_seconds(shape: ModelShape, tokens: float, hw: HardwareProfile, *, ref: bool = True,
                  old_logprobs: bool = False, lora: bool = False) -> float:
    """The trainer's compute seconds per card for `tokens` trained on that card."""
    return model_flops(shape, tokens, ref=ref, old_logprobs=old_logprobs,
                       lora=lora) / hw.train_flops_per_s


def forward_seconds(shape: ModelShape, tokens: float, hw: HardwareProfile) -> float:
    """One forward pass over `tokens` (2 N T model FLOPs): the ref's, or the old policy's."""
    return 2 * matmul_params(shape) * tokens / hw.train_flops_per_s


def exposed_behind_compute(seconds: dict[str, float], memory: MemoryConfig, shape: ModelShape,
                           tokens: float, hw: HardwareProfile, *, ref: bool,
                           updates_per_step: int, generation_seconds: float | None,
                           elastic_pool: bool, lora: bool = False,
                           lora_order: bool | None = None) -> tuple[float, dict[str, float]]:
    """(The trainer's compute seconds over `tokens`, each switch action's exposed seconds
    behind that compute and generation: plan.ledger.exposed_seconds with this module's
    forward and compute times.) The plan and a run's report price a step with it. `lora`:
    a frozen base's compute; `lora_order`: plan.order's LoRA moves (default `lora`; a base
    held twice computes as LoRA but moves in the full-parameter order)."""
    train_s = train_seconds(shape, tokens, hw, ref=ref, old_logprobs=updates_per_step > 1,
                            lora=lora)
    return train_s, exposed_seconds(seconds, memory, compute_seconds=train_s,
                                    forward_seconds=forward_seconds(shape, tokens, hw),
                                    generation_seconds=generation_seconds,
                                    elastic_pool=elastic_pool, ref=ref,
                                    updates_per_step=updates_per_step,
                                    lora=lora if lora_order is None else lora_order)


def _intermediate(shape: ModelShape) -> int:
    """MLP width per token: the dense FFN, or the routed experts a token visits (MoE)."""
    tables = 1 if shape.tie_word_embeddings else 2
    dense = shape.active_params - tables * shape.vocab_size * shape.hidden_size
    attn = shape.hidden_size * (2 * shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    per_layer = max(dense / max(shape.num_layers, 1) - attn, 0)
    return int(per_layer / (3 * shape.hidden_size))


def layer_activation_bytes(shape: ModelShape, act_bytes: int = 2) -> float:
    """Bytes one token's activations take in one decoder layer, kept for backward."""
    h, d = shape.hidden_size, shape.head_dim
    per = 12 * h + 12 * shape.num_heads * d + 12 * shape.num_kv_heads * d + 8 * _intermediate(shape)
    return per * act_bytes / 2


def activation_bytes_per_token(shape: ModelShape, *, checkpointing: bool, chunked_head: bool,
                               act_bytes: int = 2) -> float:
    layer = layer_activation_bytes(shape, act_bytes)
    if checkpointing:
        body = shape.num_layers * shape.hidden_size * act_bytes + 2 * layer
    else:
        body = (shape.num_layers + 1) * layer
    head = 0.0 if chunked_head else 18.0 * shape.vocab_size
    return body + head + 8 * shape.hidden_size


def fixed_activation_bytes(shape: ModelShape, *, logprob_chunk_tokens: int,
                           act_bytes: int = 2) -> float:
    table = shape.vocab_size * shape.hidden_size
    head = (logprob_chunk_tokens * shape.vocab_size * 14 + table * (4 + act_bytes)
            if logprob_chunk_tokens > 0 else 0.0)
    layer_params = (shape.num_params - table) / max(shape.num_layers, 1)
    return head + 2 * table * act_bytes + 2 * layer_params * act_bytes


def full_train_state_bytes(shape: ModelShape, dtypes: Dtypes, shard: int) -> int:
    """Full-parameter trainer state per card: params, grads, fp32 master + Adam, 16N/n."""
    return math.ceil(shape.num_params * dtypes.train_state_bytes / shard)


def training_room_bytes(shape: ModelShape, hw: HardwareProfile, *, dtypes: Dtypes,
                        shard: int, state_bytes: int | None = None) -> float:
    """HBM left in the update beside the trainer state (`state_bytes` per card; None: the
    full-parameter 16N/n) and the resident bytes."""
    state = full_train_state_bytes(shape, dtypes, shard) if state_bytes is None else state_bytes
    return hw.hbm_bytes - hw.resident_bytes - state


@dataclass(frozen=True)
class MicroBatchChoice:
    tokens: int                   # actor.micro_batch_tokens
    checkpointing: bool           # actor.gradient_checkpointing
    bytes_per_token: float        # the model's activation bytes per token at that setting
    fixed_bytes: float
    room_bytes: float             # what activations were given (ACTIVATION_SHARE of the room)
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def _budget(room: float, per_token: float, fixed: float) -> int:
    tokens = int((room - fixed) // per_token) if room > fixed else 0
    return min(tokens // TOKEN_ALIGN * TOKEN_ALIGN, MAX_MICRO_BATCH_TOKENS)


def pick_micro_batch(shape: ModelShape, hw: HardwareProfile, *, dtypes: Dtypes, shard: int,
                     checkpointing: bool | str = "auto", logprob_chunk_tokens: int = 0,
                     longest_sequence: int = 0, tokens: int | str = "auto",
                     state_bytes: int | None = None) -> MicroBatchChoice:
    """The packed micro-batch's token budget and the recompute setting for this card
    (`state_bytes`: the trainer state per card, training_room_bytes).

    checkpointing="auto": off when a budget of >= MIN_TOKENS_WITHOUT_RECOMPUTE tokens (and
    the longest sequence) fits without it, else on. tokens: "auto" sizes the budget from the
    room; an int keeps it (and only decides checkpointing)."""
    room = ACTIVATION_SHARE * training_room_bytes(shape, hw, dtypes=dtypes, shard=shard,
                                                  state_bytes=state_bytes)
    act = dtypes.param_bytes
    fixed = fixed_activation_bytes(shape, logprob_chunk_tokens=logprob_chunk_tokens,
                                   act_bytes=act)
    chunked = logprob_chunk_tokens > 0

    def per(ckpt: bool) -> float:
        return activation_bytes_per_token(shape, checkpointing=ckpt, chunked_head=chunked,
                                          act_bytes=act)

    need = max(MIN_TOKENS_WITHOUT_RECOMPUTE, longest_sequence)
    if checkpointing == "auto":
        wanted = need if tokens == "auto" else int(tokens)
        ckpt = _budget(room, per(False), fixed) < wanted
    else:
        ckpt = bool(checkpointing)
    budget = _budget(room, per(ckpt), fixed) if tokens == "auto" else int(tokens)
    gb = f"{room / GB:.1f} GB"
    if tokens == "auto" and budget < max(longest_sequence, 1):
        how = "" if ckpt else "; enable actor.gradient_checkpointing"
        raise HandoffError(f"the training phase leaves {gb} for activations: {budget} tokens per "
                         f"micro-batch, below the longest sequence ({longest_sequence}){how} "
                         "or shard over more cards")
    why = (f"{budget} tokens x {per(ckpt) / 2**20:.2f} MiB/token + {fixed / GB:.1f} GB fixed "
           f"in {gb} for activations; recompute {'on' if ckpt else 'off'}")
    return MicroBatchChoice(tokens=budget, checkpointing=ckpt, bytes_per_token=per(ckpt),
                            fixed_bytes=fixed, room_bytes=room, reason=why)
