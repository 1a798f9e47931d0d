"""Names other tools give our keys (HF Trainer, accelerate, torchtune, axolotl, torchrun, sbatch): the hints of "unknown key".

A user arriving from another tool types its names first; the error then says what ours is instead of
a bare "unknown key". docs/migrating.md holds the same table for reading.
"""

from __future__ import annotations

_EPOCHS = (
    "runs here are counted in optimizer steps: set train.max_steps to epochs x examples / global batch "
    "(train.micro_batch_size x train.grad_accum_steps x ranks), e.g. train.max_steps=3000"
)
_PRECISION = "pick the precision group instead: precision=bf16 (or fp16, tf32, fp32)"
_EVAL_DTYPE = (
    "use precision.eval_dtype, the autocast dtype of evaluation (null: the training dtype), "
    "e.g. precision.eval_dtype=bfloat16 (or float16, float32)"
)
_ATTENTION = (
    "use model.attention=auto (or sdpa, varlen, flex): on CUDA, torch's SDPA runs its flash kernel for "
    "causal attention without a mask, and packed documents go through per-document spans (varlen) or a "
    "FlexAttention block mask (flex), so the flash_attn package is not needed; model.attention=flash_attention_2 "
    "uses it for a Hugging Face model on CUDA in bf16 or fp16 where it is installed"
)
_COMPILE_MODE = (
    "pick the compile group instead: compile=default (or reduce_overhead, max_autotune), or compile.mode; "
    "the backend is always inductor"
)

