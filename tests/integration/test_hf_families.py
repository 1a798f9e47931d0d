"""Current families in the real loop: Gemma-2 (softcaps, local/global layers) trains packed on a CPU; paths a
family lacks and MoE families the launcher does not train are refused before launch, naming the fix."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import TINY, losses, run_cli, run_clis, run_inline

transformers = pytest.importorskip("transformers")

RUN = [*TINY, "train.eval_every=null", "checkpoint.every=null", "train.max_steps=6", "data.seq_len=64"]


def _save(config, out):
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def _gemma2(out):
    config = transformers.Gemma2Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=16, max_position_embeddings=128,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, use_cache=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return _save(config, out)


@pytest.mark.parametrize("attention", ["auto", "varlen"])
def test_gemma2_trains_packed_on_a_cpu(tmp_path, attention: str) -> None:
    """Gemma-2 has no SDPA in transformers: the dense path runs eager, varlen its own softcapped softmax."""
    folder = _gemma2(tmp_path / "gemma2")
    run_dir = tmp_path / "run"
    code = run_inline(["model=hf", f"model.path={folder}", f"model.attention={attention}", *RUN], run_dir)
    assert code == 0
    curve = losses(run_dir)
    assert curve[6] < curve[1]
    assert json.loads((run_dir / "summary.json").read_text())["exit_reason"] == "completed"


def test_paths_a_family_lacks_are_refused_before_launch(tmp_path) -> None:
    gpt2 = _save(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=256), tmp_path / "gpt2")
    neox = _save(
        transformers.GPTNeoXConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                   vocab_size=256),
        tmp_path / "neox",
    )  # fmt: skip
    flex, varlen = run_clis(
        [
            ["model=hf", f"model.path={gpt2}", "model.attention=flex", *RUN],
            ["model=hf", f"model.path={neox}", "model.attention=varlen", *RUN],
        ],
        tmp_path,
    )
    assert flex.returncode == 2, flex.stderr[-2000:]
    said = " ".join(flex.stderr.split())  # the message is wrapped to the terminal's width
    assert "no FlexAttention for gpt2" in said and "model.attention=auto" in said
    assert varlen.returncode == 2, varlen.stderr[-2000:]
    said = " ".join(varlen.stderr.split())
    assert "'gpt_neox' is not among them" in said and "Traceback" not in said


def test_a_moe_family_without_expert_support_is_refused(tmp_path) -> None:
    """MoE families outside hf_experts.MOE_FAMILIES are refused before launch, naming the ones that load."""
    config = transformers.PhimoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    folder = _save(config, tmp_path / "moe")
    done = run_cli(["model=hf", f"model.path={folder}", *RUN], cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    said = " ".join(done.stderr.split())  # the message is wrapped to the terminal's width
    assert "Mixture-of-Experts model (model_type 'phimoe', 4 experts)" in said and "mixtral" in said
    assert "gate_up_proj" not in said and "Traceback" not in said
