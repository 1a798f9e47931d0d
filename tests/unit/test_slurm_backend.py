"""The slurm backend without a cluster: the script, its quoting, job ids, rank variables, rules, dry run."""

from __future__ import annotations

import subprocess

import pytest

from conftest import TINY, run_cli
from launcher.exits import ExitStatus
from launcher.front import compose
from launcher.launch import slurm, slurm_jobs, slurm_rank


def _spec(overrides: list[str]):
    cfg = compose.compose(["launcher=slurm", *overrides])
    spec, errors = compose.validate(cfg)
    assert not errors, errors
    return spec


def test_script_quotes_every_configured_value_and_parses(tmp_path) -> None:
    hostile = "$(touch pwned) x"
    spec = _spec(
        [
            "launcher.nproc=2",
            "launcher.nnodes=2",
            "parallel=ddp",
            "launcher.slurm.cpus_per_task=3",
            "launcher.slurm.mem_gb=1.5",
            "launcher.slurm.time_min=30",
            f"launcher.slurm.partition='{hostile}'",
            "launcher.slurm.account=acct",
            "launcher.slurm.extra_sbatch=['--mail-type=END']",
            f"name='{hostile}'",
        ]
    )
    script = slurm.render_script(spec, tmp_path / "run dir", python="/opt/py thon/bin/python")
    lines = script.splitlines()
    assert "#SBATCH --partition='$(touch pwned) x'" in lines
    assert "#SBATCH --job-name='$(touch pwned) x'" in lines
    for option in ("--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=3", "--mem=1536M", "--time=30",
                   "--account=acct", "--signal=USR2@120", "--requeue", "--mail-type=END"):  # fmt: skip
        assert f"#SBATCH {option}" in lines, option
    assert f"#SBATCH --output='{(tmp_path / 'run dir').resolve()}/slurm/%j.out'" in lines
    srun = next(line for line in lines if line.startswith("srun "))
    assert "'/opt/py thon/bin/python' -m launcher.launch.slurm_rank" in srun
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid shell
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("job_id", ["7", "123456", "12_3", "12_[1-3,5%2]", "12+1"])
def test_valid_job_ids_pass(job_id: str) -> None:
    assert slurm_jobs.valid_job_id(job_id) == job_id


@pytest.mark.parametrize("job_id", ["", None, "abc", "12;rm -rf /", "12 13", "-1", "$(id)", "12_", "1\n2"])
def test_invalid_job_ids_never_reach_a_command(job_id: str | None) -> None:
    with pytest.raises(ValueError, match="not a SLURM job id"):
        slurm_jobs.valid_job_id(job_id)


def test_rank_environment_from_slurm_variables() -> None:
    env = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
           "SLURM_NTASKS_PER_NODE": "2(x2)"}  # fmt: skip
    out = slurm_rank.torch_environment(env, master_addr="node01", port=None)
    assert out == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "node01", "MASTER_PORT": str(20000 + 4242)}  # fmt: skip
    assert slurm_rank.torch_environment(env, master_addr="n", port=29500)["MASTER_PORT"] == "29500"
    with pytest.raises(ValueError):
        slurm_rank.torch_environment({**env, "SLURM_JOB_ID": "1;reboot"}, master_addr="n", port=None)


def test_requeue_only_when_preempted_and_under_the_cap() -> None:
    assert slurm_rank.should_requeue(ExitStatus.PREEMPTED, restarts=0, max_requeues=1)
    assert not slurm_rank.should_requeue(ExitStatus.PREEMPTED, restarts=1, max_requeues=1)
    assert not slurm_rank.should_requeue(0, restarts=0, max_requeues=3)
    assert not slurm_rank.should_requeue(1, restarts=0, max_requeues=3)
    assert slurm_rank.restart_count({"SLURM_RESTART_COUNT": "2"}) == 2
    assert slurm_rank.restart_count({"SLURM_RESTART_COUNT": "x"}) == 0


def _errors(argv: list[str]) -> list[str]:
    _, errors = compose.validate(compose.compose(["launcher=slurm", *argv]))
    return [str(e) for e in errors]


@pytest.mark.parametrize(
    ("argv", "keys", "phrase"),
    [
        (["launcher.nproc=2", "parallel=ddp", "launcher.slurm.gpus_per_node=4"], "launcher.nproc, launcher.slurm.gpus_per_node",
         "one rank per GPU"),
        (["launcher.nproc=3", "parallel=tp_fsdp"],
         "launcher.nproc, launcher.nnodes, parallel.tp_size, parallel.replicate_degree", "must be a multiple of"),
        (["launcher.nnodes=2", "launcher.nproc=2", "parallel.tp_size=4"], "parallel.tp_size, launcher.nproc",
         "span nodes"),
        (["launcher.slurm.signal=KILL"], "launcher.slurm.signal", "not a signal a rank can catch"),
        (["launcher.slurm.time_min=2", "launcher.slurm.signal_lead_s=120"],
         "launcher.slurm.signal_lead_s, launcher.slurm.time_min", "before the job starts"),
        (["launcher.slurm.max_requeues=-1"], "launcher.slurm.max_requeues", "0 (never requeue)"),
        (["launcher.slurm.extra_sbatch=[oops]"], "launcher.slurm.extra_sbatch[0]", "not an sbatch option"),
        (["launcher.slurm.port=80"], "launcher.slurm.port", "1024-65535"),
        (["launcher.slurm.mem_gb=0"], "launcher.slurm.mem_gb", "positive or null"),
    ],
)  # fmt: skip
def test_rule_message(argv: list[str], keys: str, phrase: str) -> None:
    errors = _errors(argv)
    assert any(e.startswith(keys + ":") and phrase in e for e in errors), errors