ALIASES: dict[str, str] = {
    # Hugging Face TrainingArguments (and accelerate)
    "per_device_train_batch_size": "use train.micro_batch_size (sequences per rank per pass), e.g. train.micro_batch_size=8",
    "per_device_eval_batch_size": "evaluation uses train.micro_batch_size too; train.eval_batches sets how many",
    "train_batch_size": "use train.micro_batch_size (per rank); the global batch is micro x train.grad_accum_steps x ranks",
    "batch_size": "use train.micro_batch_size (sequences per rank per pass), e.g. train.micro_batch_size=8",
    "gradient_accumulation_steps": "use train.grad_accum_steps, e.g. train.grad_accum_steps=4",
    "learning_rate": "use optimizer.lr, e.g. optimizer.lr=3e-4",
    "lr": "use optimizer.lr, e.g. optimizer.lr=3e-4",
    "warmup_ratio": "use scheduler.warmup_ratio (a fraction of train.max_steps), e.g. scheduler.warmup_ratio=0.03",
    "num_warmup_steps": "use scheduler.warmup_steps, e.g. scheduler.warmup_steps=100",
    "num_train_epochs": _EPOCHS,
    "num_epochs": _EPOCHS,
    "epochs": _EPOCHS,
    "bf16": _PRECISION,
    "fp16": _PRECISION,
    "tf32": _PRECISION,
    "mixed_precision": _PRECISION,
    "dtype": _PRECISION,
    "lr_scheduler_type": "pick the scheduler group instead: scheduler=cosine (or linear, constant, inverse_sqrt)",
    "lr_scheduler": "pick the scheduler group instead: scheduler=cosine (or linear, constant, inverse_sqrt)",
    "optim": "pick the optimizer group instead: optimizer=adamw (or sgd, adafactor, adamw_8bit, lion_8bit, paged_adamw_8bit, muon, adamw_schedule_free)",
    "adam_beta1": "use optimizer.betas, e.g. optimizer.betas=[0.9,0.95]",
    "adam_beta2": "use optimizer.betas, e.g. optimizer.betas=[0.9,0.95]",
    "adam_epsilon": "use optimizer.eps, e.g. optimizer.eps=1e-8",
    "logging_steps": "use train.log_every (optimizer steps between metrics records), e.g. train.log_every=10",
    "save_steps": "use checkpoint.every (optimizer steps between checkpoints), e.g. checkpoint.every=500",
    "save_total_limit": "use checkpoint.keep (checkpoints kept), e.g. checkpoint.keep=3",
    "eval_steps": "use train.eval_every (optimizer steps between evaluations; null: none), e.g. train.eval_every=200",
    "eval_strategy": "use train.eval_every (optimizer steps between evaluations; null: none)",
    "evaluation_strategy": "use train.eval_every (optimizer steps between evaluations; null: none)",
    "output_dir": "use run_dir, e.g. run_dir=runs/exp1 (null: runs/<name>-<timestamp>)",
    "resume_from_checkpoint": "use resume: resume=auto (the newest checkpoint of run_dir) or resume=PATH",
    "gradient_checkpointing": "pick the memory group instead: memory=checkpoint_all (or checkpoint_attention, checkpoint_every_2)",
    "enable_activation_checkpointing": "pick the memory group instead: memory=checkpoint_all",
    "clip_grad_norm": "use train.max_grad_norm, e.g. train.max_grad_norm=1.0 (null: no clipping)",
    "dataloader_num_workers": "use data.num_workers",
    "torch_compile": "pick the compile group instead: compile=default (or reduce_overhead, max_autotune)",
    "deepspeed": "pick a ZeRO stage of the parallel group: parallel=zero0, zero1, zero2, zero3 or zero3_offload",
    "fsdp": "pick the parallel group instead: parallel=fsdp (or fsdp_hybrid, fsdp_offload, fsdp_shard_grad_op)",
    "model_name_or_path": "use model=hf model.path=NAME_OR_FOLDER",
    "base_model": "use model=hf model.path=NAME_OR_FOLDER",
    "max_seq_length": "use data.seq_len (tokens per sequence), e.g. data.seq_len=2048",
    "max_length": "use data.seq_len (tokens per sequence), e.g. data.seq_len=2048",
    "sequence_len": "use data.seq_len (tokens per sequence), e.g. data.seq_len=2048",
    "sample_packing": "use data.packing",
    "fp16_full_eval": _EVAL_DTYPE,
    "bf16_full_eval": _EVAL_DTYPE,
    "torch_empty_cache_steps": "use memory.empty_cache_steps (CUDA), e.g. memory.empty_cache_steps=100",
    "auto_find_batch_size": (
        "pick memory=auto_batch, which finds the largest micro batch that fits before training and keeps the "
        "global batch through accumulation (memory.max_micro_batch_size caps it)"
    ),
    "group_by_length": "use data.batching=group_by_length (unpacked documents: with data.packing=false)",
    "torch_compile_backend": _COMPILE_MODE,
    "torch_compile_mode": _COMPILE_MODE,
    "torch_compile_fullgraph": "use compile.fullgraph=true (with compile=default or another mode)",
    "use_flash_attention_2": _ATTENTION,
    "attn_implementation": _ATTENTION,
    "ddp_find_unused_parameters": (
        "use parallel.find_unused_parameters=true with parallel=ddp, rarely needed: DDP watches only trained "
        "parameters, so a frozen base under adapters needs nothing; set it only where a trained parameter "
        "gets no gradient in some step (it walks the graph every step)"
    ),
    "ddp_bucket_cap_mb": "use parallel.bucket_mb (with parallel=ddp), e.g. parallel.bucket_mb=50",
    "fsdp_config": (
        "pick parallel=fsdp and set its keys: parallel.reshard_after_forward=false (SHARD_GRAD_OP), "
        "parallel.cpu_offload=true (offload), parallel.prefetch_layers (prefetch), parallel.replicate_degree "
        "(HYBRID_SHARD); activation checkpointing is memory=checkpoint_all; every transformer block is "
        "wrapped on its own already"
    ),
    "val_set_size": "use data.val_fraction (a share of the data, e.g. 0.05)",
    # axolotl / peft
    "adapter": "pick the quantization group instead: quantization=lora (or dora, nf4_lora, int8_lora)",
    "load_in_4bit": "pick the quantization group instead: quantization=nf4_lora (QLoRA) or nf4",
    "load_in_8bit": "pick the quantization group instead: quantization=int8_lora or int8",
    "lora_r": "use quantization.lora.rank (with quantization=lora)",
    "lora_alpha": "use quantization.lora.alpha (with quantization=lora)",
    "lora_dropout": "use quantization.lora.dropout (with quantization=lora)",
    "lora_target_modules": "use quantization.lora.targets (with quantization=lora)",
    # torchrun / accelerate launch
    "nproc_per_node": "use launcher.nproc (ranks per node) with launcher=local, e.g. launcher=local launcher.nproc=2",
    "num_processes": "use launcher.nproc (ranks per node; x launcher.nnodes in all), e.g. launcher.nproc=8",
    "num_machines": "use launcher.nnodes (launcher=slurm, or launcher=local with one `train` per node)",
    "rdzv_endpoint": "use launcher.rdzv_endpoint=HOST:PORT (with launcher.nnodes and launcher.node_rank)",
    "node_rank": "use launcher.node_rank (with launcher=local launcher.nnodes=N launcher.rdzv_endpoint=HOST:PORT)",
    "machine_rank": "use launcher.node_rank (with launcher=local launcher.nnodes=N launcher.rdzv_endpoint=HOST:PORT)",
    "rdzv_id": "use launcher.rdzv_id (the same on every node)",
    "main_process_port": "use launcher.master_port",
    # sbatch
    "ntasks_per_node": "use launcher.nproc (tasks = ranks per node), e.g. launcher.nproc=4",
    "ntasks": "set launcher.nproc (tasks per node) and launcher.nnodes; SLURM runs nproc x nnodes tasks",
    "nodes": "use launcher.nnodes, e.g. launcher=slurm launcher.nnodes=2",
    "gres": "use launcher.slurm.gpus_per_node (gres=gpu:4 -> launcher.slurm.gpus_per_node=4 launcher.nproc=4)",
    "gpus": "use launcher.slurm.gpus_per_node (= launcher.nproc, one rank per GPU)",
    "time": "use launcher.slurm.time_min, which takes sbatch's formats, e.g. launcher.slurm.time_min=2:00:00",
    "mem": "use launcher.slurm.mem_gb (GB per node), e.g. launcher.slurm.mem_gb=200",
    "job_name": "use name, e.g. name=exp1",
    "output": "the job's log is RUN_DIR/slurm/<job id>.out: set run_dir",
    "exclusive": "add it as an sbatch line: launcher.slurm.extra_sbatch=['--exclusive']",
    "mail_type": "add it as an sbatch line: launcher.slurm.extra_sbatch=['--mail-type=END']",
}
"""A foreign key name (the last part of the dotted key) -> what to set here instead."""


def alias_hint(leaf: str) -> str | None:
    """What to set instead of a key named `leaf` in another tool (dashes as underscores), or None."""
    return ALIASES.get(leaf.lstrip("-").replace("-", "_").lower())
