"""No file we read runs code: a payload planted in each kind of file, read by each entry point.

A payload is a pickle that writes a marker file when plain pickle loads it (tests/payloads.py);
the checkpoint's COMPLETE manifest is updated with it, as whoever changed the file could. For each
entry point (resume=auto, distill.teacher, train-export, -generate, -quantize, -merge) the marker
must not appear and the command must fail naming the file. One 2-rank FSDP2 run and one
one-process run (2 steps each) are built per module and copied per case.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from payloads import Payload, poisoned_metadata, poisoned_torch_file, replant

from conftest import TINY, run_cli, run_inline, run_ranks, write_spec
from launcher.components.data.hf_tokenizer import open_folder
from launcher.components.files.safe_load import RefusedFile
from launcher.components.model.hf import build_hf_model
from launcher.config.model import ModelConfig
from launcher.rank import worker
from launcher.rank.objective import load_teacher
from launcher.spec import InvalidSpec
from launcher.tools import export, generate, merge, quantize

RUN = [*TINY, "train.max_steps=2", "checkpoint.every=1", "scheduler.warmup_steps=1", "train.eval_every=null"]
FSDP = [*RUN, "parallel=fsdp"]


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> Path:
    """2 ranks of FSDP2, checkpoints at steps 1 and 2 (DCP shards and their .metadata)."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    proc = run_ranks([*FSDP, "launcher=local", "launcher.nproc=2"], run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def files_run(tmp_path_factory) -> Path:
    """One process, checkpoints at steps 1 and 2 (model.pt, optimizer.pt, trainer.pt, rng_rank0.pt)."""
    run_dir = tmp_path_factory.mktemp("files") / "run"
    assert run_inline(RUN, run_dir) == 0
    return run_dir


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run_dir, tmp_path / "run"))


def _poison_metadata(run_dir: Path, marker: Path) -> str:
    """Replace step_2's dcp/.metadata with a payload-carrying one; the name the errors must say."""
    step = run_dir / "checkpoints" / "step_2"
    replant(step, "dcp/.metadata", poisoned_metadata(step / "dcp", marker))
    return "step_2/dcp/.metadata was refused: it names posix.system"


@pytest.fixture
def poisoned_fsdp(fsdp_run, tmp_path) -> tuple[Path, Path, str]:
    """(a copy of the FSDP2 run with a payload in step_2's metadata, the marker, what the error names)."""
    run_dir, marker = _copy(fsdp_run, tmp_path), tmp_path / "ran"
    return run_dir, marker, _poison_metadata(run_dir, marker)


def test_resume_auto_refuses_a_metadata_payload_before_launch(poisoned_fsdp, tmp_path) -> None:
    run_dir, marker, named = poisoned_fsdp
    result = run_cli(
        [*FSDP, f"run_dir={run_dir}", "resume=auto", "launcher=local", "launcher.nproc=2"], tmp_path
    )
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert named in result.stdout + result.stderr and "Traceback" not in result.stderr
    assert not marker.exists()


def _resume_in_rank(run_dir: Path, overrides: list[str], plant, capfd) -> tuple[int, str]:
    """Resume with the rules passed (spec written first), then plant, then run the rank: (status, output)."""
    spec = write_spec([*overrides, "resume=auto"], run_dir)
    plant()
    code = worker.run(spec)
    out = capfd.readouterr()
    return code, out.out + out.err


def test_a_rank_stops_at_a_metadata_payload_and_does_not_fall_back(fsdp_run, tmp_path, capfd) -> None:
    """A file changed after the rules read it (or a rank under an outer torchrun): the rank refuses it too."""
    run_dir, marker = _copy(fsdp_run, tmp_path), tmp_path / "ran"
    code, out = _resume_in_rank(run_dir, FSDP, lambda: _poison_metadata(run_dir, marker), capfd)
    assert code == 1 and "step_2/dcp/.metadata was refused: it names posix.system" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "resume_failed" and "resumed from" not in out  # not step_1 either
    assert not marker.exists()


