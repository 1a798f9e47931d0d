"""Hugging Face Mixture-of-Experts folders (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss) in the real loop.

A folder holds its experts per expert (what `save_pretrained` writes) or fused (the tensors transformers
trains with): both load to transformers' own logits, train under FSDP2 like one process, with expert
parallelism (parallel.ep_size) too, and export to a folder transformers loads with the trained model's logits. The router's load-balancing loss reaches the
loss when config.json turns it on; LoRA adapts the fused expert tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY, assert_same_losses, losses, read_metrics, run_inline, run_ranks, write_spec
from launcher.spec import InvalidSpec, load_spec

transformers = pytest.importorskip("transformers")

from moe_assets import MOE_ARCHITECTURES, make_moe_folder, weight_names  # noqa: E402

RUN = [*TINY, "train.eval_every=null", "train.max_steps=4", "checkpoint.every=4", "model=hf"]
_folders: dict[tuple[str, str, float], Path] = {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(arch, layout, router_aux_loss) -> a tiny saved MoE folder, written on first use."""

    def get(arch: str, layout: str = "per_expert", router_aux_loss: float = 0.0) -> Path:
        key = (arch, layout, router_aux_loss)
        if key not in _folders:
            out = tmp_path_factory.mktemp(f"{arch}-{layout}") / "model"
            _folders[key] = make_moe_folder(arch, out, layout=layout, router_aux_loss=router_aux_loss)
        return _folders[key]

    return get


def _ids(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(seed))


LOADS = [(arch, layout) for arch in MOE_ARCHITECTURES for layout in ("per_expert", "fused")]
DEFAULT_LOADS = {("mixtral", "per_expert"), ("mixtral", "fused"), ("qwen3_moe", "per_expert")}


@pytest.mark.parametrize(
    ("arch", "layout"),
    [pytest.param(*case, marks=[] if case in DEFAULT_LOADS else pytest.mark.extended) for case in LOADS],
)
def test_a_folder_loads_to_transformers_own_logits(folder, tmp_path, arch: str, layout: str) -> None:
    """The rules accept the folder (its expert tensors fused by transformers' mapping) and the launcher's
    model computes what transformers' own from_pretrained of the folder computes."""
    from launcher.components.model.build import build_model

    path = folder(arch, layout)
    names = weight_names(path)
    per_expert = any(".experts.0." in name for name in names)
    assert per_expert == (layout == "per_expert" and arch != "gpt_oss"), names[:8]  # gpt-oss saves fused
    spec = load_spec(write_spec([*RUN, f"model.path={path}"], tmp_path / "run"))
    ours = build_model(spec.model).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()), theirs(input_ids=_ids()).logits, rtol=1e-5, atol=1e-5)


def test_experts_that_do_not_fit_config_json_are_refused(folder, tmp_path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(folder("mixtral"), bad)
    config = json.loads((bad / "config.json").read_text())
    config["num_local_experts"] = 8
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidSpec) as caught:
        write_spec([*RUN, f"model.path={bad}"], tmp_path / "run")
    said = str(caught.value)
    assert (
        "do not fit the model its config.json describes" in said
        and "experts.gate_up_proj [4, 96, 64]" in said
    )


_runs: dict[tuple[str, ...], Path] = {}


def _run(folder_path: Path, root: Path, args: list[str], ranks: int = 0) -> Path:
    """A run of the folder (cached per module by its arguments): inline, or `ranks` real ranks."""
    key = (str(folder_path), str(ranks), *args)
    if key not in _runs:
        run_dir = root / f"run{len(_runs)}"
        overrides = [*RUN, f"model.path={folder_path}", *args]
        if ranks == 0:
            assert run_inline(overrides, run_dir) == 0
        else:
            proc = run_ranks(
                [*overrides, "launcher=local", f"launcher.nproc={ranks}"], run_dir, nproc=ranks, timeout=900
            )
            assert proc.returncode == 0, proc.stderr[-4000:]
        _runs[key] = run_dir
    return _runs[key]


