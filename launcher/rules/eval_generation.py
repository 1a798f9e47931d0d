"""Rules of the `generation` evaluator (`eval.generation.*`): the prompts file read and judged line by line,
the extraction and match named, sampling that can make pass@k, and the layouts its generator decodes on."""

from __future__ import annotations

from collections.abc import Iterator

from launcher.components.generation_checks import PromptsFileError, read_checks
from launcher.components.rewards.verifiers import extraction_problem, math_verify_installed
from launcher.parallel.registry import STRATEGIES
from launcher.rules.hardware import Hardware
from launcher.rules.values import Rule
from launcher.spec import RunSpec, SpecError

KEY = "eval.generation"


def _prompts(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    g = spec.eval.generation
    if g.prompts is None:
        return
    try:
        read_checks(g)
    except PromptsFileError as err:
        yield SpecError((f"{KEY}.prompts",), str(err))
    if (problem := extraction_problem(g.extract)) is not None:
        yield SpecError((f"{KEY}.extract",), f"{problem}.")
    if g.match == "math_verify" and not math_verify_installed():
        yield SpecError(
            (f"{KEY}.match",),
            "math_verify compares answers with the math-verify package, which is not installed. Install it "
            "(pip install math-verify), or use eval.generation.match=numeric.",
        )


def _sampling(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    g = spec.eval.generation
    if g.prompts is None:
        return
    if g.samples > 1 and g.temperature == 0:
        yield SpecError(
            (f"{KEY}.samples", f"{KEY}.temperature"),
            f"{g.samples} samples per prompt at temperature 0 are {g.samples} copies of the greedy completion, so "
            "pass@k would say nothing more than accuracy. Sample (eval.generation.temperature=0.8), or samples=1.",
        )
    for k in g.pass_at:
        if not 1 <= k <= g.samples:
            yield SpecError(
                (f"{KEY}.pass_at", f"{KEY}.samples"),
                f"pass@{k} needs k from 1 to the samples per prompt ({g.samples}): the estimator draws k of the "
                f"n=samples completions. Raise eval.generation.samples to {max(k, 1)} or more, or drop {k}.",
            )


def _layout(spec: RunSpec, hw: Hardware) -> Iterator[SpecError]:
    p = spec.parallel
    if spec.eval.generation.prompts is None:
        return
    split = {"parallel.pp_size": p.pp_size > 1, "parallel.cp_size": p.cp_size > 1}
    split["parallel.sequence_parallel"] = p.sequence_parallel
    split["parallel.strategy"] = STRATEGIES[p.strategy].wrap == "engine"  # DeepSpeed's engine holds the model
    for key, on in split.items():
        if on:
            yield SpecError(
                (f"{KEY}.prompts", key),
                f"the generation checks decode whole sequences on a model part holding every layer as training "
                f"holds it, which {key}={getattr(p, key.split('.')[1])} does not offer. Run them after training "
                "(train-eval on the run), or train with another layout, or drop the generation checks.",
            )


RULES: tuple[Rule, ...] = (_prompts, _sampling, _layout)
