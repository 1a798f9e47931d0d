"""Every public key refuses a wrong type, a value outside its range and an unknown option, naming the key.

tests/assets/public_keys.txt drives the cases, so a key added to the schema is tried on arrival; the
table of domains (launcher.rules.keys.KEYS) says which keys take free text (paths, names) and why.
Cases run in-process through the launcher's own checks: the wrong types through the command line's
pre-compose check, all at once; the values through `compose.build` on one composed config, many at
once, and one by one for any key the batch did not name alone.
"""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path

import pytest

from launcher.config.data import SourceConfig
from launcher.front import compose
from launcher.front.cli import precheck
from launcher.front.config_values import with_values
from launcher.front.override_checks import field_type
from launcher.rules.keys import KEYS
from launcher.rules.values import Domain
from launcher.spec import SpecError, schema_fields

PUBLIC = (Path(__file__).parents[1] / "assets" / "public_keys.txt").read_text().split()
ENTRY = "data.sources[]."


def _schema_type(key: str) -> typing.Any:
    """The schema type of a public key (an entry field of data.sources included), None stripped."""
    kind = schema_fields(SourceConfig)[key[len(ENTRY) :]] if key.startswith(ENTRY) else field_type(key)[0]
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if typing.get_origin(kind) in (typing.Union, types.UnionType) else kind


def _wrong_type(key: str) -> str:
    """A value of another type than the key's, as the command line writes it."""
    kind = _schema_type(key)
    if kind is bool:
        return "2"  # the schema would read it as true
    if kind in (int, float):
        return "abc"
    if typing.get_origin(kind) in (list, tuple):
        return "abc"
    return "[1,2]"  # str and Any: a list where a word belongs


def _out_of_range(key: str, domain: Domain) -> list[typing.Any]:
    """Values just outside the key's range (below it, and above it where it has a top)."""
    is_int = _schema_type(key) is int or typing.get_args(_schema_type(key)) == (int,)
    values = [domain.low if domain.low_open else domain.low - 1]
    if domain.high is not None:
        values.append(domain.high if domain.high_open else domain.high + 1)
    values = [int(v) if is_int else float(v) for v in values]
    if not is_int:
        values.append(math.inf)
    if typing.get_origin(_schema_type(key)) is list:
        return [[v] * (domain.size or 1) for v in values]
    return values


def _cases() -> list[tuple[str, typing.Any]]:
    """(key, bad value) for every out-of-range value and unknown option of every public key."""
    cases: list[tuple[str, typing.Any]] = []
    for key in PUBLIC:
        domain = KEYS[key]
        if domain.kind == "number":
            cases += [(key, value) for value in _out_of_range(key, domain)]
        elif domain.kind == "choice":
            cases.append((key, "bogus_value"))
    return cases


def _named(key: str, errors: list[SpecError]) -> bool:
    """Whether an error names the key (an entry's field as data.sources[0].field, or the list itself)."""
    spelled = {key.replace("[]", "[0]"), key.split("[]")[0]}
    return any(spelled & set(error.keys) for error in errors)


