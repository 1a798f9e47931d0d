"""Rules of the distill group (knowledge distillation from a frozen teacher), checked before anything starts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from launcher.components import checkpoint
from launcher.components.model.hf_files import has_weights, local_vocab_size
from launcher.config.distill import LOSSES
from launcher.config.model import vocab_size
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError, SpecFileError, load_spec

STRATEGIES = ("single", "ddp", "fsdp")
"""Where a teacher is placed like the student: a frozen copy per process (single, DDP) or FSDP2 shards."""
TEACHER = ("distill.teacher",)
REFUSED = {
    "pp": "a pipeline's stages never hold the whole student's logits on one rank (the last stage holds only its "
    "micro batches' hidden states), and the teacher would need the same stages and schedule",
    "tp": "tensor parallelism splits the student's projections and its logits over the vocabulary, and the "
    "teacher's logits would need the same split for the KD term",
    "deepspeed": "DeepSpeed's engine partitions the one model it wraps; a second, frozen model beside it is not "
    "partitioned (ZeRO-3) or placed by it",
}


def _settings(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    d = spec.distill
    if d.teacher is None:
        return
    if not 0.0 <= d.kd_ratio <= 1.0:
        yield SpecError(
            ("distill.kd_ratio",),
            f"must lie in [0, 1] (loss = (1 - kd_ratio) * CE + kd_ratio * KD), got {d.kd_ratio}. 0.5 is a common start.",
        )
    if d.temperature <= 0:
        yield SpecError(
            ("distill.temperature",),
            f"must be positive (the logits are divided by it), got {d.temperature}. Use 1.0 (plain) to 4.0 (softer).",
        )
    if d.loss not in LOSSES:
        yield SpecError(("distill.loss",), f"must be one of {', '.join(LOSSES)}, got {d.loss!r}.")
    if spec.parallel.pp_size > 1 and spec.parallel.strategy in STRATEGIES:
        yield SpecError(
            ("distill.teacher", "parallel.pp_size"),
            f"distillation does not run under a pipeline (parallel.pp_size={spec.parallel.pp_size}): "
            f"{REFUSED['pp']}. Set parallel.pp_size=1 (`parallel=fsdp` shards the teacher like the student).",
        )
    elif spec.parallel.tp_size > 1 and spec.parallel.strategy in STRATEGIES:
        yield SpecError(
            ("distill.teacher", "parallel.tp_size"),
            f"distillation does not run under tensor parallelism (parallel.tp_size={spec.parallel.tp_size}): "
            f"{REFUSED['tp']}. Set parallel.tp_size=1 (`parallel=fsdp` shards the teacher like the student).",
        )
    elif spec.parallel.strategy not in STRATEGIES:
        yield SpecError(
            ("distill.teacher", "parallel.strategy"),
            f"distillation runs under {', '.join(STRATEGIES)}; parallel.strategy={spec.parallel.strategy} is refused: "
            f"{REFUSED.get(spec.parallel.strategy, 'the teacher would not be placed like the student')}. Use "
            "`parallel=fsdp` (the teacher is sharded like the student) or `parallel=ddp`.",
        )


def _teacher_vocab(path: Path, spec: RunSpec) -> tuple[int | None, list[SpecError]]:
    """(the teacher's vocabulary size, problems with the teacher folder or its tokenizer)."""
    if (path / "spec.yaml").is_file():
        if not checkpoint.good_checkpoints(path, warn=False):
            return None, [
                SpecError(
                    TEACHER,
                    f"the run directory {path} holds no complete checkpoint to read the teacher from. Train it first, or name another run.",
                )
            ]
        try:
            teacher = load_spec(path / "spec.yaml")
        except SpecFileError as err:
            return None, [SpecError(TEACHER, str(err))]
        problems = []
        if teacher.quantization.method != "none" or teacher.quantization.lora.rank > 0:
            problems.append(
                SpecError(
                    TEACHER,
                    f"the teacher run {path} trained adapters or quantized weights; merge it into a plain model first (`train-export {path} OUT --format hf --merge`) and name OUT as the teacher.",
                )
            )
        if (teacher.tokenizer.kind, teacher.tokenizer.path) != (spec.tokenizer.kind, spec.tokenizer.path):
            problems.append(
                SpecError(
                    (*TEACHER, "tokenizer.kind", "tokenizer.path"),
                    f"the teacher was trained with tokenizer {teacher.tokenizer.kind} ({teacher.tokenizer.path}), the student uses {spec.tokenizer.kind} ({spec.tokenizer.path}): the KL compares distributions token id by token id, so both must use the same tokenizer. Set the student's tokenizer to the teacher's.",
                )
            )
        return vocab_size(teacher.model), problems
    if (path / "config.json").is_file() and has_weights(str(path)):
        return local_vocab_size(str(path)), []
    return None, [
        SpecError(
            TEACHER,
            f"{path} is neither a run directory (spec.yaml and checkpoints/) nor a Hugging Face model folder (config.json and weights). Name a trained run's directory or a local model folder.",
        )
    ]


def _teacher(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    if spec.distill.teacher is None:
        return
    if not spec.distill.teacher:
        yield SpecError(
            TEACHER,
            "distill=kd needs a teacher: set distill.teacher=RUN_DIR (a trained run's directory) or a local "
            "Hugging Face model folder, or use distill=none.",
        )
        return
    path = Path(spec.distill.teacher)
    if not path.is_dir():
        yield SpecError(
            TEACHER,
            f"{path} does not exist. Name a trained run's directory or a local Hugging Face model folder.",
        )
        return
    if spec.model.kind != "gpt" and spec.model.path is None and spec.model.hf_config is None:
        return
    teacher_vocab, problems = _teacher_vocab(path, spec)
    yield from problems
    student_vocab = vocab_size(spec.model)
    if teacher_vocab is not None and teacher_vocab != student_vocab:
        yield SpecError(
            (*TEACHER, "model.vocab_size"),
            f"the teacher's vocabulary holds {teacher_vocab} ids and the student's {student_vocab}: the KL compares "
            "the two distributions id by id, so they must match. Use the teacher's tokenizer and "
            f"model.vocab_size={teacher_vocab} for the student.",
        )


def _on_policy(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    d, data = spec.distill, spec.data
    if d.teacher is None or d.mode != "on_policy":
        return
    if spec.objective.name != "sft":
        yield SpecError(
            ("distill.mode", "objective.name"),
            f"on-policy distillation trains the student on its own samples alone; objective={spec.objective.name} "
            "would need pairs it does not make. Use objective=sft with distill=on_policy, or distill=none.",
        )
    if data.packing:
        yield SpecError(
            ("distill.mode", "data.packing"),
            "on-policy distillation makes one row per prompt and its sampled completion, so there is nothing to "
            "pack: set data.packing=false.",
        )
    if data.sources:
        yield SpecError(
            ("distill.mode", "data.sources"),
            "on-policy distillation reads its prompts from one corpus (data.path), not a mixture: set data.path "
            "and leave data.sources empty.",
        )
    if data.format in ("preference", "kto"):
        yield SpecError(
            ("distill.mode", "data.format"),
            f"data.format={data.format} holds pairs; on-policy distillation reads prompts from text, instruction, "
            "chat or sharegpt records. Point data.path at such records.",
        )
    if spec.parallel.cp_size > 1:
        yield SpecError(
            ("distill.mode", "parallel.cp_size"),
            f"on-policy distillation samples whole sequences on each rank; context parallelism "
            f"(parallel.cp_size={spec.parallel.cp_size}) splits them and does not decode. Set parallel.cp_size=1.",
        )
    room = data.seq_len - d.max_new_tokens
    if d.prompt_tokens > room:
        yield SpecError(
            ("distill.prompt_tokens", "distill.max_new_tokens", "data.seq_len"),
            f"a prompt of distill.prompt_tokens={d.prompt_tokens} tokens and distill.max_new_tokens="
            f"{d.max_new_tokens} new ones do not fit data.seq_len={data.seq_len}: the prompt may hold at most "
            f"{max(room, 0)}. Lower distill.prompt_tokens or distill.max_new_tokens, or raise data.seq_len.",
        )


RULES: tuple[Rule, ...] = (_settings, _teacher, _on_policy)
"""This module's rules, in the order they report."""