@pytest.mark.parametrize("name", ["model.pt", "optimizer.pt", "trainer.pt", "rng_rank0.pt"])
def test_a_payload_in_a_torch_file_stops_the_resume_naming_it(files_run, tmp_path, capfd, name: str) -> None:
    run_dir, marker = _copy(files_run, tmp_path), tmp_path / "ran"
    step = run_dir / "checkpoints" / "step_2"
    code, out = _resume_in_rank(
        run_dir, RUN, lambda: replant(step, name, poisoned_torch_file(step / name, marker)), capfd
    )
    assert code == 1 and f"step_2/{name} was refused: it names exec" in out, out[-3000:]
    assert "resumed from" not in out and not marker.exists()


def test_a_raw_pickle_in_model_pt_stops_the_resume_and_stays_as_evidence(files_run, tmp_path, capfd) -> None:
    """A protocol-4 pickle (not a torch zip), sealed again: torch's reader stops at its first opcode, the opcodes
    still name the payload's global; the run stops on it instead of falling back to step_1 and writing over it."""
    run_dir, marker = _copy(files_run, tmp_path), tmp_path / "ran"
    step = run_dir / "checkpoints" / "step_2"
    planted = pickle.dumps({"w": [1.0], "x": Payload(marker)}, protocol=4)
    code, out = _resume_in_rank(run_dir, RUN, lambda: replant(step, "model.pt", planted), capfd)
    assert code == 1 and "step_2/model.pt was refused: it names posix.system" in out, out[-3000:]
    assert "resumed from" not in out and not marker.exists()
    assert (step / "model.pt").read_bytes() == planted  # left in place, as found
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_1", "step_2"]


@pytest.mark.parametrize("sealed", [False, True], ids=["other-size", "same-size"])
def test_a_payload_whose_digest_was_not_updated_stops_the_resume_too(
    files_run, tmp_path, capfd, sealed
) -> None:
    """Its files differ from the manifest, which alone reads as damage; a file that names code is evidence."""
    run_dir, marker = _copy(files_run, tmp_path), tmp_path / "ran"
    step = run_dir / "checkpoints" / "step_2"
    planted = poisoned_torch_file(step / "trainer.pt", marker)

    def plant() -> None:
        if sealed:  # the size recorded, the digest not: only the re-read tells
            replant(step, "trainer.pt", planted)
            manifest = json.loads((step / "COMPLETE").read_text())
            manifest["files"]["trainer.pt"]["sha256"] = "0" * 64
            (step / "COMPLETE").write_text(json.dumps(manifest))
        else:
            (step / "trainer.pt").write_bytes(planted)

    code, out = _resume_in_rank(run_dir, RUN, plant, capfd)
    assert code == 1 and re.search(r"step_2/trainer\.pt was refused: it names (__builtin__\.)?exec", out), (
        out[-3000:]
    )
    assert "resumed from" not in out and not marker.exists()
    assert (step / "trainer.pt").read_bytes() == planted and not (
        run_dir / "checkpoints" / "damaged"
    ).exists()


def test_a_run_dirs_spec_yaml_with_a_python_tag_is_refused_before_launch_and_kept(
    files_run, tmp_path
) -> None:
    run_dir, marker = _copy(files_run, tmp_path), tmp_path / "ran"
    spec = run_dir / "spec.yaml"
    spec.write_text(spec.read_text() + f"extra: !!python/object/apply:os.system ['touch {marker}']\n")
    planted = spec.read_bytes()
    result = run_cli([*RUN, f"run_dir={run_dir}", "resume=auto"], tmp_path)
    err = " ".join(result.stderr.split())
    assert result.returncode == 2, (result.stdout + result.stderr)[-3000:]
    assert f"run_dir: {spec} was refused: it holds the YAML tag !!python/object/apply:os.system" in err, err
    assert "no run writes over it" in err and "Traceback" not in err
    assert spec.read_bytes() == planted and not marker.exists()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_1", "step_2"]


def test_a_teacher_run_with_a_payload_is_refused_before_launch_and_in_the_rank(
    poisoned_fsdp, tmp_path
) -> None:
    teacher, marker, named = poisoned_fsdp
    with pytest.raises(InvalidSpec, match=r"distill\.teacher: .*" + named.replace(".", r"\.")):
        write_spec([*FSDP, "distill=kd", f"distill.teacher={teacher}"], tmp_path / "student")
    with pytest.raises(RefusedFile, match=named.replace(".", r"\.")):
        load_teacher(str(teacher))
    assert not marker.exists()


