"""The pipeline (strategy pp) plan: what each pipeline rank holds, the activations its schedule keeps, the bubble."""

from __future__ import annotations

import pytest
from rich.console import Console

from launcher.front import compose, dryrun
from launcher.plan import planner, states
from launcher.plan.activations import activation_bytes, layer_bytes, mask_bytes
from launcher.plan.pipeline import pipeline_plan
from launcher.spec import RunSpec, to_spec

PP = ["parallel.strategy=pp", "launcher=local"]


def make_spec(overrides: list[str]) -> RunSpec:
    """The spec `train` would build from these overrides (not validated against this machine)."""
    return to_spec(compose.strip_hydra(compose.compose([*PP, *overrides])))


def pp_plan(overrides: list[str], device_type: str = "cpu"):
    """The pipeline plan of a pp run, its stages placed as the dry run (and the ranks) place them."""
    spec = make_spec(overrides)
    return spec, pipeline_plan(spec, dryrun.pipeline_layout(spec), device_type=device_type)


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.pp_size=2", "launcher.nproc=2"],
        ["parallel.pp_size=2", "launcher.nproc=2", "model.tie_embeddings=false"],
        ["parallel.pp_size=4", "launcher.nproc=4", "model.n_layer=8", "model.bias=true"],
        [
            "parallel.pp_size=2",
            "launcher.nproc=2",
            "model.n_layer=8",
            "parallel.pp_schedule=zero_bubble",
            "parallel.pp_stages_per_rank=2",
        ],
    ],
)
def test_stage_parameters_add_up_to_the_model_and_the_tied_copy(overrides: list[str]) -> None:
    spec, pipeline = pp_plan(overrides)
    counts = states.count_params(spec)
    tied_copy = counts.head if spec.model.tie_embeddings else 0
    assert sum(rank.num_params for rank in pipeline.ranks) == counts.total + tied_copy
    layers = sorted(i for rank in pipeline.ranks for r in rank.layers for i in r)
    assert layers == list(range(spec.model.n_layer))  # every layer on exactly one stage
    assert [r.embedding for r in pipeline.ranks].count(True) == 1
    assert [r.head for r in pipeline.ranks].count(True) == 1
    for rank in pipeline.ranks:  # one replica per stage: 4 B weights and gradients, 8 B of Adam
        assert (rank.memory.parameters, rank.memory.optimizer_states) == (
            4 * rank.num_params,
            8 * rank.num_params,
        )


def test_fsdp_shards_each_stage_over_its_data_parallel_ranks() -> None:
    _, alone = pp_plan(["parallel.pp_size=2", "launcher.nproc=2"])
    _, sharded = pp_plan(["parallel.pp_size=2", "launcher.nproc=4"])  # dp = 4 / 2 = 2
    for one, two in zip(alone.ranks, sharded.ranks, strict=True):
        assert two.memory.parameters == pytest.approx(one.memory.parameters / 2, abs=1)
        assert two.memory.optimizer_states == pytest.approx(one.memory.optimizer_states / 2, abs=1)
        assert "FSDP over 2 ranks" in two.memory.notes[0]


def test_gpipe_keeps_every_micro_batch_and_1f1b_at_most_pp_size() -> None:
    base = ["parallel.pp_size=4", "launcher.nproc=4", "model.n_layer=8", "parallel.pp_microbatches=8"]
    _, gpipe = pp_plan([*base, "parallel.pp_schedule=gpipe", "train.micro_batch_size=16"])
    _, one_f_one_b = pp_plan([*base, "parallel.pp_schedule=1f1b", "train.micro_batch_size=16"])
    assert [r.in_flight for r in gpipe.ranks] == [(8,), (8,), (8,), (8,)]
    assert [r.in_flight for r in one_f_one_b.ranks] == [(4,), (3,), (2,), (1,)]  # pp_size - stage
    first_g, first_1 = gpipe.ranks[0].memory, one_f_one_b.ranks[0].memory
    assert first_g.activations == pytest.approx(2 * first_1.activations, abs=2)  # 8 vs 4 micro batches
    assert one_f_one_b.memory.total < gpipe.memory.total
    assert gpipe.memory is gpipe.worst.memory
    assert gpipe.memory.total == max(r.memory.total for r in gpipe.ranks)


def test_one_micro_batch_through_all_stages_is_the_unsplit_models_activations() -> None:
    """GPipe with one pipeline micro batch: the stages' activations add up to the whole model's
    (plus the stage output the first stage backpropagates through), checkpointing included."""
    for mode in ("none", "blocks"):
        spec, pipeline = pp_plan(
            [
                "parallel.pp_size=2",
                "launcher.nproc=2",
                "parallel.pp_schedule=gpipe",
                "parallel.pp_microbatches=1",
                f"memory.activation_checkpointing={mode}",
                "memory.checkpoint_every=1",
            ]
        )
        shape = planner.activation_shape(spec)
        boundary = shape.micro_batch * shape.seq_len * spec.model.d_model * 4
        whole = activation_bytes(spec.model, shape, mode=mode)
        second_recompute = layer_bytes(spec.model, shape) - layer_bytes(spec.model, shape, mode)
        split = sum(r.memory.activations for r in pipeline.ranks)
        # each stage recomputes one checkpointed layer at its peak, the whole model one in all, and
        # each stage builds its own dense document mask (128 tokens: auto keeps sdpa on the CPU)
        assert shape.dense_mask
        assert split == whole + boundary + second_recompute + mask_bytes(shape)


