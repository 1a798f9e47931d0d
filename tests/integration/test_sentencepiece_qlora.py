"""A Llama folder as published (SentencePiece tokenizer.model, config.json, safetensors) goes the whole way
on the first try: QLoRA under FSDP2 on 2 real ranks with the folder's own tokenizer (`tokenizer=auto`),
then `train-export --format hf --merge`, then `train-generate` from the run and from the export.

One short run (3 steps, a 256-wide model: torchao's NF4 shards whole 16384-weight groups) of about
45 s on 2 idle cores, export and generation in-process.
"""

from __future__ import annotations

import math

import pytest

from conftest import losses, run_ranks
from launcher.spec import load_spec
from launcher.tools import export, generate

pytest.importorskip("sentencepiece")
pytest.importorskip("torchao")

from data_assets import text_records, write_jsonl  # noqa: E402
from hf_assets import make_sentencepiece_llama  # noqa: E402

RUN = [
    "quantization=nf4_lora", "quantization.lora.dropout=0", "parallel=fsdp", "launcher=local",
    "launcher.nproc=2", "train.max_steps=3", "train.micro_batch_size=2", "data.seq_len=32",
    "train.eval_every=null", "checkpoint.every=3", "scheduler.warmup_steps=1", "train.log_every=1",
    "log.progress=false", "log.summary_table=false",
]  # fmt: skip


@pytest.mark.slow
def test_qlora_fsdp2_from_a_sentencepiece_llama_trains_exports_and_generates(tmp_path) -> None:
    import sentencepiece
    from transformers import AutoTokenizer

    folder = make_sentencepiece_llama(tmp_path / "llama", hidden_size=256)
    data = write_jsonl(tmp_path / "docs.jsonl", text_records(200))
    run_dir = tmp_path / "run"
    args = ["model=hf", f"model.path={folder}", "data=jsonl", f"data.path={data}", *RUN]
    proc = run_ranks(args, run_dir, nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    spec = load_spec(run_dir / "spec.yaml")
    assert (spec.tokenizer.kind, spec.tokenizer.path, spec.model.vocab_size) == ("hf", str(folder), 512)
    assert spec.tokenizer.add_bos  # as Llama's tokenizer does, so the run and its export see the same prompt
    assert sorted(losses(run_dir)) == [1, 2, 3] and all(math.isfinite(v) for v in losses(run_dir).values())

    out = tmp_path / "export"
    assert export.main([str(run_dir), str(out), "--format", "hf", "--merge"]) == 0
    exported = AutoTokenizer.from_pretrained(out)
    reference = sentencepiece.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    text = "def main(args):\n    return  len(args)"
    assert exported.encode(text, add_special_tokens=False) == reference.encode(text)

    completions = []
    for source in (generate.open_source(run_dir), generate.open_source(out)):
        ids = generate.prompt_ids(source, "def main(", chat=False)
        completions.append(generate.generate(source, ids, max_new_tokens=8))
    assert completions[0] == completions[1] and len(completions[0].ids) > 0
    assert generate.main([str(out), "--prompt", "def main(", "--max-new-tokens", "4"]) == 0
