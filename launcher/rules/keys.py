"""Every public key's domain, checked on every spec: a name among its options, a number in its range, a bool.

KEYS holds one Domain per public key (tests/assets/public_keys.txt), so that no key takes a value
nothing checks: a name-valued key lists its options (whether or not the run reads the key), a
number its range, a switch is a bool, and a key that takes free text (a path, a name, a host)
says so and why. The cross-field rules keep their own, more specific messages: `launcher.rules.check`
reports a domain error only where no other rule named that key alone. Bools given as numbers or
words (`model.bias=2`, `yes`) are refused before composing (launcher.front.override_checks), since
the schema would read them as true; tests/unit/test_key_domains.py tries every key with a wrong
type, an out-of-range value and an unknown option.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from launcher.components.optimizer import OPTIMIZERS
from launcher.config import (
    data,
    distill,
    logger,
    memory,
    model,
    objective,
    precision,
    prune,
    qat,
    quantization,
    reward,
)
from launcher.config.best import MODES as BEST_MODES
from launcher.config.compile import MODES
from launcher.config.eval import GENERATION_MATCHES
from launcher.config.launcher import BACKENDS
from launcher.config.moe import ROUTERS
from launcher.config.optimizer import ADJUST_LR_FNS
from launcher.config.scheduler import DECAY_SHAPES, SCHEDULES
from launcher.config.sweep import METRICS
from launcher.config.tokenizer import TOKENIZER_KINDS
from launcher.parallel.pipeline_split import SCHEDULES as PP_SCHEDULES
from launcher.parallel.registry import STRATEGIES
from launcher.plan.roofline import HARDWARE
from launcher.rules.hardware import Hardware
from launcher.rules.values import FLAG, Domain, Rule, above, at_least, choice, one_of, text, within
from launcher.spec import RunSpec, SpecError

PATH = text("a file or directory; the rules that read it say when it is missing or unreadable")
NAME = text("a name of the user's choosing")
PORT = within(1, 65535)
SEED = within(0, 2**63 - 1)
COUNT = at_least(1)
STEP = at_least(0)
SHARE = within(0, 1, high_open=True)
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")
NONFINITE_POLICIES = ("skip", "stop")
DEVICES = ("auto", "cpu", "cuda")

KEYS: dict[str, Domain] = {
    "checkpoint.async_save": FLAG,
    "checkpoint.every": at_least(1, "null: no periodic checkpoints"),
    "checkpoint.keep": COUNT,
    "checkpoint.keep_best": text("a metric an evaluation writes: launcher.rules.best lists this run's"),
    "checkpoint.keep_best_mode": one_of(BEST_MODES),
    "checkpoint.save_final": FLAG,
    "checkpoint.verify": FLAG,
    "compile.dynamic": FLAG,
    "compile.fullgraph": FLAG,
    "compile.mode": one_of(MODES),
    "data.batching": one_of(data.BATCHING),
    "data.cache_dir": PATH,
    "data.document_mask": FLAG,
    "data.field": text("the record field that holds the text, conversation or token ids"),
    "data.format": one_of(data.FORMATS),
    "data.kind": one_of(data.DATA_KINDS),
    "data.max_bytes": at_least(1, "null: the whole corpus"),
    "data.max_tokens_per_batch": at_least(1, "null: no token budget"),
    "data.num_proc": COUNT,
    "data.num_workers": at_least(0),
    "data.packing": FLAG,
    "data.path": PATH,
    "data.seq_len": at_least(2),
    "data.sources": text("a list of entries; each entry's keys are the data.sources[] keys"),
    "data.sources[].field": text("as data.field"),
    "data.sources[].format": one_of(data.FORMATS),
    "data.sources[].kind": one_of(data.DATA_KINDS),
    "data.sources[].name": NAME,
    "data.sources[].path": PATH,
    "data.sources[].template": text("as data.template"),
    "data.sources[].train_on": one_of(data.TRAIN_ON),
    "data.sources[].val_path": PATH,
    "data.sources[].weight": above(0),
    "data.streaming": FLAG,
    "data.system_prompt_merge": FLAG,
    "data.template": text(
        "a prompt template with {instruction} and {input} (launcher.rules.data reads its fields)"
    ),
    "data.train_on": one_of(data.TRAIN_ON),
    "data.train_reasoning": one_of(data.TRAIN_REASONING),
    "data.val_fraction": SHARE,
    "data.val_path": PATH,
    "distill.beta": within(0, 1),
    "distill.eval_prompts": at_least(0),
    "distill.kd_ratio": within(0, 1),
    "distill.lmbda": within(0, 1),
    "distill.loss": one_of(distill.LOSSES),
    "distill.max_new_tokens": COUNT,
    "distill.mode": one_of(distill.MODES),
    "distill.prompt_tokens": COUNT,
    "distill.sampling_temperature": at_least(0),
    "distill.teacher": PATH,
    "distill.temperature": above(0),
    "distill.top_k": at_least(0),
    "distill.top_p": within(0, 1, low_open=True),
    "dry_run": text("false, true, all or simulate: launcher.rules.choices judges it"),
    "eval.every": at_least(1, "null: the held-out loss's steps, train.eval_every"),
    "eval.lm_eval.batch_size": COUNT,
    "eval.lm_eval.include_path": PATH,
    "eval.lm_eval.limit": above(0),
    "eval.lm_eval.max_gen_tokens": COUNT,
    "eval.lm_eval.num_fewshot": at_least(0),
    "eval.lm_eval.tasks": text(
        "task names: launcher.rules.evaluation lists the local tasks when one is unknown"
    ),
    "eval.generation.answer_field": NAME,
    "eval.generation.batch_size": COUNT,
    "eval.generation.chat": FLAG,
    "eval.generation.extract": text("an extraction: launcher.rules.eval_generation judges it"),
    "eval.generation.limit": COUNT,
    "eval.generation.match": one_of(GENERATION_MATCHES),
    "eval.generation.max_new_tokens": COUNT,
    "eval.generation.pass_at": text("k values: launcher.rules.eval_generation judges them"),
    "eval.generation.prompt_field": NAME,
    "eval.generation.prompts": PATH,
    "eval.generation.samples": COUNT,
    "eval.generation.seed": SEED,
    "eval.generation.temperature": at_least(0, "0: greedy"),
    "eval.generation.top_p": within(0, 1, low_open=True),
    "eval.loss": FLAG,
    "launcher.backend": one_of(BACKENDS),
    "launcher.device": one_of(DEVICES),
    "launcher.master_addr": text("a host name or address"),
    "launcher.master_port": PORT,
    "launcher.max_restarts": at_least(0),
    "launcher.nnodes": COUNT,
    "launcher.node_rank": at_least(0),
    "launcher.nproc": COUNT,
    "launcher.rdzv_endpoint": text("HOST:PORT: launcher.rules.launch judges its form"),
    "launcher.rdzv_id": NAME,
    "launcher.slurm.account": NAME,
    "launcher.slurm.constraint": text("SLURM node features, as sbatch --constraint takes them"),
    "launcher.slurm.cpus_per_task": COUNT,
    "launcher.slurm.extra_sbatch": text("sbatch options: launcher.rules.slurm judges each"),
    "launcher.slurm.gpus_per_node": at_least(0),
    "launcher.slurm.max_requeues": at_least(0),
    "launcher.slurm.mem_gb": above(0),
    "launcher.slurm.partition": NAME,
    "launcher.slurm.port": PORT,
    "launcher.slurm.qos": NAME,
    "launcher.slurm.signal": text("a signal name: launcher.rules.slurm judges it"),
    "launcher.slurm.signal_lead_s": at_least(1),
    "launcher.slurm.time_min": text("an sbatch time limit: launcher.rules.slurm judges its form"),
    "launcher.slurm.wait": FLAG,
    "launcher.timeout_s": above(0),
    "log.progress": FLAG,
    "log.progress_every_s": above(0, "null: never"),
    "log.summary_table": FLAG,
    "log.verbose": FLAG,
    "logger.mlflow.enabled": FLAG,
    "logger.mlflow.experiment": NAME,
    "logger.mlflow.tracking_uri": text(
        "file:/PATH or http(s)://HOST: launcher.rules.loggers judges its form"
    ),
    "logger.tensorboard.enabled": FLAG,
    "logger.wandb.enabled": FLAG,
    "logger.wandb.entity": NAME,
    "logger.wandb.mode": one_of(logger.WANDB_MODES),
    "logger.wandb.project": NAME,
    "memory.activation_checkpointing": one_of(memory.ACTIVATION_CHECKPOINTING),
    "memory.auto_micro_batch": FLAG,
    "memory.checkpoint_every": COUNT,
    "memory.cpu_malloc_reuse": FLAG,
    "memory.cuda_alloc_conf": text("PyTorch's allocator settings: launcher.rules.memory judges each"),
    "memory.empty_cache_steps": at_least(1, "null: never"),
    "memory.max_memory_gb": above(0),
    "memory.max_micro_batch_size": COUNT,
    "memory.offload_activations": FLAG,
    "memory.selective_matmuls": one_of(memory.SELECTIVE_MATMULS),
    "model.attention": one_of(model.ATTENTION),
    "model.bias": FLAG,
    "model.d_ff": COUNT,
    "model.d_model": COUNT,
    "model.dropout": SHARE,
    "model.hf_config": text("a preset name or a directory: launcher.rules.hf_model judges it"),
    "model.kind": one_of(tuple(model.FAMILIES)),
    "model.max_seq_len": COUNT,
    "model.moe.aux_loss_coef": at_least(0),
    "model.moe.bias_update_rate": at_least(0),
    "model.moe.capacity_factor": above(0, "null: dropless"),
    "model.moe.d_ff": COUNT,
    "model.moe.every": COUNT,
    "model.moe.num_experts": at_least(0, "0: a dense model"),
    "model.moe.router": one_of(ROUTERS),
    "model.moe.shared_experts": at_least(0),
    "model.moe.top_k": COUNT,
    "model.moe.z_loss_coef": at_least(0),
    "model.n_head": COUNT,
    "model.n_layer": COUNT,
    "model.path": PATH,
    "model.resize_embeddings": FLAG,
    "model.tie_embeddings": FLAG,
    "model.vocab_size": COUNT,
    "name": text("a run's name: launcher.rules.launch judges it as a directory name"),
    "objective.beta": at_least(0),
    "objective.desirable_weight": above(0),
    "objective.gamma": at_least(0),
    "objective.label_smoothing": within(0, 0.5, high_open=True),
    "objective.loss": one_of(objective.DPO_LOSSES),
    "objective.name": one_of(objective.NAMES),
    "objective.reference": one_of(objective.REFERENCES),
    "objective.undesirable_weight": above(0),
    "objective.drop_equal_groups": FLAG,
    "objective.epsilon": above(0),
    "objective.epsilon_high": above(0, "null: objective.epsilon"),
    "objective.log_rollouts": STEP,
    "objective.loss_type": one_of(objective.LOSS_TYPES),
    "objective.mask_truncated_completions": FLAG,
    "objective.max_completion_length": COUNT,
    "objective.normalize_advantages": FLAG,
    "objective.num_generations": at_least(2),
    "objective.num_iterations": COUNT,
    "objective.overlong_buffer": STEP,
    "objective.overlong_penalty": at_least(0),
    "objective.scale_rewards": one_of(objective.SCALE_REWARDS),
    "objective.temperature": above(0),
    "objective.top_k": STEP,
    "objective.top_p": within(0, 1, low_open=True),
    "optimizer.beta2_decay": within(-1, 0),
    "optimizer.betas": within(0, 1, high_open=True, size=2),
    "optimizer.clip_threshold": at_least(1),
    "optimizer.decay_norms_and_biases": FLAG,
    "optimizer.eps": above(0),
    "optimizer.eps2": at_least(0),
    "optimizer.implementation": one_of(IMPLEMENTATIONS),
    "optimizer.lr": above(0),
    "optimizer.momentum": SHARE,
    "optimizer.name": one_of(sorted(OPTIMIZERS)),
    "optimizer.nesterov": FLAG,
    "optimizer.weight_decay": at_least(0),
    # read by muon
    "optimizer.adamw_lr": above(0, "null: optimizer.lr"),
    "optimizer.adjust_lr_fn": one_of(ADJUST_LR_FNS),
    "optimizer.muon_exclude": text("fnmatch patterns of parameter names (`*emb*`), any text"),
    "optimizer.ns_steps": within(1, 99),
    "parallel.bucket_mb": above(0),
    "parallel.comm_hook": one_of(COMM_HOOKS),
    "parallel.cp_size": COUNT,
    "parallel.ep_size": COUNT,
    "parallel.cpu_offload": FLAG,
    "parallel.deepspeed_config": PATH,
    "parallel.find_unused_parameters": FLAG,
    "parallel.gradient_as_bucket_view": FLAG,
    "parallel.offload_optimizer": FLAG,
    "parallel.offload_params": FLAG,
    "parallel.powersgd_rank": COUNT,
    "parallel.powersgd_start_iter": at_least(2),
    "parallel.pp_microbatches": COUNT,
    "parallel.pp_schedule": one_of(PP_SCHEDULES),
    "parallel.pp_size": COUNT,
    "parallel.pp_split": at_least(1),
    "parallel.pp_stages_per_rank": COUNT,
    "parallel.prefetch_layers": at_least(0),
    "parallel.replicate_degree": COUNT,
    "parallel.reshard_after_forward": FLAG,
    "parallel.sequence_parallel": FLAG,
    "parallel.static_graph": FLAG,
    "parallel.strategy": one_of(sorted(STRATEGIES)),
    "parallel.tp_size": COUNT,
    "parallel.zero_stage": within(0, 3),
    "precision.bf16": FLAG,
    "precision.eval_cast": FLAG,
    "precision.eval_dtype": one_of(precision.DTYPES),
    "precision.fp16": FLAG,
    "precision.fp8": FLAG,
    "precision.fp8_recipe": one_of(precision.FP8_RECIPES),
    "precision.loss_scale_growth_interval": COUNT,
    "precision.loss_scale_init": above(0),
    "precision.param_dtype": one_of(precision.PARAM_DTYPES),
    "precision.tf32": FLAG,
    "profile": FLAG,
    "profiler.active": COUNT,
    "profiler.profile_memory": FLAG,
    "profiler.record_shapes": FLAG,
    "profiler.repeat": at_least(0),
    "profiler.top_ops": COUNT,
    "profiler.wait": at_least(0),
    "profiler.warmup": at_least(0),
    "profiler.with_stack": FLAG,
    "prune.end_step": STEP,
    "prune.every": COUNT,
    "prune.method": one_of(prune.METHODS),
    "prune.scope": one_of(prune.SCOPES),
    "prune.start_step": STEP,
    "prune.target_sparsity": SHARE,
    "qat.group_size": COUNT,
    "qat.scheme": one_of(qat.SCHEMES),
    "qat.start_step": STEP,
    "quantization.double_quant": FLAG,
    "quantization.int8_threshold": at_least(0),
    "quantization.lora.alpha": above(0),
    "quantization.lora.dora": FLAG,
    "quantization.lora.dropout": SHARE,
    "quantization.lora.rank": at_least(0),
    "quantization.lora.rslora": FLAG,
    "quantization.lora.targets": text(
        "module-name suffixes; launcher.rules.quantization says when none matches"
    ),
    "quantization.method": one_of(quantization.METHODS),
    "quantization.nf4_backend": one_of(quantization.NF4_BACKENDS),
    "reward.allow_changed_files": FLAG,
    "reward.answer.extract": text(
        "last_number, boxed, tag:NAME or none, joined by |: launcher.rules.reward judges it"
    ),
    "reward.answer.field": text("a record field's name"),
    "reward.answer.match": one_of(reward.MATCHES),
    "reward.answer.weight": at_least(0, "null: off"),
    "reward.digests": text(
        "sha256 digests the launcher writes and checks against the files (launcher.front.reward_files)"
    ),
    "reward.format.pattern": text("a Python regex: launcher.rules.reward compiles it"),
    "reward.format.weight": at_least(0, "null: off"),
    "reward.function_weights": at_least(0),
    "reward.functions": text("path/to/file.py:function entries: launcher.rules.reward loads each"),
    "reward.length.max_tokens": COUNT,
    "reward.length.soft_tokens": STEP,
    "reward.length.weight": at_least(0, "null: off"),
    "resume": text("auto or a checkpoint path: launcher.rules.resume judges it"),
    "run_dir": text("a directory: launcher.rules.launch checks that it can be created and written"),
    "scheduler.decay_ratio": within(0, 1, low_open=True),
    "scheduler.decay_shape": one_of(DECAY_SHAPES),
    "scheduler.min_lr_ratio": within(0, 1),
    "scheduler.name": one_of(SCHEDULES),
    "scheduler.warmup_ratio": within(0, 1, high_open=True),
    "scheduler.warmup_steps": STEP,
    "simulate_hardware": one_of(HARDWARE),
    "sweep.metric": one_of(METRICS),
    "tokenizer.add_bos": FLAG,
    "tokenizer.add_eos": FLAG,
    "tokenizer.kind": one_of(TOKENIZER_KINDS),
    "tokenizer.path": PATH,
    "train.advice": FLAG,
    "train.eval_at_end": FLAG,
    "train.eval_batches": COUNT,
    "train.early_stop.metric": text("a metric an evaluation writes: launcher.rules.best lists this run's"),
    "train.early_stop.min_delta": at_least(0),
    "train.early_stop.mode": one_of(BEST_MODES),
    "train.early_stop.patience": COUNT,
    "train.eval_every": COUNT,
    "train.grad_accum_steps": COUNT,
    "train.log_every": COUNT,
    "train.loss_chunks": text("auto or a number of chunks: launcher.rules.memory judges it"),
    "train.max_grad_norm": above(0),
    "train.max_nonfinite_fraction": within(0, 1, low_open=True),
    "train.max_nonfinite_skips": at_least(0),
    "train.max_steps": COUNT,
    "train.micro_batch_size": COUNT,
    "train.nonfinite_window_steps": COUNT,
    "train.on_nonfinite": one_of(NONFINITE_POLICIES),
    "train.seed": SEED,
    "train.stop_after": at_least(1, "null: train to train.max_steps"),
    "verify_resume": FLAG,
}
"""Public key -> its domain; a list-of-entries key's fields as `key[].field`. tests/unit/test_key_domains.py
holds it to the public key list."""

WORLD_MAX = 131072
"""The most ranks a job may have (nodes x ranks per node): the order of the largest training clusters."""


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """(public key, key as errors name it, value) for every leaf of the spec; list entries as `key[]`."""
    if dataclasses.is_dataclass(node):
        for item in dataclasses.fields(node):
            yield from _leaves(getattr(node, item.name), f"{prefix}{item.name}.")
    elif isinstance(node, tuple) and node and dataclasses.is_dataclass(node[0]):
        for i, entry in enumerate(node):
            for public, named, value in _leaves(entry):
                yield f"{prefix[:-1]}[].{public}", f"{prefix[:-1]}[{i}].{named}", value
    else:
        yield prefix[:-1], prefix[:-1], node


def _number(key: str, domain: Domain, value: Any) -> Iterator[SpecError]:
    many = isinstance(value, list | tuple)
    if many and domain.size is not None and len(value) != domain.size:
        yield SpecError((key,), f"takes {domain.size} numbers, got {len(value)}: {list(value)}.")
        return
    for item in value if many else [value]:
        if isinstance(item, bool) or not isinstance(item, int | float):
            yield SpecError((key,), f"takes a number, got {item!r}.")
        elif not domain.holds(item):
            fix = f" ({domain.why})" if domain.why else ""
            yield SpecError((key,), f"must be {domain.describe()}{fix}, got {item}.")


def domain_errors(spec: RunSpec) -> Iterator[SpecError]:
    """A value outside its key's domain, for every key of the spec (null passes: the schema says where it may)."""
    for public, named, value in _leaves(spec):
        domain = KEYS.get(public)
        if domain is None or value is None:
            continue
        if domain.kind == "choice":
            yield from choice(named, str(value), domain.choices, "value")
        elif domain.kind == "number":
            yield from _number(named, domain, value)
        elif domain.kind == "flag" and not isinstance(value, bool):
            yield SpecError((named,), f"takes true or false, got {value!r}.")


def _domains(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    yield from domain_errors(spec)


def _world(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    lc = spec.launcher
    if lc.nproc > 0 and lc.nnodes > 0 and lc.world_size > WORLD_MAX:
        yield SpecError(
            ("launcher.nproc", "launcher.nnodes"),
            f"a job of {lc.world_size:,} ranks (launcher.nnodes={lc.nnodes} x launcher.nproc={lc.nproc}) is "
            f"larger than any this launcher plans (at most {WORLD_MAX:,}). Give the nodes and the ranks per "
            "node the job really has.",
        )


RULES: tuple[Rule, ...] = (_domains, _world)
"""This module's rules, in the order they report."""