def _checkpoint_model(run_dir: Path) -> torch.nn.Module:
    """The launcher's model with the run's newest checkpoint, consolidated at world size 1."""
    from launcher.components import checkpoint
    from launcher.components.model.build import build_model
    from launcher.parallel.registry import strategy_module

    spec = load_spec(run_dir / "spec.yaml")
    model = build_model(spec.model)
    model.load_state_dict(
        strategy_module(spec.parallel.strategy).consolidate(checkpoint.good_checkpoints(run_dir)[0])
    )
    return model.eval()


def _assert_export_gives_the_trained_logits(run_dir: Path, out: Path) -> None:
    """train-export --format hf of the run's last checkpoint: transformers loads it with the trained logits (1e-5)."""
    from launcher.tools import export

    assert export.main([str(run_dir), str(out), "--format", "hf"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want = _checkpoint_model(run_dir)(_ids(5))
        torch.testing.assert_close(loaded(input_ids=_ids(5)).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.extended  # the default tier's expert-parallel test runs FSDP2 on the same folder and exports it
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fsdp2_trains_like_one_process_and_exports_its_logits(folder, tmp_path_factory, arch: str) -> None:
    """FSDP2 on 2 ranks (built empty, experts sharded, filled from rank 0) gives one process's per-step losses
    at the same global batch (1e-5), and train-export's folder gives the trained model's logits (1e-5)."""

    root = tmp_path_factory.mktemp(f"{arch}-runs")
    path = folder(arch)
    one = losses(_run(path, root, ["train.micro_batch_size=8"]))
    sharded_dir = _run(path, root, ["parallel=fsdp"], ranks=2)
    sharded = losses(sharded_dir)
    assert_same_losses(sharded, one, steps=4)
    _assert_export_gives_the_trained_logits(sharded_dir, root / "exported")


EP_RUNS = [
    pytest.param("qwen3_moe", ["parallel=fsdp"], 2, id="qwen3_moe-fsdp-2"),
    pytest.param("mixtral", ["parallel=fsdp", "train.micro_batch_size=2"], 4, id="mixtral-fsdp-4", marks=pytest.mark.extended),
    pytest.param("qwen3_moe", ["parallel=ddp"], 2, id="qwen3_moe-ddp-2", marks=pytest.mark.extended),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "args", "ranks"), EP_RUNS)
def test_expert_parallel_trains_like_one_process_and_exports_its_logits(
    folder, tmp_path_factory, arch: str, args: list[str], ranks: int
) -> None:
    """parallel.ep_size=2: each rank holds half of every layer's experts and the token copies travel to them by
    all-to-all (under FSDP2 each half further sharded over its replicas): one process's per-step losses at the
    same global batch (1e-5), and train-export's folder gives the trained model's logits (1e-5)."""

    root = tmp_path_factory.mktemp(f"{arch}-ep")
    path = folder(arch)
    one_dir = _run(path, root, ["train.micro_batch_size=8"])
    ep_dir = _run(path, root, [*args, "parallel.ep_size=2"], ranks=ranks)
    one, split = losses(one_dir), losses(ep_dir)
    assert_same_losses(split, one, steps=4)
    held = [read_metrics(d / "metrics.jsonl")[-1]["param_bytes"] for d in (ep_dir, one_dir)]
    assert held[0] < held[1]  # the experts are split
    # the per-layer expert load: each rank counts its tokens' choices before they travel, summed over the ranks
    loads = [[r for r in read_metrics(d / "metrics.jsonl") if "moe_load/0" in r] for d in (ep_dir, one_dir)]
    assert len(loads[0]) == len(loads[1]) == 4
    for got, want in zip(*loads, strict=True):
        layers = sorted(k for k in want if k.startswith("moe_load"))
        assert layers == sorted(k for k in got if k.startswith("moe_load")) and len(layers) > 2
        assert all(want[k] >= 1.0 and got[k] == pytest.approx(want[k], rel=1e-6) for k in layers)
    _assert_export_gives_the_trained_logits(ep_dir, root / "exported")


@pytest.mark.extended
def test_an_expert_parallel_checkpoint_resumes_in_one_process(folder, tmp_path_factory) -> None:
    """The FSDP2 ep 2 checkpoint holds whole experts: one process resumes its step 2 to its step 3 and 4 (1e-5)."""
    root = tmp_path_factory.mktemp("qwen3_moe-ep-resume")
    path = folder("qwen3_moe")
    ep_dir = _run(path, root, ["parallel=fsdp", "parallel.ep_size=2", "checkpoint.every=2"], ranks=2)
    step_2 = ep_dir / "checkpoints" / "step_2"
    resumed = _run(path, root, ["train.micro_batch_size=8", "checkpoint.every=2", f"resume={step_2}"])
    split = losses(ep_dir)
    assert losses(resumed).keys() == {3, 4}
    for step, loss in losses(resumed).items():
        assert loss == pytest.approx(split[step], rel=1e-5), (step, loss, split[step])


def test_router_load_balancing_loss_is_in_the_loss(folder, tmp_path) -> None:
    """With output_router_logits on, the first step's loss is transformers' own form (cross-entropy +
    router_aux_loss_coef * its aux_loss) on the first batch, and the record carries router_aux_loss."""
    from launcher.components.data.batching import build_stream
    from launcher.components.data.tokens import load_corpus

    path = folder("mixtral", router_aux_loss=0.05)
    run_dir = tmp_path / "run"
    one_step = ["train.max_steps=1", "scheduler.warmup_steps=0", "checkpoint.every=null"]
    assert run_inline([*RUN, f"model.path={path}", *one_step], run_dir) == 0
    spec = load_spec(run_dir / "spec.yaml")
    d = spec.data
    stream = build_stream(
        load_corpus(d, spec.tokenizer), seq_len=d.seq_len, packing=d.packing, document_mask=d.document_mask,
        batching=d.batching, max_tokens_per_batch=d.max_tokens_per_batch, micro_batch_size=4,
        seed=spec.train.seed, grad_accum_steps=1, rank=0, world_size=1,
    )  # fmt: skip
    batch = stream.next_batch()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32
    )  # train mode, as trained
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"))
    # the batch's labels are already the next tokens (transformers' `labels=` would shift them once more)
    ce = torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100
    )
    record = read_metrics(run_dir / "metrics.jsonl")[0]
    assert out.aux_loss > 1.0  # 4 experts, top 2: a balanced router gives 1 * top_k
    assert record["router_aux_loss"] == pytest.approx(float(out.aux_loss), rel=1e-5)
    assert record["loss"] == pytest.approx(float(ce + 0.05 * out.aux_loss), rel=1e-5)