@pytest.mark.parametrize(
    ("schedule", "pp_size", "micro", "stages_per_rank", "bubble"),
    [
        ("gpipe", 2, 4, 1, 1 / 5),
        ("1f1b", 2, 4, 1, 1 / 5),
        ("1f1b", 4, 8, 1, 3 / 11),
        ("interleaved_1f1b", 2, 4, 2, 1 / 9),
        ("zero_bubble", 2, 4, 2, 1 / 9),
    ],
)
def test_bubble_fraction(
    schedule: str, pp_size: int, micro: int, stages_per_rank: int, bubble: float
) -> None:
    _, pipeline = pp_plan(
        [
            f"parallel.pp_size={pp_size}",
            f"launcher.nproc={pp_size}",
            "model.n_layer=8",
            f"parallel.pp_schedule={schedule}",
            f"parallel.pp_microbatches={micro}",
            f"parallel.pp_stages_per_rank={stages_per_rank}",
        ]
    )
    assert pipeline.bubble == pytest.approx(bubble)
    formula = "(p-1)/(v*m+p-1)" if stages_per_rank > 1 else "(p-1)/(m+p-1)"
    assert dryrun.bubble_line(pipeline, pp_size).startswith(
        f"schedule {schedule}: bubble {formula} = {bubble:.2f}"
    )


def test_stage_map_of_interleaved_and_zero_bubble() -> None:
    base = ["parallel.pp_size=2", "launcher.nproc=2", "model.n_layer=8", "parallel.pp_stages_per_rank=2"]
    split = "parallel.pp_split=[3,4,6]"
    _, interleaved = pp_plan([*base, split, "parallel.pp_schedule=interleaved_1f1b"])
    assert [r.stages for r in interleaved.ranks] == [(0, 2), (1, 3)]
    assert [r.layers for r in interleaved.ranks] == [(range(0, 3), range(4, 6)), (range(3, 4), range(6, 8))]
    assert [(r.embedding, r.head) for r in interleaved.ranks] == [(True, False), (False, True)]
    # torch's warmup: 2 + 2 (p - 1 - rank) forwards, + 1, by chunk of 2 micro batches per round
    assert [r.in_flight for r in interleaved.ranks] == [(3, 2), (2, 1)]
    _, v_shape = pp_plan([*base, split, "parallel.pp_schedule=zero_bubble"])
    assert [r.stages for r in v_shape.ranks] == [(0, 3), (1, 2)]
    assert [(r.embedding, r.head) for r in v_shape.ranks] == [(True, True), (False, False)]
    assert [sum(r.in_flight) for r in v_shape.ranks] == [4, 4]  # 2 p stage micro batches on every rank


def test_cuda_pipeline_plan_and_plan_refuses_pp() -> None:
    spec, pipeline = pp_plan(
        ["parallel.pp_size=2", "launcher.nproc=2", "precision=bf16", "memory=offload"], device_type="cuda"
    )
    for rank in pipeline.ranks:
        assert rank.memory.buffers > planner.CUDA_CONTEXT_BYTES and rank.memory.host_bytes > 0
    with pytest.raises(ValueError, match="pipeline_plan"):
        planner.plan(spec, 2, "cpu")


def test_dry_run_prints_the_stage_table_and_the_bubble() -> None:
    console = Console(record=True, width=160)
    dryrun.print_plan(console, make_spec(["parallel.pp_size=2", "launcher.nproc=2"]))
    text = console.export_text()
    for column in ("pipeline rank", "stages", "layers", "params", "est. memory"):
        assert column in text
    assert "emb 0-1" in text and "2-3 head" in text
    assert "schedule 1f1b: bubble (p-1)/(m+p-1) = 0.20" in text
    assert "the largest pipeline rank (0)" in text and "1f1b keeps 2 in flight" in text


def test_hugging_face_stages_add_up_to_its_exact_count() -> None:
    pytest.importorskip("transformers")
    spec, pipeline = pp_plan(["parallel.pp_size=2", "launcher.nproc=2", "model=hf_llama_tiny"])
    counts = states.count_params(spec)
    tied_copy = counts.head if states.gpt_view(spec).model.tie_embeddings else 0
    assert sum(rank.num_params for rank in pipeline.ranks) == counts.total + tied_copy
    assert all(rank.num_params > 0 for rank in pipeline.ranks)
