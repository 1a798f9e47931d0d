"""Every section of a user's DeepSpeed JSON is honoured, decided by the spec, or refused before launch naming
the key: over the files people have (axolotl's, transformers' templates), DeepSpeed's own config check,
and a train_batch_size whose micro batch DeepSpeed derives (the training chapters' ZeRO-2 fp16 file)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, run_cli
from launcher import rules
from launcher.front import cli, command_line, compose
from launcher.front.cli import precheck
from launcher.parallel import deepspeed_sections
from launcher.parallel import deepspeed_user_config as ds_user
from launcher.rules.hardware import Hardware

ASSETS = Path(__file__).parents[1] / "assets" / "deepspeed"
CHAPTER = ASSETS / "zero2_fp16_train_batch.json"
GPU = Hardware(device_type="cuda", bf16=True, tf32=True, num_gpus=2, gpu_memory_bytes=80 << 30)

COMPILE = ("deepspeed_config:compile",)
FILES = [
    ("transformers_zero2.json", []),
    ("transformers_zero3.json", []),
    ("axolotl_zero1.json", []),
    ("axolotl_zero2.json", []),
    ("axolotl_zero3_bf16.json", []),  # prefetch_bucket_size / param_persistence_threshold "auto": filled
    ("legacy_cpu_offload.json", []),
    ("axolotl_zero1_torch_compile.json", [COMPILE]),
    ("axolotl_zero2_torch_compile.json", [COMPILE]),
]


@pytest.mark.parametrize(("name", "keys"), FILES, ids=[f[0] for f in FILES])
def test_files_people_have_are_accepted_or_refused_naming_the_key(name: str, keys: list) -> None:
    errors = precheck([f"parallel.deepspeed_config={ASSETS / name}", *TINY])
    assert [e.keys for e in errors] == keys, errors
    if keys == [COMPILE]:
        assert "`compile=default`" in errors[0].message and "torch.compile" in errors[0].message


def test_a_torch_compile_file_exits_2_before_anything_starts(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    argv = [
        f"parallel.deepspeed_config={ASSETS / 'axolotl_zero1_torch_compile.json'}",
        *TINY,
        f"run_dir={run_dir}",
    ]
    assert cli.run(command_line.normalize(argv)) == 2 and not run_dir.exists()
    assert "deepspeed_config:compile" in capsys.readouterr().err


def test_deepspeeds_own_models_name_a_bad_value_and_a_misspelt_key(tmp_path) -> None:
    path = tmp_path / "ds.json"
    zero = {
        "stage": 2,
        "reduce_bucket_size": "big",
        "offload_optimizer": {"device": "none", "pin_memroy": True},
    }
    path.write_text(json.dumps({"zero_optimization": zero}))
    errors = precheck([f"parallel.deepspeed_config={path}", *TINY])
    assert sorted(e.keys for e in errors) == [
        ("deepspeed_config:zero_optimization.offload_optimizer.pin_memroy",),
        ("deepspeed_config:zero_optimization.reduce_bucket_size",),
    ]
    assert all("DeepSpeed refuses" in e.message for e in errors)
    path.write_text(json.dumps({"zero_optimisation": {"stage": 2}, "wall_clock_breakdown": False}))
    errors = precheck([f"parallel.deepspeed_config={path}", "parallel=zero2", *TINY])
    assert [e.keys for e in errors] == [("deepspeed_config:zero_optimisation",)]
    assert "Did you mean `zero_optimization`?" in errors[0].message


def test_every_key_deepspeed_reads_has_a_verdict() -> None:
    """The top-level keys DeepSpeed's config reads by name (recorded in a child: deepspeed fixes its accelerator)."""
    script = (
        "import json\nfrom deepspeed.runtime.config import DeepSpeedConfig\nseen = set()\n"
        "class D(dict):\n"
        "    def __contains__(self, k): seen.add(k); return dict.__contains__(self, k)\n"
        "    def get(self, k, *d): seen.add(k); return dict.get(self, k, *d)\n"
        "    def __getitem__(self, k): seen.add(k); return dict.__getitem__(self, k)\n"
        "    def __copy__(self): return D(self)\n"
        "DeepSpeedConfig(D({'train_micro_batch_size_per_gpu': 1}))\nprint(json.dumps(sorted(seen)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    read = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert read - set(deepspeed_sections.KNOWN) == set()
    assert {deepspeed_sections.verdict(k) for k in ("compile", "zero_optimization", "fp16", "zero_optimisation")} == {
        "refused", "honoured", "decided", "unknown"
    }  # fmt: skip


def test_the_chapters_zero2_file_derives_the_micro_batch_deepspeed_would(monkeypatch) -> None:
    """train_batch_size 16 with 4 accumulation steps and no micro batch: DeepSpeed's micro batch is 16 / 4 / 1 = 4."""
    monkeypatch.setattr(rules, "detect_hardware", lambda spec: GPU)  # fp16: a machine with a GPU
    spec, errors = compose.validate(compose.compose([f"parallel.deepspeed_config={CHAPTER}"]))
    assert errors == [], errors
    t, p = spec.train, spec.parallel
    assert (t.micro_batch_size, t.grad_accum_steps, spec.precision.fp16, p.zero_stage) == (4, 4, True, 2)
    config, problems = ds_user.resolve(spec)
    assert problems == []
    assert (config["train_micro_batch_size_per_gpu"], config["train_batch_size"]) == (4, 16)
    # On 2 ranks DeepSpeed's micro batch is 2; a micro batch someone set leaves the split to the check.
    spec, errors = compose.validate(
        compose.compose([f"parallel.deepspeed_config={CHAPTER}", "launcher.nproc=2"])
    )
    assert errors == [], errors
    assert (spec.train.micro_batch_size, spec.train.grad_accum_steps) == (2, 4)
    keys = [e.keys[0] for e in precheck([f"parallel.deepspeed_config={CHAPTER}", "train.micro_batch_size=8"])]
    assert keys == ["deepspeed_config:train_batch_size"]


# In the extended tier: the file's split of 16 as 4 x 4 is held by the test above, a user's DeepSpeed file in a real
# run (spec.yaml, the merged config and DeepSpeed agreeing) by test_deepspeed_config.py's transformers template
# run, and DeepSpeed's fp16 refused on a CPU by test_deepspeed_config.py's rule messages.
@pytest.mark.extended
def test_the_chapters_file_on_a_cpu_refuses_only_fp16_and_trains_without_it(tmp_path) -> None:
    """One real inline DeepSpeed run (a child process, 3 steps): spec.yaml and DeepSpeed's config split 16 as 4 x 4."""
    keys = [e.keys for e in precheck([f"parallel.deepspeed_config={CHAPTER}"])]
    # DeepSpeed has no fp16 on a CPU; the batch agrees with the file.
    assert keys == [("precision.fp16", "parallel.strategy")]
    content = json.loads(CHAPTER.read_text())
    content["fp16"]["enabled"] = False
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(content))
    run_dir = tmp_path / "run"
    small = [
        a for a in TINY if not a.startswith(("train.micro_batch_size", "train.max_steps", "checkpoint.every"))
    ]
    args = [f"parallel.deepspeed_config={path}", *small, "train.max_steps=3", "checkpoint.every=null"]
    proc = run_cli([*args, "train.eval_every=null", f"run_dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((run_dir / "deepspeed_config.json").read_text())
    batch = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    assert tuple(config[k] for k in batch) == (4, 4, 16)
    assert (
        "train.micro_batch_size=4 (ds.json: train_batch_size / (accumulation steps x ranks))" in proc.stderr
    )
