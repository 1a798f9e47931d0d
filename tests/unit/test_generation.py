"""The key-value-cache generator (launcher.components.model.generation): greedy tokens equal transformers'
`generate` for tiny Llama, Qwen2 and GPT-2 folders and the recompute path for the built-in GPT, in
left-padded batches of prompts of different lengths; per-row stops; seeded sampling that the batch
split and the world size (2 gloo ranks under FSDP2, and tensor parallel) do not change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_assets import make_hf_model

from conftest import free_port
from launcher.components.model.generation import Sampling, generate
from launcher.components.model.gpt import GPT
from launcher.config.model import ModelConfig

PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [11], [30, 31, 32, 33, 34]]
SAMPLING = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=7)
CONTEXT = 48


def tiny_gpt() -> GPT:
    """A seeded 2-layer GPT with weights drawn wide (std 0.2) so its greedy choices vary from token to token."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        n_layer=2, n_head=2, d_model=32, vocab_size=64, max_seq_len=CONTEXT, tie_embeddings=False
    )
    model = GPT(cfg)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.2)
    return model.eval()


def recompute(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from the training forward over the whole prefix at every step (one prompt, no padding)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens[-CONTEXT:]]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_the_gpt_with_a_cache_gives_the_tokens_of_the_recompute_path() -> None:
    model = tiny_gpt()
    cached = generate(model, PROMPTS, max_new_tokens=16, context=CONTEXT)
    assert [c.ids for c in cached] == [recompute(model, p, 16) for p in PROMPTS]
    assert all(c.stop == "max_new_tokens" for c in cached)
    assert len({tuple(c.ids) for c in cached}) == len(PROMPTS) and len(set(cached[1].ids)) > 3
    assert generate(model, PROMPTS, max_new_tokens=16, context=CONTEXT, use_cache=False) == cached
    # past the context the window slides, as the recompute path does
    long = [list(range(1, 45))]
    notes: list[str] = []
    slid = generate(model, long, max_new_tokens=8, context=CONTEXT, note=notes.append)
    assert slid[0].ids == recompute(model, long[0], 8) and len(notes) == 1


def test_a_row_stops_at_its_stop_id_and_the_others_go_on() -> None:
    model = tiny_gpt()
    free = generate(model, PROMPTS, max_new_tokens=10, context=CONTEXT)
    stop = free[0].ids[2]
    stopped = generate(model, PROMPTS, max_new_tokens=10, context=CONTEXT, stop_ids=(stop,))
    assert (stopped[0].stop, stopped[0].eos_id) == ("eos", stop)
    for before, after in zip(free, stopped, strict=True):
        cut = before.ids.index(stop) if stop in before.ids else len(before.ids)
        assert after.ids == before.ids[:cut]
    assert any(c.stop == "max_new_tokens" for c in stopped), "a row that never met the stop id went on"
    limited = generate(model, PROMPTS, max_new_tokens=10, context=CONTEXT, vocab_limit=20)
    assert all(t < 20 for c in limited for t in c.ids)
    assert model.training is False and all(not m.training for m in model.modules())


def test_seeded_sampling_does_not_depend_on_how_prompts_are_batched() -> None:
    model = tiny_gpt()
    whole = generate(model, PROMPTS, max_new_tokens=12, context=CONTEXT, sampling=SAMPLING)
    parts = [
        generate(
            model,
            PROMPTS[i : i + 2],
            max_new_tokens=12,
            context=CONTEXT,
            sampling=SAMPLING,
            indices=[i, i + 1],
        )
        for i in (0, 2)
    ]
    assert whole == parts[0] + parts[1]
    greedy = generate(model, PROMPTS, max_new_tokens=12, context=CONTEXT)
    assert [c.ids for c in whole] != [c.ids for c in greedy]
    other_seed = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=8)
    assert generate(model, PROMPTS, max_new_tokens=12, context=CONTEXT, sampling=other_seed) != whole


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    """Tiny seeded Llama, Qwen2 and GPT-2 folders (save_pretrained)."""
    root = tmp_path_factory.mktemp("generation-hf")
    return {arch: make_hf_model(arch, root / arch) for arch in ("llama", "qwen2", "gpt2")}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_greedy_tokens_equal_transformers_generate(hf_folders, arch: str) -> None:
    from transformers import AutoModelForCausalLM

    from launcher.components.model.hf import build_hf_model

    folder = hf_folders[arch]
    ours = build_hf_model(ModelConfig(kind="hf", path=str(folder)), announce=False)  # as training builds it
    got = generate(ours, PROMPTS, max_new_tokens=12, context=128)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    width = max(len(p) for p in PROMPTS)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    want = reference.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    assert [c.ids for c in got] == want[:, width:].tolist()


