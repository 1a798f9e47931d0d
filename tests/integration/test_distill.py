"""Knowledge distillation through the real loop: a student distilled from a trained teacher learns faster
than the same student on cross-entropy alone, the metrics split the two terms, and resume is exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import TINY, losses, run_inline, run_ranks
from launcher.components.metrics import read_metrics

# The teacher: TINY (2 blocks of 64) trained 60 steps; the student: 1 block of 32, 20 steps.
TEACHER = [*TINY, "train.max_steps=60", "train.eval_every=60", "checkpoint.every=60", "optimizer.lr=3e-3"]
STUDENT = [*TINY, "model.n_layer=1", "model.d_model=32", "train.eval_every=20", "optimizer.lr=3e-3"]
KD = ["distill=kd", "distill.kd_ratio=0.9", "distill.temperature=1.0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The teacher, the distilled student and the student on cross-entropy alone (same seed and steps)."""
    base = tmp_path_factory.mktemp("distill")
    assert run_inline(TEACHER, base / "teacher") == 0
    assert run_inline(STUDENT, base / "ce") == 0
    assert run_inline([*STUDENT, *KD, f"distill.teacher={base / 'teacher'}"], base / "kd") == 0
    return {name: base / name for name in ("teacher", "ce", "kd")}


def _eval_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["eval_loss"]


def test_distilled_student_beats_cross_entropy_alone(runs) -> None:
    teacher, ce, kd = (_eval_loss(runs[name]) for name in ("teacher", "ce", "kd"))
    # Measured: teacher 3.58, student on CE alone 4.35, distilled 4.22 eval loss (seed 1234).
    assert teacher < kd < ce - 0.05, (teacher, kd, ce)


def test_metrics_split_cross_entropy_and_kd(runs) -> None:
    records = [r for r in read_metrics(runs["kd"] / "metrics.jsonl") if "loss" in r]
    assert len(records) == 20
    for r in records:  # loss = 0.1 * CE + 0.9 * KD, all per trained token
        assert r["loss"] == pytest.approx(0.1 * r["ce_loss"] + 0.9 * r["kd_loss"], rel=1e-5)
    assert records[-1]["kd_loss"] < records[0]["kd_loss"]
    assert all("kd_loss" not in r for r in read_metrics(runs["ce"] / "metrics.jsonl"))
    step_dir = runs["kd"] / "checkpoints" / "step_20"
    assert sorted(p.name for p in step_dir.glob("*.pt")) == sorted(
        p.name for p in (runs["ce"] / "checkpoints" / "step_20").glob("*.pt")
    )  # the teacher is read-only input: never saved with the student


def test_resume_is_bitwise_exact(runs, tmp_path) -> None:
    split = [*STUDENT, *KD, f"distill.teacher={runs['teacher']}"]
    assert run_inline([*split, "train.stop_after=10"], tmp_path / "split") == 0
    assert run_inline([*split, "resume=auto"], tmp_path / "split") == 0
    assert losses(tmp_path / "split") == losses(runs["kd"])
    terms = {
        r["step"]: (r["ce_loss"], r["kd_loss"])
        for r in read_metrics(tmp_path / "split" / "metrics.jsonl")
        if "kd_loss" in r
    }
    straight = {
        r["step"]: (r["ce_loss"], r["kd_loss"])
        for r in read_metrics(runs["kd"] / "metrics.jsonl")
        if "kd_loss" in r
    }
    assert terms == straight


# ddp in the extended tier: FSDP2 holds the parity with a sharded student next to its teacher; DDP wraps the
# student as any module (test_local_ddp.py).
@pytest.mark.parametrize("parallel", [pytest.param("ddp", marks=pytest.mark.extended), "fsdp"])
def test_two_ranks_distill_as_one_process(runs, tmp_path, parallel: str) -> None:
    """Two gloo ranks, the teacher whole on each (DDP) or sharded like the student (FSDP2): the CE and KD
    terms summed over ranks match one process."""
    ddp = tmp_path / parallel
    args = [
        *STUDENT,
        *KD,
        f"distill.teacher={runs['teacher']}",
        f"parallel={parallel}",
        "train.micro_batch_size=2",
    ]
    result = run_ranks([*args, "train.stop_after=10"], ddp)
    assert result.returncode == 0, result.stderr[-2000:]
    one = {r["step"]: r for r in read_metrics(runs["kd"] / "metrics.jsonl") if "kd_loss" in r}
    two = {r["step"]: r for r in read_metrics(ddp / "metrics.jsonl") if "kd_loss" in r}
    assert sorted(two) == list(range(1, 11))
    for step, record in two.items():  # measured 1.7e-7 apart: fp32 sums in another order
        for key in ("loss", "ce_loss", "kd_loss"):
            assert record[key] == pytest.approx(one[step][key], abs=1e-5), (step, key)


def test_plan_adds_the_teacher_and_its_logits(runs) -> None:
    from launcher.config.model import config_num_params
    from launcher.plan.planner import plan
    from launcher.spec import load_spec

    spec = load_spec(runs["kd"] / "spec.yaml")
    alone = plan(load_spec(runs["ce"] / "spec.yaml"))
    distilled = plan(spec)
    teacher_params = config_num_params(load_spec(runs["teacher"] / "spec.yaml").model)  # 131,392, float32
    logits = 4 * 32 * 256 * 4
    assert distilled.buffers - alone.buffers == teacher_params * 4 + logits + 128 * 256 * 4 * 6
    assert any("distillation teacher" in note for note in distilled.notes)


def test_micro_batch_search_counts_the_teacher(runs) -> None:
    """A search try under distillation holds the teacher's forward and the KL: its peak is clearly higher."""
    import dataclasses

    import torch

    from launcher.components.model.build import build_model
    from launcher.components.objectives.distillation import Distiller
    from launcher.components.precision import train_dtype
    from launcher.rank.micro_batch import _try_size
    from launcher.rank.objective import load_teacher
    from launcher.spec import load_spec

    spec = load_spec(runs["kd"] / "spec.yaml")
    spec = dataclasses.replace(spec, data=dataclasses.replace(spec.data, seq_len=256))
    student = build_model(dataclasses.replace(spec.model, max_seq_len=256))
    teacher = load_teacher(str(runs["teacher"]))
    teacher.eval().requires_grad_(False)
    cpu, dtype = torch.device("cpu"), train_dtype(spec.precision)
    # Earlier work of this process may leave freed memory resident (glibc keeps heap chunks once its
    # mmap threshold has risen); a try reusing it would hide the teacher. Leave 300 MB of it first.
    raise_threshold = torch.ones(4_000_000)
    del raise_threshold
    pool = [torch.ones(2_000_000) for _ in range(40)]
    top = pool.pop()  # held: the freed chunks below it cannot return to the OS by trimming the top alone
    del pool
    for _ in range(2):  # the first tries warm the allocator's arenas
        _, alone = _try_size(student, spec, 32, cpu, dtype, None)
        _, with_teacher = _try_size(student, spec, 32, cpu, dtype, None, Distiller(teacher, spec.distill))
    # teacher logits alone: 32 x 256 positions x 256 ids x 4 bytes = 8 MiB, plus its transient activations
    assert with_teacher - alone > 8 * 2**20, (alone, with_teacher)
    del top