def _alone(key: str, value: typing.Any, errors: list[SpecError]) -> bool:
    """Whether an error names the key alone and the value it refused."""
    return any(
        error.keys == (key.replace("[]", "[0]"),) and str(value).strip("[]").split(",")[0] in error.message
        for error in errors
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "c.jsonl"
    path.write_text('{"text": "hello world, a small corpus"}\n' * 50)
    return path


def _errors(base: typing.Any, key: str, value: typing.Any, corpus: Path) -> list[SpecError]:
    """Every problem of the composed config with `key` given the bad value (a mixture entry's field on the
    command line, in a one-entry mixture)."""
    if key.startswith(ENTRY):
        return precheck([f"data.sources=[{{path: '{corpus}', {key[len(ENTRY) :]}: {value}}}]"])
    return list(compose.build(with_values(base, {key: value})).errors)


def test_every_public_key_has_a_domain() -> None:
    """A key added to the schema is declared here too: its options, its range, a bool, or free text and why."""
    assert sorted(KEYS) == sorted(PUBLIC)
    for key, domain in KEYS.items():
        assert domain.kind in ("choice", "number", "flag", "text"), key
        assert domain.kind != "text" or domain.why, f"{key}: say why it takes any string"
        assert domain.kind != "flag" or _schema_type(key) is bool, f"{key} is not a bool in the schema"
        assert domain.kind != "number" or domain.low is not None, f"{key}: a number needs a lower bound"


def test_every_key_refuses_a_wrong_type() -> None:
    overrides = [f"{key}={_wrong_type(key)}" for key in PUBLIC if not key.startswith(ENTRY)]
    overrides += [
        f"data.sources=[{{{key[len(ENTRY) :]}: {_wrong_type(key)}}}]"
        for key in PUBLIC
        if key.startswith(ENTRY)
    ]
    errors = compose.check_overrides(overrides)
    missed = [o for o in overrides if not _named(o.partition("=")[0], errors)]
    for override in missed:  # the schema reads it (a list of entries, dry_run's Any): the rules judge it
        key = override.partition("=")[0]
        assert _named(key, precheck([override])), f"{override} was not refused naming {key}"


def test_every_key_refuses_values_outside_its_domain(corpus: Path) -> None:
    """Out-of-range numbers (inf included) and unknown options: exit 2 naming the key, before anything starts."""
    base = compose.compose([])
    rounds: list[
        dict[str, typing.Any]
    ] = []  # a key's first bad value in the first batch, its second in the next
    for key, value in _cases():
        if not key.startswith(ENTRY):
            batch = next((r for r in rounds if key not in r), None)
            if batch is None:
                rounds.append(batch := {})
            batch[key] = value
    found = [list(compose.build(with_values(base, batch)).errors) for batch in rounds]
    for key, value in _cases():
        if any(
            batch.get(key) == value and _alone(key, value, errors)
            for batch, errors in zip(rounds, found, strict=True)
        ):
            continue
        errors = _errors(base, key, value, corpus)  # alone: another key's value may have hidden it
        assert _named(key, errors), f"{key}={value!r} was accepted: {errors}"


@pytest.mark.parametrize(
    "override",
    [
        "model.bias=2",
        "optimizer.nesterov=yes",
        "optimizer.implementation=bogus",
        "precision.loss_scale_init=0",
    ],
)
def test_the_command_line_refuses_them_too(override: str) -> None:
    """The same refusals through `train`'s own pre-launch check (exit status 2, nothing started)."""
    key = override.partition("=")[0]
    assert _named(key, precheck([override]))


def test_a_config_file_cannot_give_a_switch_a_number_or_a_word(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text(
        'n_layer: 2\nbias: 2\ntie_embeddings: "yes"\ndropout: 0.1\n'
    )
    errors = precheck(["--config-dir", str(tmp_path), "model=mine"])
    assert [e.keys for e in errors] == [("model.bias",), ("model.tie_embeddings",)]
    assert "model=mine sets it to 2" in errors[0].message


@pytest.mark.parametrize(
    ("overrides", "key", "phrase"),
    [
        (["train.max_steps=5", "name=${python:os.getcwd}"], "name", "calls the resolver python"),
        (["scheduler.warmup_steps=${oc.decode:'1'}"], "scheduler.warmup_steps", "resolver oc.decode"),
        (["run_dir=/proc/forbidden"], "run_dir", "a kernel interface"),
        (["launcher=local", "parallel=ddp", "launcher.nproc=1000000"], "launcher.nproc", "8 per core"),
        (["parallel=ddp", "launcher.nproc=100000", "dry_run=simulate"], "launcher.nproc", "at most 4,096"),
        (
            ["train.stop_after=0"],
            "train.stop_after",
            "must be at least 1 (null: train to train.max_steps), got 0",
        ),
        (["parallel.pp_size=0"], "parallel.pp_size", "must be at least 1, got 0"),
    ],
)
def test_values_that_used_to_crash_or_pass_are_refused(overrides: list[str], key: str, phrase: str) -> None:
    errors = precheck(overrides)
    assert any(key in e.keys and phrase in e.message for e in errors), errors
    assert not any("is 1 (no pipeline)" in e.message for e in errors)


def test_allowed_interpolations_still_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAUNCHER_TEST_RUN_NAME", "from-env")
    assert precheck(["name=${oc.env:LAUNCHER_TEST_RUN_NAME}", "model.max_seq_len=${data.seq_len}"]) == []
