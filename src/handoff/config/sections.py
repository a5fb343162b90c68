"""The config tree's sections: one dataclass each, every field with its help text and
accepted range (`F`), read by `handoff.config.loading` (YAML, overrides, validation) and
listed by `handoff config`. Imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


def F(default: Any = dataclasses.MISSING, *, help: str, ge: float | None = None,
      gt: float | None = None, le: float | None = None, lt: float | None = None,
      choices: tuple | None = None, default_factory: Any = dataclasses.MISSING,
      auto: bool = False) -> Any:
    """A config field with its help text and accepted range (checked by `validate`);
    auto=True also accepts the string 'auto' (resolved where the field is used)."""
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices,
            "auto": auto}
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    path: str = F("tiny-qwen3", help="HF checkpoint dir (plan: or its config.json), a preset "
                  "name (random weights), or a Hub id org/name in the local Hugging Face cache")
    dtype: str = F("bfloat16", help="dtype of params in the engine and the trainer's compute",
                   choices=("bfloat16", "float16", "float32"))


@dataclass
class HardwareConfig:
    name: str = F("h100-sxm", help="hardware preset (h100-sxm, h200, a100-80g, cpu)")
    hbm_gb: float | None = F(None, help="HBM per card in GB (None: the preset's)", gt=0)
    pinned_pcie_gbps: float | None = F(None, help="pinned host<->device GB/s per direction", gt=0)
    nvlink_gbps: float | None = F(None, help="NVLink GB/s per card", gt=0)
    decode_bw_tbps: float | None = F(None, help="effective HBM bandwidth of a decode step, TB/s",
                                     gt=0)
    activation_peak_gb: float | None = F(None, help="engine activation peak (profiled), GB", ge=0)
    graph_pool_gb: float | None = F(None, help="resident CUDA graph pool, GB", ge=0)
    host_ram_gb: float | None = F(None, help="host RAM per node, GB", gt=0)
    gpus_per_node: int | None = F(None, help="cards per node (None: the preset's)", ge=1)
    resident_gb: float | None = F(None, help="CUDA contexts, NCCL buffers, allocator residue, GB",
                                  ge=0)
    train_activation_gb: float | None = F(None, help="trainer activation peak per card, GB", ge=0)
    d2d_gbps: float | None = F(None, help="device copy GB/s, read + write", gt=0)
    sync_copy_gbps: float | None = F(None, help="GB/s (read + write) of an in-process weight "
                                     "sync's copies, a kernel per tensor", gt=0)
    map_gbps: float | None = F(None, help="cuMemMap rate of a waking region, GB/s", gt=0)
    unmap_gbps: float | None = F(None, help="cuMemUnmap rate of a sleeping region, GB/s", gt=0)
    sync_bucket_ms: float | None = F(None, help="weight-sync overhead per bucket (IPC, ACK), ms",
                                     ge=0)
    sync_tensor_us: float | None = F(None, help="host work per tensor of an in-process weight "
                                     "sync, us", ge=0)
    train_tflops: float | None = F(None, help="model TFLOP/s the trainer reaches per card "
                                   "(`handoff bench train-compute`), for the step time", gt=0)


@dataclass
class ParallelConfig:
    gpus: int = F(1, help="total cards", ge=1)
    shard_size: int | None = F(None, help="FSDP sharding group size (None: all cards)", ge=1)
    tp: int = F(1, help="tensor parallel size of the rollout engine", ge=1)


@dataclass
class MemoryConfig:
    param_offload: bool = F(True, help="move the actor's bf16 params to pinned host RAM for rollout")
    optimizer_offload: bool = F(True, help="move fp32 master + Adam state to pinned host RAM")
    ref_offload: bool = F(True, help="keep the reference model in host RAM except its forward")
    offload_mode: str = F("arena", help="arena: our pinned staging arena; fsdp: FSDP2 CPUOffloadPolicy",
                          choices=("arena", "fsdp"))
    wake_margin_mb: int = F(256, help="free memory a wake must leave beyond the region bytes", ge=0)
    overlap: bool = F(True, help=(
        "the streamed switch: the optimizer's copy back runs behind the ref's and the actor's "
        "compute, the ref is dropped after its forward without a copy (its host copy is "
        "unchanged), and with rollout.kv_pool=elastic generation starts while the copies to "
        "the host run (false: every copy waited for in turn, docs/ARCHITECTURE.md)"))
    warm_gemms: bool = F(True, help=(
        "memory.overlap: before the copies back are queued beside a forward, launch its GEMM "
        "shapes not launched before (a cuBLAS kernel's first launch waits for the copies in "
        "flight; trainer/gemm_warmup.py)"))
    optimizer_back_programs: int = F(0, ge=0, help=(
        "memory.overlap: 0, the optimizer's copy back runs on the copy engines; N, by a kernel "
        "of N programs (thread blocks: a few SMs) beside the forwards and backwards, off the "
        "copy engines, whose queue the trainer's own device copies wait behind (the ledger "
        "prices it at the copy engines' rate)"))


# rollout.decode_gemm's answers (rollout/gemm_choice.py says what each runs).
DECODE_GEMMS = ("cublas", "cublaslt", "triton", "auto")


@dataclass
class RolloutConfig:
    gpu_memory_utilization: float = F(0.5, help="share of HBM the engine may use (kv_pool="
                                      "fixed)", gt=0, le=1)
    kv_pool: str = F("fixed", choices=("fixed", "elastic"), help=(
        "fixed: the KV pool is sized once from gpu_memory_utilization; elastic: each wake maps "
        "what the card has free and the pool grows as the trainer's state leaves (CUDA VMM)"))
    num_blocks: int | None = F(None, help="KV blocks (None: size from gpu_memory_utilization)", ge=1)
    block_size: int = F(16, help="tokens per KV block", ge=1, le=1024)
    max_num_seqs: int = F(256, help="most sequences decoded at once", ge=1)
    max_model_len: int = F(4096, help="longest prompt + response in tokens", ge=2)
    kv_dtype: str = F("auto", help="KV cache dtype (auto: the model dtype)", choices=("auto", "fp8"))
    cuda_graphs: bool = F(True, help="capture decode as CUDA graphs (CUDA only)")
    graph_sampling: bool = F(True, help=(
        "the LM head and the sampler inside the decode graphs, so a decode step is two "
        "replays (with cuda_graphs; false: they run eagerly after the model's graph)"))
    decode_gemm: str = F("cublas", choices=DECODE_GEMMS, help=(
        "the decode step's matrix products (CUDA): cublas, PyTorch's default; cublaslt; "
        "triton, our one-kernel product for batches of <= 32 (LoRA's shrink in the same "
        "launch), cuBLAS above; auto times each at each batch size at start and keeps the "
        "fastest"))
    readback_by_kernel: bool = F(True, help=(
        "each step's tokens and log-probs go to the host by a kernel, not the copy engines, "
        "where they would wait behind the trainer's state going to the host under generation "
        "(CUDA only; false: a copy)"))
    temperature: float = F(1.0, help="sampling temperature (0: greedy)", ge=0)
    top_p: float = F(1.0, help="nucleus sampling mass", gt=0, le=1)
    top_k: int = F(0, help="keep the k most likely tokens (0: all)", ge=0)
    n: int = F(4, help="samples per prompt (the GRPO group size: each sample's advantage is "
               "relative to its group, so a group of one learns nothing)", ge=2)
    max_tokens: int = F(64, help="most new tokens per sample", ge=1)
    response_lengths: str | None = F(None, help="benchmarks: each sample's length drawn from "
                                     "fixed:N, uniform:min=A,max=B or lognormal:median=M,"
                                     "sigma=S,max=X (EOS ignored, capped at max_tokens); "
                                     "None: the model's own lengths")


# The Linear projections of a dense decoder layer a LoRA adapter may target (HF names).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraConfig:
    rank: int = F(0, ge=0, help="LoRA rank of the actor's adapters (0: off, full-parameter "
                  "training; the reference is then the actor with its adapters off)")
    alpha: float = F(16.0, gt=0, help="LoRA scaling numerator (the update is alpha / rank x B A)")
    dropout: float = F(0.0, ge=0, lt=1, help="dropout on the adapters' input")
    target_modules: list[str] = F(default_factory=lambda: list(LORA_TARGETS), choices=LORA_TARGETS,
                                  help="the projections of every decoder layer that get an "
                                  "adapter")
    share_base: bool = F(True, help="one copy of the base per card: the trainer's frozen base is "
                         "a view of the engine's weights, which never move (false: the trainer "
                         "keeps its own FSDP-sharded base, and the engine's sleep backs its "
                         "base up to pinned host memory, its wake restores it; the sync copies "
                         "the adapters only either way; needed with parallel.tp > 1)")

    @property
    def shares_base(self) -> bool:
        """LoRA on one copy of the base: the engine's weights are the trainer's frozen base
        (plan.order's `lora` order)."""
        return self.rank > 0 and self.share_base


@dataclass
class ActorConfig:
    lr: float = F(1e-5, help="AdamW learning rate", gt=0, le=1)
    weight_decay: float = F(0.0, help="AdamW weight decay", ge=0)
    clip_low: float = F(0.2, help="PPO ratio clip below 1", ge=0, lt=1)
    clip_high: float = F(0.2, help="PPO ratio clip above 1 (clip-higher when > clip_low)", ge=0)
    kl_coef: float = F(0.0, help="KL-to-reference coefficient (0: no reference model)", ge=0)
    entropy_coef: float = F(0.0, help="entropy bonus coefficient", ge=0)
    micro_batch_size: int = F(8, help="sequences per forward/backward (right-padded rows; "
                              "used when micro_batch_tokens=0)", ge=1)
    micro_batch_tokens: int | str = F(0, auto=True, ge=0, help=(
        "pack whole sequences up to this many tokens per forward/backward, attention kept "
        "inside each sequence (0: right-padded rows of micro_batch_size; auto: the budget the "
        "card's memory leaves in the training phase, handoff.plan.trainer)"))
    logprob_chunk_tokens: int = F(0, ge=0, help=(
        "score this many tokens at a time in lm_head + log-softmax, recomputed in backward: no "
        "[tokens x vocab] fp32 logits (0: the full logits)"))
    grad_clip: float = F(1.0, help="max global grad norm (0: no clipping)", ge=0)
    gradient_checkpointing: bool | str = F(False, auto=True, help=(
        "recompute activations in backward (auto: only when a micro-batch of "
        "handoff.plan.trainer.MIN_TOKENS_WITHOUT_RECOMPUTE tokens would not fit without it)"))
    updates_per_step: int = F(1, help="optimizer steps per rollout batch", ge=1)
    loss_agg: str = F("token_mean", choices=("token_mean", "seq_mean", "seq_mean_token_sum_norm"),
                      help=(
        "how a step's per-token losses become one: token_mean, over all its response tokens "
        "(DAPO); seq_mean, each sequence's token mean averaged over sequences (the GRPO paper); "
        "seq_mean_token_sum_norm, each sequence's token sum / rollout.max_tokens averaged over "
        "sequences (Dr. GRPO)"))
    scale_advantages: bool = F(True, help=(
        "divide each group's centred rewards by the group's std (false: Dr. GRPO's unscaled "
        "advantages)"))
    lr_schedule: str = F("constant", choices=("constant", "cosine", "linear"), help=(
        "learning rate over the run's optimizer steps (run.steps * updates_per_step): after "
        "the warm-up, constant, or a cosine or linear fall towards 0 at the last step"))
    warmup_steps: int = F(0, ge=0, help=(
        "optimizer steps of linear warm-up from actor.lr / warmup_steps to actor.lr"))
    compile: bool | str = F("auto", auto=True, help=(
        "torch.compile each decoder layer's forward (actor and reference): norms, RoPE and "
        "SwiGLU fused; the first micro-batches pay for the compile (handoff.trainer.compiled; "
        "kept across runs in $HANDOFF_CACHE/compile, HANDOFF_COMPILE_CACHE=0: off). auto: on "
        "for a CUDA run whose steps repay the compile (handoff.plan.compile), off on CPU"))
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class SyncConfig:
    bucket_mb: int = F(512, help="weight-sync bucket size in MB", ge=1)
    verify: bool = F(False, help="checksum every bucket on both sides")


@dataclass
class DataConfig:
    task: str = F("arithmetic", help="arithmetic | gsm8k | file", choices=("arithmetic", "gsm8k", "file"))
    path: str | None = F(None, help="for task=file (or gsm8k): a JSONL or Parquet file, a "
                         "`datasets` save_to_disk directory, or a Hub dataset id already in the "
                         "local Hugging Face cache (never downloaded)")
    prompt_field: str = F("prompt", help="field that holds the prompt")
    answer_field: str | None = F("answer", help=(
        "field that holds the reference answer (a dotted name reads a nested field: "
        "reward_model.ground_truth in verl's files); null: prompts only, scored by "
        "reward.functions of your own (a format, length or judge reward)"))
    difficulty: int = F(1, help="arithmetic: digits per operand", ge=1, le=9)
    ops: str = F("+-", help="arithmetic: operators to draw from, a mix of + - *")
    context_chars: int = F(0, help="arithmetic: a filler passage of about this many characters "
                           "before each question (reasoning-length prompts for benchmarks; "
                           "one token per character with the presets' byte-level tokenizer)",
                           ge=0)
    prompts_per_step: int = F(8, help="prompts per step (each sampled rollout.n times)", ge=1)
    chat_template: bool = F(True, help="apply the tokenizer's chat template when it has one")
    split: str = F("train", help="the split of a `datasets` directory (save_to_disk) or of a Hub "
                   "dataset id in data.path (read from the local Hugging Face cache only)")
    subset: str | None = F(None, help="the configuration of a Hub dataset id (e.g. main for "
                           "openai/gsm8k; None: its only or default one)")
    eval_path: str | None = F(None, help="an evaluation set, read as data.path is (JSONL, "
                              "Parquet, a save_to_disk directory or a cached Hub id; None: none)")
    eval_split: str = F("test", help="the split of data.eval_path when it is a `datasets` "
                        "directory or a Hub id")


@dataclass
class WorkloadConfig:
    prompt_len: int = F(1024, help="mean prompt length P in tokens", ge=1)
    response_len: int = F(7168, help="mean response length L in tokens", ge=1)
    max_response_len: int | None = F(None, help="longest response (the long tail; None: none)",
                                     ge=1)
    tokens_per_step: float | None = F(None, help="generated tokens per step across all cards", gt=0)
    step_seconds: float | None = F(None, help="measured step time, if known", gt=0)


@dataclass
class RunConfig:
    # Bounded so that a typo (1e12) is refused at once, not a preflight that counts saves
    # for hours: 10**7 steps is years of training at the fastest step handoff takes.
    steps: int = F(10, help="training steps (at most 10**7)", ge=1, le=10**7)
    out_dir: str = F("runs/default", help="output directory (metrics, timeline, checkpoints)")
    # torch.manual_seed and numpy's generators take a non-negative 64-bit integer.
    seed: int = F(0, help="global seed (0 .. 2**63-1: torch's and numpy's seed range)", ge=0,
                  le=2**63 - 1)
    device: str = F("auto", help="auto | cpu | cuda", choices=("auto", "cpu", "cuda"))
    save_every: int = F(0, help="checkpoint every N steps (0: only at the end)", ge=0)
    checkpoint: bool = F(True, help="write checkpoints (false: a benchmark run that keeps none)")
    keep_checkpoints: int = F(2, help="complete checkpoints kept on disk: the newest K (older "
                              "ones are deleted once a newer one is published)", ge=1)
    resume: bool = F(False, help="resume from the last complete checkpoint in out_dir")
    overwrite: bool = F(False, help="replace an earlier run in out_dir (its metrics, summary, "
                        "config and checkpoints); without it a used out_dir is refused")
    rates_file: str | None = F(None, help="price the ledger with the rates an earlier run on "
                               "this card measured (its summary.json) instead of measuring them "
                               "at start (handoff bench sweep's points)")
    loggers: list[str] = F(default_factory=lambda: ["tensorboard"],
                           choices=("tensorboard", "wandb", "mlflow"), help=(
        "where each step's metrics also go (metrics.jsonl always): tensorboard (out_dir/"
        "tensorboard), wandb (pip install 'handoff[wandb]'; WANDB_MODE=offline keeps it in "
        "out_dir/wandb), mlflow (pip install 'handoff[mlflow]'; out_dir/mlruns unless "
        "MLFLOW_TRACKING_URI is set); e.g. run.loggers=[tensorboard,wandb]"))
    wandb_project: str | None = F(None, help="wandb project (None: 'handoff'); the run is "
                                  "named after run.out_dir")
    log_samples: int = F(4, ge=0, help="completions per step written to out_dir/samples.jsonl "
                         "(prompt, completion, reward) and logged as text (0: none)")
    eval_every: int = F(0, help="score the evaluation set (data.eval_path) every N steps "
                        "(0: never)", ge=0)


@dataclass
class RewardConfig:
    functions: list[str] = F(default_factory=list, help=(
        "rewards to score with, each FILE.py:NAME (a path relative to the current directory, "
        "as data.path), module.path:NAME, or a built-in handoff:task | handoff:numeric | "
        "handoff:exact; TRL- and verl-style functions are told apart by their parameters "
        "(handoff/rewards); empty: the task's own grader. The named code runs: it is yours"))
    weights: list[float] | None = F(None, help="one weight per reward function, in order "
                                    "(None: all 1.0); the reward is the weighted sum, a None "
                                    "value skipped as TRL does")
    workers: int = F(0, ge=0, help="score FILE.py / module rewards in a pool of this many "
                     "processes, each loading the functions itself (0: in this process; "
                     "built-ins and functions passed from Python always run in process)")


@dataclass
class EvalConfig:
    n: int = F(0, ge=0, help="problems of data.eval_path scored per evaluation, the first n in "
               "file order (0: all of them); task=arithmetic without data.eval_path: n problems "
               "of a stream no run trains on (0: no evaluation)")
    temperature: float = F(0.0, ge=0, help="sampling temperature of an evaluation (0: greedy)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    data: DataConfig = field(default_factory=DataConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    run: RunConfig = field(default_factory=RunConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


# ---------------------------------------------------------------- loading
