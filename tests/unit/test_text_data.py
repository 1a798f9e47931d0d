"""Real text in: a Hugging Face tokenizer, every record format, prompt masking, packing with document boundaries, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from data_assets import alpaca_records, chat_records, text_records, write_json, write_jsonl, write_parquet

from launcher.components.data.formats import (
    INSTRUCTION_TEMPLATE,
    INSTRUCTION_TEMPLATE_NO_INPUT,
    encode_record,
)
from launcher.components.data.sequences import PackedSequences
from launcher.components.data.tokenizer import load_tokenizer
from launcher.components.data.tokens import START, TRAINED, load_corpus
from launcher.components.model.loss import model_inputs
from launcher.config.data import DataConfig
from launcher.config.model import ModelConfig
from launcher.config.tokenizer import TokenizerConfig
from launcher.front import compose
from launcher.front.cli import precheck
from launcher.front.tokenize import prepare_data


@pytest.fixture(scope="module")
def tok_cfg(hf_tokenizer) -> TokenizerConfig:
    return TokenizerConfig(kind="hf", path=str(hf_tokenizer))


def test_instruction_prompt_tokens_get_label_minus_100(tok_cfg) -> None:
    tokenizer = load_tokenizer(tok_cfg)
    cfg = DataConfig(kind="files", format="instruction")
    for record in alpaca_records(6):
        ids, trained = encode_record(record, cfg, tok_cfg, tokenizer, "r")
        template = INSTRUCTION_TEMPLATE if record["input"] else INSTRUCTION_TEMPLATE_NO_INPUT
        prompt = tokenizer.tok(template.format(**record), add_special_tokens=False)["input_ids"]
        assert trained.count(False) == len(prompt) and ids[: len(prompt)] == prompt
        assert ids[-1] == tokenizer.eos_id and all(trained[len(prompt) :])  # response and its eos train
        everything = encode_record(
            record, DataConfig(format="instruction", train_on="all"), tok_cfg, tokenizer, "r"
        )
        assert all(everything[1]) and everything[0] == ids


def test_chat_trains_assistant_turns_only(tok_cfg) -> None:
    tokenizer = load_tokenizer(tok_cfg)
    record = chat_records(2)[1]  # system, user, assistant, user, assistant
    ids, trained = encode_record(record, DataConfig(format="chat"), tok_cfg, tokenizer, "r")
    answer = tokenizer.tok.decode([i for i, t in zip(ids, trained, strict=True) if t])
    assert answer == "1 plus 1 is 2.<|eos|>\nThat is 4.<|eos|>\n"
    full = tokenizer.tok.decode(ids)
    assert full.startswith("<|bos|><|system|>\nYou answer briefly.<|eos|>") and "What is 1 plus 1?" in full


def test_chat_without_a_template_uses_the_built_in_layout(tmp_path) -> None:
    from data_assets import make_tokenizer

    cfg = TokenizerConfig(kind="hf", path=str(make_tokenizer(tmp_path / "plain", chat_template=False)))
    tokenizer = load_tokenizer(cfg)
    ids, trained = encode_record(chat_records(1)[0], DataConfig(format="chat"), cfg, tokenizer, "r")
    assert tokenizer.tok.decode(ids).startswith("<|system|>\nYou answer briefly.<|eos|>\n<|user|>")
    assert (
        tokenizer.tok.decode([i for i, t in zip(ids, trained, strict=True) if t]) == "0 plus 0 is 0.<|eos|>\n"
    )


def test_corpus_masks_prompts_and_document_starts(tok_cfg, tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpaca.jsonl", alpaca_records(60))
    cfg = DataConfig(
        kind="files", path=str(path), format="instruction", seq_len=64, cache_dir=str(tmp_path / "c")
    )
    corpus = load_corpus(cfg, tok_cfg)
    store = corpus.train
    batch = PackedSequences(store, 64).batch(torch.arange(len(PackedSequences(store, 64))))
    flags = torch.stack([store.flags[i * 64 : i * 64 + 65] for i in range(len(batch["labels"]))])
    masked = (flags[:, 1:] & TRAINED == 0) | (flags[:, 1:] & START != 0)
    assert torch.equal(batch["labels"] == -100, masked)
    restart = batch["position_ids"][:, 1:] == 0
    assert torch.equal(restart, flags[:, 1:-1] & START != 0)  # positions restart exactly at documents


@pytest.mark.parametrize("kind", ["gpt", "llama", "gpt2"])
def test_a_packed_row_of_two_documents_gives_their_losses_alone(kind: str) -> None:
    from launcher.components.model.build import build_model

    torch.manual_seed(0)
    common = {"n_layer": 2, "n_head": 2, "d_model": 32, "max_seq_len": 64, "vocab_size": 97}
    cfg = (
        ModelConfig(**common) if kind == "gpt" else ModelConfig(kind="hf", hf_config=kind, d_ff=64, **common)
    )
    model = build_model(cfg).eval()
    first, second = torch.randint(0, 97, (1, 11)), torch.randint(0, 97, (1, 17))
    packed = torch.cat([first, second], dim=1)
    positions = torch.cat([torch.arange(11), torch.arange(17)]).unsqueeze(0)
    with torch.no_grad():
        together = model(**model_inputs({"input_ids": packed, "position_ids": positions}))
        alone = torch.cat([model(first), model(second)], dim=1)

    def token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")

    for start, ids in ((0, first), (11, second)):
        span = slice(start, start + ids.shape[1])
        torch.testing.assert_close(
            token_losses(together[:, span], ids), token_losses(alone[:, span], ids), rtol=0, atol=1e-5
        )
    with torch.no_grad():  # without position ids the second document would see the first
        assert not torch.allclose(model(packed)[:, 11:], alone[:, 11:], atol=1e-3)


def test_gpt_vocabulary_comes_from_the_tokenizer_padded(tok_cfg) -> None:
    spec, errors = compose.validate(compose.compose(["tokenizer=hf", f"tokenizer.path={tok_cfg.path}"]))
    assert errors == [] and spec.model.vocab_size == 448  # 400 ids, padded to a multiple of 64
    assert compose.validate(compose.compose([]))[0].model.vocab_size == 256
    small = {
        e.keys: e.message
        for e in precheck(["tokenizer=hf", f"tokenizer.path={tok_cfg.path}", "model.vocab_size=300"])
    }
    assert (
        "produces 400 token ids but model.vocab_size is 300" in small[("model.vocab_size", "tokenizer.kind")]
    )


def _bad(tmp_path, name: str, content) -> str:
    path = tmp_path / name
    if isinstance(content, list):
        write_parquet(path, content) if name.endswith(".parquet") else write_jsonl(path, content)
    else:
        path.write_text(content)
    return str(path)


BAD_RECORDS = [  # (file name, content, extra overrides, phrase)
    (
        "alpaca.jsonl",
        alpaca_records(3),
        [],
        "field 'text' is missing (the record's fields: input, instruction, output). The record has the alpaca layout: add data.format=instruction",
    ),
    ("chat.jsonl", chat_records(3), ["data.field=messages"], "field 'messages' is list, not a string"),
    (
        "sharegpt.jsonl",
        [{"conversations": [{"from": "human", "value": "hi"}]}],
        ["data.format=chat", "data.field=conversations"],
        "conversations[0] has role None; known roles: system, user, assistant, tool. The turns have ShareGPT's "
        "from/value layout: set data.format=sharegpt.",
    ),
    (
        "notalist.jsonl",
        [{"messages": "hello"}],
        ["data.format=chat"],
        "'messages' is str, not a list of messages",
    ),
    (
        "content.parquet",
        [{"messages": [{"role": "user", "content": 3}]}],
        ["data.format=chat"],
        "messages[0].content is int, not a string",
    ),
    (
        "role.jsonl",
        [{"messages": [{"role": "narrator", "content": "x"}]}],
        ["data.format=chat"],
        "has role 'narrator'",
    ),
    (
        "ids.jsonl",
        [{"input_ids": [1, 2, 9999]}],
        ["data.format=pretokenized"],
        "token id 9999 in 'input_ids' lies outside the tokenizer's 400 ids",
    ),
    ("empty.jsonl", "", [], "holds no records (an empty file)"),
    ("broken.jsonl", '{"text": "fine"}\n{"text": \n', [], "broken.jsonl:2: not valid JSON"),
]


@pytest.mark.parametrize(("name", "content", "extra", "phrase"), BAD_RECORDS, ids=[b[0] for b in BAD_RECORDS])
def test_bad_records_are_named_before_launch(tmp_path, tok_cfg, name, content, extra, phrase) -> None:
    path = _bad(tmp_path, name, content)
    argv = ["data=files", f"data.path={path}", "tokenizer=hf", f"tokenizer.path={tok_cfg.path}", *extra]
    messages = " | ".join(str(e) for e in precheck(argv))
    assert phrase in messages and path in messages, messages


def test_bad_paths_and_tokenizer_folders_are_refused(tmp_path, tok_cfg) -> None:
    def errors(*argv: str) -> dict:
        return {e.keys: e.message for e in precheck(list(argv))}

    assert "no file matches" in errors("data=files", f"data.path={tmp_path}/*.jsonl")[("data.path",)]
    (tmp_path / "empty_dir").mkdir()
    assert (
        "holds no files ending in"
        in errors("data=files", f"data.path={tmp_path / 'empty_dir'}")[("data.path",)]
    )
    (tmp_path / "no_tokenizer").mkdir()
    (tmp_path / "no_tokenizer" / "README.md").write_text("nothing here")
    message = errors("tokenizer=hf", f"tokenizer.path={tmp_path / 'no_tokenizer'}")[("tokenizer.path",)]
    assert "holds no tokenizer files" in message and "save_pretrained" in message
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    hf = errors(
        "model=hf_llama_tiny",
        f"model.hf_config={tmp_path / 'model'}",
        "tokenizer=hf",
        f"tokenizer.path={tok_cfg.path}",
    )
    assert "embeds 300" in hf[("model.hf_config", "tokenizer.kind")]


def test_cli_refuses_bad_data_with_exit_2_and_makes_no_run_directory(tmp_path) -> None:
    path = write_jsonl(tmp_path / "alpaca.jsonl", alpaca_records(3))
    run = subprocess.run(
        [sys.executable, "-m", "launcher", "data=files", f"data.path={path}", f"run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2 and "add data.format=instruction" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "run").exists()


def test_a_bad_record_after_the_sample_stops_tokenization_with_its_index(tmp_path, tok_cfg) -> None:
    records = text_records(1500)
    records[1200] = {"text": 12}
    path = write_jsonl(tmp_path / "big.jsonl", records)
    argv = ["data=files", f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}"]
    spec, errors = compose.validate(compose.compose(argv))
    assert errors == []  # the first 1,000 records are fine
    (problem,) = prepare_data(spec)
    assert "big.jsonl record 1200: field 'text' is int, not a string" in problem.message
    assert "no rank was started" in problem.message
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if p.name != "datasets"]
    assert leftovers == []  # no half-made corpus is kept (`datasets` keeps its own Arrow cache there)


def test_text_files_of_every_kind_load(tmp_path, tok_cfg) -> None:
    write_parquet(tmp_path / "d" / "a.parquet", text_records(40))
    write_json(tmp_path / "d" / "b.json", text_records(30))
    (tmp_path / "d" / "c.txt").write_text("plain text file\n" * 50)
    (tmp_path / "d" / "e.csv").write_text("text,id\n" + "".join(f"row {i} text,{i}\n" for i in range(20)))
    cfg = DataConfig(kind="files", path=str(tmp_path / "d"), seq_len=16, cache_dir=str(tmp_path / "c"))
    corpus = load_corpus(cfg, tok_cfg)
    stream = torch.cat([corpus.train.tokens, corpus.val.tokens])  # 91 documents: the held-out tail cuts one
    assert int((stream == load_tokenizer(tok_cfg).eos_id).sum()) == 40 + 30 + 1 + 20
    streamed = load_corpus(DataConfig(**{**cfg.__dict__, "streaming": True}), tok_cfg)
    assert torch.equal(streamed.train.tokens, corpus.train.tokens)


def test_resize_embeddings_grows_a_local_model_to_the_tokenizer(tmp_path, tok_cfg) -> None:
    from launcher.components.model.build import build_model

    folder = tmp_path / "model"
    folder.mkdir()
    config = {"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
              "max_position_embeddings": 64}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    argv = ["model=hf_llama_tiny", f"model.hf_config={folder}", "tokenizer=hf", f"tokenizer.path={tok_cfg.path}",
            "data.seq_len=32", "model.resize_embeddings=true"]  # fmt: skip
    spec, errors = compose.validate(compose.compose(argv))
    assert errors == [] and spec.model.vocab_size == 448
    model = build_model(spec.model)
    assert model.hf.get_input_embeddings().num_embeddings == 448
    assert model(torch.randint(0, 400, (1, 8))).shape == (1, 8, 448)


def test_a_chat_template_that_is_not_prefix_stable_is_refused_unless_training_on_all(tmp_path) -> None:
    from data_assets import make_tokenizer

    from launcher.components.data.sources import RecordError

    folder = make_tokenizer(tmp_path / "counting")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{{ messages | length }} turns\n{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    cfg = TokenizerConfig(kind="hf", path=str(folder))
    tokenizer = load_tokenizer(cfg)
    with pytest.raises(RecordError, match="does not render a conversation's first turns as the beginning"):
        encode_record(chat_records(1)[0], DataConfig(format="chat"), cfg, tokenizer, "r")
    ids, trained = encode_record(
        chat_records(1)[0], DataConfig(format="chat", train_on="all"), cfg, tokenizer, "r"
    )
    assert all(trained) and tokenizer.tok.decode(ids).startswith("3 turns")


@pytest.mark.parametrize(
    ("content", "phrase"),
    [
        (b"one\ncaf\xe9 au lait\n", "is not UTF-8 text: byte 7 (line 2) is 0xe9 (invalid continuation byte)"),
        (
            b"one\ntwo\n\x7fELF\x00\x01\x02",
            "holds a NUL byte at byte 12 (line 3): it is a binary file, not text",
        ),
    ],
)
@pytest.mark.parametrize("tokenizer", ["bytes", "hf"])
def test_text_that_is_not_utf8_is_refused_naming_the_byte_and_line(
    tmp_path, tok_cfg, content, phrase, tokenizer
) -> None:
    """Refused before launch, whether the corpus goes through the cache (hf) or is read for its size (bytes)."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(content + b"plain text\n" * 3000)
    extra = ["tokenizer=hf", f"tokenizer.path={tok_cfg.path}"] if tokenizer == "hf" else []
    spec, errors = compose.validate(compose.compose(["data=text", f"data.path={path}", *extra]))
    assert errors == []  # the layout checks read the first records only
    messages = " | ".join(str(e) for e in prepare_data(spec))
    assert f"{path} {phrase}" in messages and "no rank was started" in messages, messages


def test_a_character_that_data_max_bytes_cuts_in_two_is_not_an_error(tmp_path) -> None:
    from launcher.components.data.sources import RecordError, read_text

    path = tmp_path / "t.txt"
    path.write_bytes("aé".encode() * 10)  # é is two bytes
    assert read_text(path, 5, strict=True) == "aéa"
    path.write_bytes(b"a\xe9" * 10)
    with pytest.raises(RecordError, match="byte 1 "):
        read_text(path, 5, strict=True)


def test_the_cli_refuses_a_binary_text_file_without_a_run_directory(tmp_path) -> None:
    (tmp_path / "data.txt").write_bytes(b"text\n\x00\x01\x02" * 1000)
    run = subprocess.run(
        [sys.executable, "-m", "launcher", "data=text", "data.path=data.txt", f"run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2 and "data.txt holds a NUL byte at byte 5 (line 2)" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "run").exists()