def test_lora_on_experts_trains_and_merges_to_the_adapted_logits(folder, tmp_path) -> None:
    """quantization.lora.targets naming the fused expert tensors adapts every expert (peft's target_parameters):
    the expert adapters train, and the merged export gives the adapted model's logits (1e-5)."""
    from launcher.components import checkpoint
    from launcher.tools import export
    from launcher.tools.merge import load_adapted

    targets = "quantization.lora.targets=[q_proj,experts.gate_up_proj,experts.down_proj]"
    run_dir = tmp_path / "run"
    args = [
        *RUN,
        f"model.path={folder('qwen3_moe')}",
        "train.max_steps=3",
        "checkpoint.every=3",
        "quantization=lora",
        "quantization.lora.rank=4",
        targets,
    ]
    assert run_inline(args, run_dir) == 0
    step_dir = checkpoint.good_checkpoints(run_dir)[0]
    _, adapted = load_adapted(step_dir)
    expert_b = {n: p for n, p in adapted.named_parameters() if ".experts." in n and "lora_B" in n}
    assert len(expert_b) == 4 and all(p.abs().sum() > 0 for p in expert_b.values())  # 2 layers x 2 tensors
    out = tmp_path / "merged"
    assert export.main([str(run_dir), str(out), "--format", "hf", "--merge"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=_ids()).logits, adapted.eval()(_ids()), rtol=1e-5, atol=1e-5
        )


