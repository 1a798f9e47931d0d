"""The command line is parsed once and the spec built once: enrichment writes into a copy of the composed
config, the spec is built from it, and spec.yaml is that spec's dump (secrets redacted)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from launcher.front import compose, rundir
from launcher.front.command_line import parse
from launcher.spec import load_spec, spec_container


def test_one_pass_splits_flags_and_overrides_and_normalizes(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    line = parse(["-m", "--config-path", "conf", "+parallel=ddp", "--config-name=spec", "+unknown.key=1"])
    assert line.overrides == ("parallel=ddp", "+unknown.key=1")  # a known group loses its +
    assert line.multirun and line.source.config_name == "spec"
    assert line.source.config_path == str(tmp_path / "conf")  # Hydra would look beside its own module
    assert line.argv[:3] == ("-m", "--config-path", str(tmp_path / "conf"))
    assert [e.keys for e in parse(["--lr", "x=1"]).unknown_flags()] == [("command line",)]


def test_printing_flags_are_removed_with_their_values() -> None:
    line = parse(["--cfg", "job", "model=gpt_tiny", "--info=searchpath", "-m"])
    assert line.without_print_flags().argv == ("-m", "model=gpt_tiny")
    assert line.with_overrides(["a=1"]).argv == ("--cfg", "job", "--info=searchpath", "-m", "a=1")


def test_enrichment_leaves_the_composed_config_as_it_was() -> None:
    cfg = compose.compose(["train.max_steps=5"])
    before = OmegaConf.to_yaml(cfg)
    built = compose.build(cfg)
    assert built.errors == () and OmegaConf.to_yaml(cfg) == before
    decided = built.config
    assert (decided.launcher.backend, decided.tokenizer.kind, decided.model.vocab_size) == (
        "inline",
        "bytes",
        256,
    )
    assert decided.scheduler.warmup_steps == built.spec.scheduler.warmup_steps == 0


def test_spec_yaml_is_the_validated_spec_with_secrets_redacted(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("LAUNCHER_TEST_SECRET", "hunter2")
    built = compose.build(compose.compose(["name=${oc.env:LAUNCHER_TEST_SECRET}"]))
    spec = rundir.write(built, tmp_path)
    text = (tmp_path / "spec.yaml").read_text()
    assert "hunter2" not in text and "name: ${oc.env:LAUNCHER_TEST_SECRET}" in text
    header = OmegaConf.load(
        tmp_path / "spec.yaml"
    ).hydra  # what makes it a primary config, none of Hydra's runtime
    assert set(header) == {"run", "output_subdir", "job"}
    assert load_spec(tmp_path / "spec.yaml") == spec  # the rank reads back exactly the validated spec
    assert spec_container(spec)["launcher"]["backend"] == "inline"
