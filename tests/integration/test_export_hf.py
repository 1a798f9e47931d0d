"""`train-export --format hf` and `train-generate` on real checkpoints: one process, FSDP2, tensor
parallel and DeepSpeed ZeRO-3 on 2 ranks (gloo), the built-in GPT, transformers' Llama and GPT-2,
bytes and Hugging Face tokenizers, LoRA merged on the way; the folders loaded by transformers itself.

Runs are 4 steps and shared by the module (a 2-rank run costs about 10 s on 2 idle cores); each is
exported once, the folder shared by the tests that read it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY, run_inline, run_ranks
from launcher.components import checkpoint
from launcher.components.data.byte_tokenizer import ByteTokenizer
from launcher.components.model.build import build_model
from launcher.parallel.registry import strategy_module
from launcher.spec import load_spec
from launcher.tools import export, generate
from launcher.tools.hf_folder import byte_tokenizer

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

RUN = [*TINY, "train.max_steps=4", "train.eval_every=null", "checkpoint.every=null"]
RANKS2 = ["launcher=local", "launcher.nproc=2"]
# name -> (ranks: 0 = one process inline, 2 = two local ranks; overrides)
CASES = {
    "single-gpt": (0, ["model.vocab_size=320", "model.bias=true", "model.tie_embeddings=false"]),
    "fsdp-gpt": (2, ["parallel=fsdp"]),
    "tp-gpt": (2, ["parallel=tp", "train.micro_batch_size=8"]),
    "zero3-llama": (2, ["model=hf_llama_tiny", "model.d_ff=128", "parallel=zero3"]),
    "gpt2-hf-tokenizer": (0, ["model=hf_gpt2_tiny", "tokenizer=hf"]),
    "lora": (0, ["quantization=lora", "quantization.lora.rank=4"]),
}
_runs: dict[str, Path] = {}
_folders: dict[str, Path] = {}


@pytest.fixture(scope="module")
def run(tmp_path_factory, hf_tokenizer):
    """The run directory of a case, trained on first use."""

    def get(name: str) -> Path:
        if name not in _runs:
            ranks, extra = CASES[name]
            extra = [*extra, f"tokenizer.path={hf_tokenizer}"] if "tokenizer=hf" in extra else extra
            run_dir = tmp_path_factory.mktemp(name) / "run"
            if ranks == 0:
                assert run_inline([*RUN, *extra], run_dir) == 0
            else:
                proc = run_ranks([*RUN, *RANKS2, *extra], run_dir, nproc=ranks, timeout=600)
                assert proc.returncode == 0, proc.stderr[-4000:]
            _runs[name] = run_dir
        return _runs[name]

    return get


@pytest.fixture(scope="module")
def folder(run, tmp_path_factory):
    """The Hugging Face folder `train-export RUN OUT --format hf` writes for a case, exported on first use."""

    def get(name: str) -> Path:
        if name not in _folders:
            out = tmp_path_factory.mktemp(f"{name}-hf") / "model"
            merge = ["--merge"] if name == "lora" else []
            assert export.main([str(run(name)), str(out), "--format", "hf", *merge]) == 0
            _folders[name] = out
        return _folders[name]

    return get


def checkpoint_model(run_dir: Path) -> torch.nn.Module:
    """The launcher's model with the newest checkpoint's consolidated weights, at world size 1."""
    spec = load_spec(run_dir / "spec.yaml")
    model = build_model(spec.model)
    step_dir = checkpoint.good_checkpoints(run_dir)[0]
    model.load_state_dict(strategy_module(spec.parallel.strategy).consolidate(step_dir))
    return model.eval()


# tp-gpt in the extended tier: fsdp-gpt exports a DCP-sharded checkpoint, single-gpt the same GPT-2 names,
# and test_fsdp_tp.py consolidates the tensor-parallel checkpoint to the one-process logits.
EXPORTED = ["single-gpt", "fsdp-gpt", pytest.param("tp-gpt", marks=pytest.mark.extended), "zero3-llama",
            "gpt2-hf-tokenizer"]  # fmt: skip


@pytest.mark.parametrize("name", EXPORTED)
def test_transformers_loads_the_folder_with_the_checkpoints_logits(run, folder, name: str) -> None:
    out = folder(name)
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.dtype == torch.float32
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = checkpoint_model(run(name))(tokens)
        torch.testing.assert_close(loaded(input_ids=tokens).logits, want, rtol=1e-5, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer.encode("def f(x):\n", add_special_tokens=False)) == "def f(x):\n"


def test_gpt_becomes_gpt2_with_its_shape(folder) -> None:
    config = AutoModelForCausalLM.from_pretrained(folder("single-gpt")).config
    assert config.model_type == "gpt2" and config.activation_function == "gelu_new"
    assert (config.n_positions, config.n_inner, config.layer_norm_epsilon) == (256, 256, 1e-5)
    assert config.vocab_size == 320 and not config.tie_word_embeddings and config.eos_token_id == 0


def test_byte_tokenizer_encodes_and_decodes_like_the_training_one(folder) -> None:
    exported = AutoTokenizer.from_pretrained(folder("single-gpt"))
    assert len(exported) == 256  # the model's 64 padding rows have no spelling
    for text in [
        "plain ascii",
        "  two spaces\tand\ttabs\n",
        "héllo wörld ✓ 日本語 🎉",
        "Ā is U+0100, \x00 is eos",
    ]:
        ids = ByteTokenizer().encode([(text, True)])[0]
        assert exported.encode(text, add_special_tokens=False) == ids == byte_tokenizer().encode(text)
        assert exported.decode(ids) == text
    assert exported.decode([104, 300, 105]) == "hi"  # a padding row's id decodes to nothing


def test_hf_tokenizer_folder_is_copied(folder, hf_tokenizer) -> None:
    exported = AutoTokenizer.from_pretrained(folder("gpt2-hf-tokenizer"))
    original = AutoTokenizer.from_pretrained(hf_tokenizer)
    text = "for i in range(10):\n    print(i)"
    assert exported.encode(text) == original.encode(text)
    assert exported.chat_template == original.chat_template and exported.eos_token == "<|eos|>"
    config = AutoModelForCausalLM.from_pretrained(folder("gpt2-hf-tokenizer")).config
    assert config.eos_token_id == original.eos_token_id and config.vocab_size == 448  # 400 padded to 64


def test_lora_run_is_refused_without_merge_and_matches_merged(run, folder, tmp_path, capsys) -> None:
    from launcher.tools.merge import merge_checkpoint

    assert export.main([str(run("lora")), str(tmp_path / "out"), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert "LoRA adapters" in err and "--merge" in err and "--adapter" in err
    merged, _ = merge_checkpoint(run("lora"))
    plain = build_model(load_spec(run("lora") / "spec.yaml").model)
    plain.load_state_dict(merged)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(folder("lora"))(input_ids=tokens).logits
        torch.testing.assert_close(got, plain.eval()(tokens), rtol=1e-5, atol=1e-5)


def test_bad_input_exits_2_with_the_reason(run, tmp_path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export.main([str(empty), str(tmp_path / "a"), "--format", "hf"]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
    assert export.main([str(run("single-gpt")), str(tmp_path / "b"), "--merge"]) == 2
    assert "this run has neither" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert export.main([str(run("single-gpt")), str(taken), "--format", "hf"]) == 2
    assert "already exists" in capsys.readouterr().err and (taken / "keep.txt").is_file()
    assert export.main([str(run("single-gpt")), str(taken), "--format", "hf", "--force"]) == 0
    assert not (taken / "keep.txt").exists() and (taken / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".taken.*"))  # no partial or old folder left behind


@pytest.mark.parametrize("name", ["single-gpt", "gpt2-hf-tokenizer"])
def test_greedy_generation_of_a_run_and_its_folder_is_the_same(run, folder, name: str) -> None:
    completions = []
    for source in (generate.open_source(run(name)), generate.open_source(folder(name))):
        ids = generate.prompt_ids(source, "def main(", chat=False)
        completions.append(generate.generate(source, ids, max_new_tokens=24).ids)
    assert completions[0] == completions[1] and len(completions[0]) > 0


def test_generate_command(run, folder, tmp_path, capsys) -> None:
    long_prompt = "import os\n" * 30  # 300 tokens: more than the 256 positions
    args = ["--prompt", long_prompt, "--max-new-tokens", "4", "--temperature", "0.8", "--top-p", "0.9"]
    assert generate.main([str(folder("single-gpt")), *args, "--seed", "1"]) == 0
    err = capsys.readouterr().err
    assert "the oldest are dropped" in err and "generated " in err and "stopped at" in err
    assert generate.main([str(run("gpt2-hf-tokenizer")), "--prompt", "hi", "--chat"]) == 0
    assert generate.main([str(run("single-gpt")), "--prompt", "hi", "--chat"]) == 2
    assert "has no" in capsys.readouterr().err
    assert generate.main([str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "neither a run directory" in capsys.readouterr().err


def test_the_moe_gpt_has_no_hf_folder_and_is_told_to_export_its_native_format(tmp_path, capsys) -> None:
    """No transformers class computes the built-in GPT's MoE blocks: --format hf exits 2 naming the key and
    `--format pt` before any consolidation, writing nothing; the native state dict exports and loads."""
    moe = ["model=gpt_moe_tiny", "model.n_layer=1", "model.d_model=64", "model.n_head=2", "model.moe.d_ff=32"]
    run_dir = tmp_path / "run"
    assert (
        run_inline(
            [*TINY, "train.max_steps=1", "scheduler.warmup_steps=0", "train.eval_every=null", *moe], run_dir
        )
        == 0
    )
    capsys.readouterr()
    assert export.main([str(run_dir), str(tmp_path / "hf"), "--format", "hf"]) == 2
    said = capsys.readouterr().err
    assert "model.moe.num_experts=8" in said and "--format pt" in said and not (tmp_path / "hf").exists()
    assert export.main([str(run_dir), str(tmp_path / "model.pt")]) == 0
    build_model(load_spec(run_dir / "spec.yaml").model).load_state_dict(torch.load(tmp_path / "model.pt"))