def test_dry_run_prints_the_script_and_submits_nothing(tmp_path) -> None:
    result = run_cli([*TINY, "dry_run=true", "launcher=slurm", "launcher.nproc=2", "parallel=ddp",
                      f"run_dir={tmp_path / 'run'}"], tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --ntasks-per-node=2" in result.stdout
    assert "-m launcher.launch.slurm_rank" in result.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing submitted


def test_failed_submission_exits_5_with_slurms_reason(tmp_path) -> None:
    # Without sbatch on PATH (or with a partition SLURM refuses) the launcher says why, never hangs,
    # and its exit status (5: submission failed) differs from an invalid spec's (2).
    result = run_cli(
        [*TINY, "launcher=slurm", f"run_dir={tmp_path / 'run'}"], tmp_path, env={"PATH": "/nonexistent"}
    )
    assert result.returncode == ExitStatus.SUBMIT_FAILED == 5, result.stdout + result.stderr
    assert "`sbatch` is not installed here" in result.stderr
    assert (tmp_path / "run" / "slurm" / "job.sbatch").is_file()  # kept for a look and a manual sbatch


@pytest.mark.parametrize(
    ("time", "option"),
    [("90", "--time=90"), ("45:30", "--time=46"), ("1:30:00", "--time=90"), ("2-12", "--time=3600"),
     ("1-02:30", "--time=1590"), ("1-00:00:30", "--time=1441")],
)  # fmt: skip
def test_time_limit_takes_sbatchs_formats(tmp_path, time: str, option: str) -> None:
    spec = _spec([f"launcher.slurm.time_min={time}"])
    assert f"#SBATCH {option}" in slurm.render_script(spec, tmp_path).splitlines()


@pytest.mark.parametrize("time", ["1:30:00:00", "soon", "0", "1-", "-5"])
def test_a_time_limit_sbatch_would_not_read_is_refused(time: str) -> None:
    errors = _errors([f"launcher.slurm.time_min='{time}'"])
    assert any(e.startswith("launcher.slurm.time_min:") and "HH:MM:SS (1:30:00)" in e for e in errors), errors


def test_signal_lead_is_judged_against_an_hhmmss_limit() -> None:
    errors = _errors(["launcher.slurm.time_min=0:01:30", "launcher.slurm.signal_lead_s=120"])
    assert any("before the job starts" in e for e in errors), errors
    assert not _errors(["launcher.slurm.time_min=0:05:00", "launcher.slurm.signal_lead_s=120"])


@pytest.mark.parametrize(
    ("line", "key"),
    [("--nodes=3", "launcher.nnodes"), ("-N 3", "launcher.nnodes"), ("--ntasks-per-node=8", "launcher.nproc"),
     ("--time=10:00:00", "launcher.slurm.time_min"), ("-p gpu", "launcher.slurm.partition"),
     ("--gres=gpu:4", "launcher.slurm.gpus_per_node"), ("--mem=100G", "launcher.slurm.mem_gb"),
     ("--job-name=x", "name")],
)  # fmt: skip
def test_extra_sbatch_that_contradicts_a_generated_option_is_refused(line: str, key: str) -> None:
    errors = _errors([f"launcher.slurm.extra_sbatch=['{line}']"])
    assert any(
        e.startswith("launcher.slurm.extra_sbatch[0]:") and f"set {key} instead" in e for e in errors
    ), errors


def test_extra_sbatch_of_its_own_still_passes(tmp_path) -> None:
    spec = _spec(["launcher.slurm.extra_sbatch=['--exclusive','--gres=nvme:1','--mail-type=END']"])
    lines = slurm.render_script(spec, tmp_path).splitlines()
    assert {"#SBATCH --exclusive", "#SBATCH --gres=nvme:1", "#SBATCH --mail-type=END"} <= set(lines)


def test_gpu_job_from_a_login_node_without_gpus_is_judged_on_what_it_asks_for(tmp_path) -> None:
    # This test machine has no GPU, like a login node: the rules judge the nodes the job requests.
    result = run_cli([*TINY, "dry_run=true", "launcher=slurm", "launcher.device=cuda", "precision=bf16",
                      "launcher.nproc=4", "launcher.slurm.gpus_per_node=4", "parallel=ddp"], tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --gpus-per-node=4" in result.stdout


def test_gpu_job_that_asks_for_no_gpus_gets_the_slurm_fix_not_nproc_0() -> None:
    errors = _errors(["launcher.device=cuda", "launcher.nproc=4", "parallel=ddp"])
    assert any(e.startswith("launcher.device, launcher.slurm.gpus_per_node:") for e in errors), errors
    assert not any("nproc=0" in e or "no CUDA GPU is visible" in e for e in errors), errors


def test_slurm_is_a_submitter_whose_job_is_read_back_from_the_run_dir(tmp_path) -> None:
    """The verbs sweeps and the closing lines ask (launch.submitter, job_state, returns_at_once), without a cluster:
    a written run that was not submitted has no job; an id SLURM does not know reads back with no state."""
    from conftest import write_spec
    from launcher import launch

    assert launch.submitter("slurm") is slurm
    assert all(launch.submitter(name) is None for name in ("inline", "local", "torchrun"))
    assert launch.returns_at_once(_spec(["launcher.slurm.wait=false"])) and not launch.returns_at_once(
        _spec([])
    )
    run_dir, plain = tmp_path / "run", tmp_path / "plain"
    write_spec(["launcher=slurm", *TINY], run_dir)
    write_spec(list(TINY), plain)
    assert launch.job_state(run_dir) is None and launch.job_state(plain) is None
    (run_dir / "slurm").mkdir()
    (run_dir / "slurm" / "job_id").write_text("not-a-job\n")
    assert launch.job_state(run_dir) == launch.JobState(
        job_id="not-a-job", state=None, active=False, exit_code=0
    )