@pytest.mark.extended
def test_tensor_parallel_splits_attention_and_keeps_experts_whole(folder, tmp_path_factory) -> None:
    """parallel=tp on 2 ranks splits Mixtral's attention by its plan, its routers and experts whole on each rank
    (run on local tensors): one process's per-step losses at the same batch (1e-5)."""
    root = tmp_path_factory.mktemp("mixtral-tp")
    path = folder("mixtral")
    one = losses(_run(path, root, ["train.micro_batch_size=8"]))
    split = losses(
        _run(path, root, ["parallel=tp", "train.micro_batch_size=8", "checkpoint.every=null"], ranks=2)
    )
    assert split.keys() == one.keys()
    for step, loss in one.items():
        assert split[step] == pytest.approx(loss, rel=1e-5), (step, split[step], loss)


def test_router_loss_under_pipeline_stages_is_refused(folder, tmp_path) -> None:
    """Stages each run part of the forward, so the router loss (collected over all layers) is refused there."""
    path = folder("mixtral", router_aux_loss=0.05)
    with pytest.raises(InvalidSpec) as caught:
        write_spec(
            [*RUN, f"model.path={path}", "parallel=pp", "launcher=local", "launcher.nproc=2"],
            tmp_path / "run",
        )
    said = str(caught.value)
    assert "load-balancing loss" in said and "output_router_logits to false" in said


@pytest.mark.extended
def test_pipeline_stages_of_a_moe_folder_train_like_one_process(folder, tmp_path_factory) -> None:
    """parallel=pp on 2 ranks cuts Mixtral between its MoE layers: one process's per-step losses (1e-5)."""
    root = tmp_path_factory.mktemp("mixtral-pp")
    path = folder("mixtral")
    one = losses(_run(path, root, ["train.micro_batch_size=8"]))
    staged = losses(
        _run(path, root, ["parallel=pp", "train.micro_batch_size=8", "checkpoint.every=null"], ranks=2)
    )
    assert staged.keys() == one.keys()
    for step, loss in one.items():
        assert staged[step] == pytest.approx(loss, rel=1e-5), (step, staged[step], loss)


def test_the_dry_run_counts_total_and_active_parameters(folder) -> None:
    """Mixtral's experts: 2 layers x 4 experts x (96 x 64 + 64 x 48); a token runs through 2 of the 4."""
    from launcher.components.model.build import flops_per_token
    from launcher.config.model import ModelConfig
    from launcher.front.model_dims import describe_model

    cfg = ModelConfig(kind="hf", path=str(folder("mixtral")))
    total = sum(
        p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(folder("mixtral")).parameters()
    )
    active = total - 2 * 2 * (96 * 64 + 64 * 48)
    assert f"{total:,} parameters" in describe_model(
        cfg
    ) and f"{active:,} active per token" in describe_model(cfg)
    assert flops_per_token(cfg, 32) == 6 * active + 12 * 2 * 64 * 32


def test_lora_dropout_on_expert_tensors_is_refused(folder, tmp_path) -> None:
    """peft adapts fused expert tensors without input dropout: a dropout with expert targets is refused before launch."""
    args = [
        *RUN, f"model.path={folder('mixtral')}", "quantization=nf4_lora", "quantization.lora.dropout=0.05",
        "quantization.lora.targets=[q_proj,experts.gate_up_proj]",
    ]  # fmt: skip
    with pytest.raises(InvalidSpec) as caught:
        write_spec(args, tmp_path / "run")
    assert "quantization.lora.dropout=0" in str(caught.value) and "experts.gate_up_proj" in str(caught.value)