RANKS = """
import json, os, sys
import torch
from torch.distributed.device_mesh import init_device_mesh
sys.path[:0] = [sys.argv[2], os.path.dirname(sys.argv[2])]  # this file, and tests/ for its helpers
from test_generation import CONTEXT, PROMPTS, SAMPLING, tiny_gpt
from launcher.components.model.generation import generate
from launcher.components.model.hf import build_hf_model
from launcher.config.model import ModelConfig
from launcher.config.parallel import ParallelConfig
from launcher.config.precision import PrecisionConfig
from launcher.parallel.dims import init_process_group
from launcher.parallel.fsdp import apply_fsdp
from launcher.parallel.tensor_parallel import apply_tensor_parallel

dist = init_process_group("cpu")
mesh = init_device_mesh("cpu", (2,))
mine = [i for i in range(len(PROMPTS)) if i % 2 == dist.rank]  # rank 0: prompts 0 and 2, rank 1: 1 and 3
llama = lambda: build_hf_model(ModelConfig(kind="hf", path=sys.argv[3]), announce=False)
shard = lambda model: apply_fsdp(model, mesh, parallel=ParallelConfig(), precision=PrecisionConfig(), pin_memory=False)
# rank 0 stops its first row early and rank 1 never: the ranks still take the same number of steps
stops = (int(sys.argv[4]),) if dist.rank == 0 else ()
row = {}
for name, build, context in (("gpt", tiny_gpt, CONTEXT), ("llama", llama, 128)):
    sharded = generate(shard(build()), [PROMPTS[i] for i in mine], max_new_tokens=12, context=context,
                       sampling=SAMPLING, indices=mine, stop_ids=stops if name == "gpt" else ())
    tp = apply_tensor_parallel(build(), mesh, sequence_parallel=False)  # every rank decodes every prompt
    split = generate(tp, PROMPTS, max_new_tokens=12, context=context, sampling=SAMPLING)
    row[name] = {"fsdp": {i: c.ids for i, c in zip(mine, sharded)}, "tp": [c.ids for c in split],
                 "dtensor": type(next(tp.parameters())).__name__}
with open(os.path.join(sys.argv[1], f"rank{dist.rank}.json"), "w") as out:
    json.dump(row, out)
torch.distributed.barrier()
"""


def test_seeded_sampling_gives_the_same_tokens_on_two_ranks_under_fsdp2_and_tensor_parallel(
    tmp_path, hf_folders
) -> None:
    from launcher.components.model.hf import build_hf_model

    llama = build_hf_model(ModelConfig(kind="hf", path=str(hf_folders["llama"])), announce=False)
    one_rank = {
        "gpt": [
            c.ids
            for c in generate(tiny_gpt(), PROMPTS, max_new_tokens=12, context=CONTEXT, sampling=SAMPLING)
        ],
        "llama": [c.ids for c in generate(llama, PROMPTS, max_new_tokens=12, context=128, sampling=SAMPLING)],
    }
    stop = one_rank["gpt"][0][1]  # prompt 0 (rank 0's) stops after one token
    stopped = generate(
        tiny_gpt(), PROMPTS, max_new_tokens=12, context=CONTEXT, sampling=SAMPLING, stop_ids=(stop,)
    )
    assert stopped[0].stop == "eos" and len(stopped[0].ids) <= 1
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(script), str(tmp_path), str(Path(__file__).parent),
           str(hf_folders["llama"]), str(stop)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, row in enumerate(rows):
        for name in ("gpt", "llama"):
            assert row[name]["dtensor"] == "DTensor" and row[name]["tp"] == one_rank[name], (rank, name)
            for index, ids in row[name]["fsdp"].items():
                stops = rank == 0 and name == "gpt"
                want = stopped[int(index)].ids if stops else one_rank[name][int(index)]
                assert ids == want, (rank, name, index)