def test_a_teacher_spec_with_a_python_tag_is_refused(fsdp_run, tmp_path) -> None:
    teacher, marker = _copy(fsdp_run, tmp_path), tmp_path / "ran"
    spec = teacher / "spec.yaml"
    spec.write_text(spec.read_text() + f"extra: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(InvalidSpec, match=r"distill\.teacher: .*spec\.yaml was refused"):
        write_spec([*FSDP, "distill=kd", f"distill.teacher={teacher}"], tmp_path / "student")
    assert not marker.exists()


TOOLS = {
    "train-export": lambda run, out: export.main([str(run), str(out / "w.pt")]),
    "train-generate": lambda run, out: generate.main([str(run), "--prompt", "hi", "--max-new-tokens", "2"]),
    "train-quantize": lambda run, out: quantize.main(
        [str(run), str(out / "q"), "--scheme", "int8_weight_only"]
    ),
    "train-merge": lambda run, out: merge.main([str(run), str(out / "m.pt")]),
}


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_tool_refuses_a_metadata_payload_naming_the_file(poisoned_fsdp, tmp_path, capfd, tool) -> None:
    run_dir, marker, named = poisoned_fsdp
    code = TOOLS[tool](run_dir, tmp_path)
    out = capfd.readouterr()
    if tool == "train-merge":  # a plain run has nothing to merge: refused before any of its files is read
        named = "has nothing to merge"
    assert code == 2 and named in out.err, out.out[-2000:] + out.err[-2000:]
    assert not marker.exists()


@pytest.mark.parametrize("tool", ["train-export", "train-generate"])
def test_tools_refuse_a_spec_yaml_with_a_python_tag(files_run, tmp_path, capfd, tool) -> None:
    run_dir, marker = _copy(files_run, tmp_path), tmp_path / "ran"
    spec = run_dir / "spec.yaml"
    spec.write_text(spec.read_text() + f"extra: !!python/object/apply:os.system ['touch {marker}']\n")
    code = TOOLS[tool](run_dir, tmp_path)
    out = capfd.readouterr()
    assert code == 2 and "spec.yaml was refused" in out.err, out.err[-2000:]
    assert not marker.exists()


def test_a_payload_in_a_files_checkpoint_is_refused_by_the_tools(files_run, tmp_path, capfd) -> None:
    run_dir, marker = _copy(files_run, tmp_path), tmp_path / "ran"
    step = run_dir / "checkpoints" / "step_2"
    replant(step, "model.pt", poisoned_torch_file(step / "model.pt", marker))
    assert export.main([str(run_dir), str(tmp_path / "w.pt")]) == 2
    assert "step_2/model.pt was refused: it names exec" in capfd.readouterr().err
    assert not marker.exists()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A tiny GPT-2 folder as save_pretrained writes it (config.json, model.safetensors)."""
    from hf_assets import make_hf_model

    return make_hf_model("gpt2", tmp_path_factory.mktemp("hf") / "gpt2")


def _custom_code(folder: Path, marker: Path) -> str:
    config = json.loads((folder / "config.json").read_text())
    config.update(
        model_type="custom", auto_map={"AutoConfig": "custom.C", "AutoModelForCausalLM": "custom.M"}
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return "config.json was refused: it names code of its own"


def _pickled_bin(folder: Path, marker: Path) -> str:
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({**state, "extra": Payload(marker, "exec")}, folder / "pytorch_model.bin")
    return "pytorch_model.bin was refused: it names exec"


def _bad_header(folder: Path, marker: Path) -> str:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:8] + b"{not json" + data[17:])
    return "model.safetensors was refused: it is not a valid file of its kind"


def _lying_offsets(folder: Path, marker: Path) -> str:
    data = (folder / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header[next(k for k in header if k != "__metadata__")]["data_offsets"] = [0, 10**12]
    raw = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + size :])
    return "model.safetensors was refused: it is not a valid file of its kind"


FOLDER_CASES = {
    "auto_map": _custom_code,
    "pickled_bin": _pickled_bin,
    "header": _bad_header,
    "offsets": _lying_offsets,
}


@pytest.mark.parametrize("case", sorted(FOLDER_CASES))
def test_a_model_folder_that_names_code_or_lies_is_refused(hf_folder, tmp_path, capfd, case) -> None:
    folder, marker = Path(shutil.copytree(hf_folder, tmp_path / "model")), tmp_path / "ran"
    named = FOLDER_CASES[case](folder, marker)
    code = generate.main([str(folder), "--prompt", "hi", "--max-new-tokens", "1"])
    err = " ".join(capfd.readouterr().err.split())
    file = named.split(" was refused")[0]  # train-generate judges the folder as `train` does, in its words
    assert code == 2 and file in err and "Traceback" not in err, err[-2000:]
    with pytest.raises(RefusedFile, match=named):  # a rank building model.kind=hf, or a teacher folder
        build_hf_model(ModelConfig(kind="hf", path=str(folder)), announce=False)
    assert not marker.exists()


def test_a_model_folder_with_custom_code_is_refused_before_launch(hf_folder, tmp_path) -> None:
    folder, marker = Path(shutil.copytree(hf_folder, tmp_path / "model")), tmp_path / "ran"
    named = _custom_code(folder, marker)
    with pytest.raises(InvalidSpec, match=f"model.path: .*{named}"):
        write_spec([*RUN, "model=hf", f"model.path={folder}"], tmp_path / "run")
    assert not marker.exists()


def test_a_tokenizer_folder_with_custom_code_is_refused(hf_tokenizer, tmp_path) -> None:
    folder, marker = Path(shutil.copytree(hf_tokenizer, tmp_path / "tok")), tmp_path / "ran"
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings.update(
        tokenizer_class="CustomTokenizer", auto_map={"AutoTokenizer": ["custom.CustomTokenizer", None]}
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    (folder / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    named = r"tokenizer_config\.json was refused: it names code of its own"
    with pytest.raises(InvalidSpec, match=named):
        write_spec([*RUN, "tokenizer=hf", f"tokenizer.path={folder}"], tmp_path / "run")
    with pytest.raises(RefusedFile, match=named):  # a rank or a tool opening it
        open_folder(str(folder))
    assert not marker.exists()


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory) -> Path:
    """One process under DeepSpeed ZeRO-2: module states and optimizer shards in DeepSpeed's own files.

    A process of its own (`train`): DeepSpeed keeps its process group, so an engine started in this
    pytest process would stop any later in-process DeepSpeed run of the suite from starting."""
    run_dir = tmp_path_factory.mktemp("zero2") / "run"
    result = run_cli([*RUN, "parallel=zero2", f"run_dir={run_dir}"], run_dir.parent, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return run_dir


DEEPSPEED_FILES = [
    "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    # the same safe loader reads every torch file of DeepSpeed's layout: the optimizer file holds the property
    pytest.param("deepspeed/mp_rank_00_model_states.pt", marks=pytest.mark.extended),
]


@pytest.mark.slow  # DeepSpeed's start costs 10-60 s on 2 cores
@pytest.mark.parametrize("name", DEEPSPEED_FILES)
def test_a_payload_in_deepspeeds_files_is_refused_by_export_and_resume(
    zero2_run, tmp_path, capfd, name
) -> None:
    run_dir, marker = _copy(zero2_run, tmp_path), tmp_path / "ran"
    step = run_dir / "checkpoints" / "step_2"
    replant(step, name, poisoned_torch_file(step / name, marker))
    assert export.main([str(run_dir), str(tmp_path / "w.pt")]) == 2
    assert f"step_2/{name} was refused: it names exec" in capfd.readouterr().err
    # a second DeepSpeed engine in this process would not start: the resume runs as `train` does
    result = run_cli([*RUN, "parallel=zero2", f"run_dir={run_dir}", "resume=auto"], tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 1 and f"step_2/{name} was refused: it names exec" in out, out[-3000:]
    assert "resumed from" not in out and not marker.exists()
