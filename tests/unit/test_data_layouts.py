"""The layouts people's data comes in: ShareGPT, content parts, tool calls, data.format=auto, JSON arrays,
dataset_info.json registries, and chat-template errors refused before launch."""

from __future__ import annotations

import json

import pytest
from data_assets import (
    alpaca_records,
    chat_records,
    sharegpt_records,
    text_records,
    with_chat_template,
    write_json,
    write_jsonl,
)

from launcher.components.data.formats import encode_record
from launcher.components.data.layouts import detect
from launcher.components.data.sources import RecordError, records
from launcher.components.data.tokenizer import load_tokenizer
from launcher.components.data.tokens import load_corpus
from launcher.config.data import DataConfig
from launcher.config.tokenizer import TokenizerConfig
from launcher.front import cli, compose
from launcher.front.cli import precheck
from launcher.front.tokenize import prepare_data

TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>\n{{ tools | tojson }}{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% for c in m.get('tool_calls', []) %}<call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}</call>{% endfor %}{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""A template that renders tools and tool calls (as Qwen's or Llama 3.1's do, in fewer words)."""
ALTERNATING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)
"""Mistral-7B-Instruct's template in substance: no system role, and it raises on one."""
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]  # fmt: skip
TOOL_RECORD = {
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+3?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
    ],
}  # fmt: skip
"""OpenAI's layout: content parts, an assistant turn with tool calls (JSON-string arguments), a tool turn."""
SHAREGPT_TOOL_RECORD = {
    "tools": json.dumps(TOOLS),  # LLaMA-Factory keeps the specs as a JSON string
    "conversations": [
        {"from": "human", "value": "What is\n2+3?"},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}})},
        {"from": "observation", "value": "5"},
        {"from": "gpt", "value": "It is 5."},
    ],
}


def _with_template(source, folder, template: str) -> TokenizerConfig:
    """A copy of the test tokenizer whose tokenizer_config.json holds `template`."""
    return TokenizerConfig(kind="hf", path=str(with_chat_template(source, folder, template)))


@pytest.fixture(scope="module")
def plain(hf_tokenizer) -> TokenizerConfig:
    return TokenizerConfig(kind="hf", path=str(hf_tokenizer))


@pytest.fixture(scope="module")
def tools_tok(hf_tokenizer, tmp_path_factory) -> TokenizerConfig:
    return _with_template(hf_tokenizer, tmp_path_factory.mktemp("t") / "tools", TOOL_TEMPLATE)


@pytest.fixture(scope="module")
def mistral_tok(hf_tokenizer, tmp_path_factory) -> TokenizerConfig:
    return _with_template(hf_tokenizer, tmp_path_factory.mktemp("t") / "mistral", ALTERNATING_TEMPLATE)


def _encode(record: dict, tok_cfg: TokenizerConfig, **data) -> tuple[list[int], list[bool]]:
    return encode_record(record, DataConfig(**data), tok_cfg, load_tokenizer(tok_cfg), "r")


def _trained_text(ids: list[int], trained: list[bool], tok_cfg: TokenizerConfig) -> str:
    return load_tokenizer(tok_cfg).tok.decode([i for i, t in zip(ids, trained, strict=True) if t])


def test_sharegpt_encodes_exactly_as_the_same_conversation_in_messages(plain) -> None:
    for shared, chat in zip(sharegpt_records(4), chat_records(4), strict=True):
        assert _encode(shared, plain, format="sharegpt") == _encode(chat, plain, format="chat")
    ids, trained = _encode(sharegpt_records(2)[1], plain, format="sharegpt")
    assert _trained_text(ids, trained, plain) == "1 plus 1 is 2.<|eos|>\nThat is 4.<|eos|>\n"
    everything = _encode(sharegpt_records(2)[1], plain, format="sharegpt", train_on="all")
    assert everything[0] == ids and all(everything[1])


def test_text_parts_are_joined_with_a_newline_and_other_parts_refused(plain) -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": [{"type": "text", "text": "c"}]}]}  # fmt: skip
    joined = {"messages": [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"}]}
    assert _encode(parts, plain, format="chat") == _encode(joined, plain, format="chat")
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    parts["messages"][0]["content"].append(image)
    with pytest.raises(
        RecordError, match=r"r: messages\[0\]\.content\[2\] is a 'image_url' part: .* text-only"
    ):
        _encode(parts, plain, format="chat")


def test_tool_calls_are_trained_and_tool_turns_and_specs_are_not(tools_tok) -> None:
    ids, trained = _encode(TOOL_RECORD, tools_tok, format="chat")
    full = load_tokenizer(tools_tok).tok.decode(ids)
    assert full.startswith('<|bos|><|tools|>\n[{"type": "function"') and "<|tool|>\n5<|eos|>" in full
    assert (
        _trained_text(ids, trained, tools_tok)
        == '<call>add {"a": 2, "b": 3}</call><|eos|>\nIt is 5.<|eos|>\n'
    )
    assert _encode(SHAREGPT_TOOL_RECORD, tools_tok, format="sharegpt") == (ids, trained)


def test_tool_records_are_refused_where_the_template_cannot_render_them(plain) -> None:
    with pytest.raises(RecordError, match="does not render them"):  # its template ignores `tools`
        _encode(TOOL_RECORD, plain, format="chat")
    without_specs = {"messages": TOOL_RECORD["messages"]}
    with pytest.raises(RecordError, match="does not render tool calls"):
        _encode(without_specs, plain, format="chat")
    with pytest.raises(RecordError, match="built-in chat layout renders neither"):
        _encode(TOOL_RECORD, TokenizerConfig(), format="chat")


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (alpaca_records(1)[0], ("instruction", "instruction")),
        (chat_records(1)[0], ("chat", "messages")),
        (sharegpt_records(1)[0], ("sharegpt", "conversations")),
        ({"conversations": [{"role": "user", "content": "x"}]}, ("chat", "conversations")),
        (text_records(1)[0], ("text", "text")),
        ({"input_ids": [1, 2], "labels": [-100, 2]}, ("pretokenized", "input_ids")),
        ({"body": "x"}, None),
    ],
)
def test_auto_detects_each_layout_from_a_record(record, expected) -> None:
    assert detect(record) == expected


def test_auto_says_what_it_chose_and_the_spec_holds_it(tmp_path, plain, capsys) -> None:
    path = write_jsonl(tmp_path / "sg.jsonl", sharegpt_records(20))
    argv = [
        "data=jsonl",
        f"data.path={path}",
        "data.format=auto",
        "tokenizer=hf",
        f"tokenizer.path={plain.path}",
        "train.micro_batch_size=4",  # the dry run checks the data's size too: 20 short records make 13 sequences
    ]
    assert cli.run([*argv, "dry_run=true"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert (
        "data.format=auto: data.format=sharegpt, since 'conversations' holds ShareGPT {from, value} turns"
        in out
    )
    assert "data: jsonl: sharegpt records of" in out
    spec, errors = compose.validate(compose.compose(argv))
    assert errors == [] and (spec.data.format, spec.data.field) == ("sharegpt", "text")
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"body": "x"}])
    (problem,) = precheck(["data=jsonl", f"data.path={odd}", "data.format=auto"])
    assert "data.format=auto recognizes no layout in" in problem.message and "fields: body" in problem.message


def test_data_jsonl_reads_a_json_array(tmp_path) -> None:
    array = write_json(tmp_path / "a" / "alpaca_data.json", alpaca_records(30))
    lines = write_jsonl(tmp_path / "b" / "alpaca_data.jsonl", alpaca_records(30))
    cfg = DataConfig(kind="jsonl", format="instruction", seq_len=16)
    read = list(records(cfg, str(array), tmp_path))
    assert [r for _, _, r in read] == alpaca_records(30) and read[3][1] == f"{array} record 3"
    assert precheck(["data=jsonl", f"data.path={array}", "data.format=instruction"]) == []
    corpus = {
        p: load_corpus(DataConfig(**{**cfg.__dict__, "path": str(p), "cache_dir": str(tmp_path / "c")}), TokenizerConfig())
        for p in (array, lines)
    }  # fmt: skip
    sizes = {p: len(c.train.tokens) + len(c.val.tokens) for p, c in corpus.items()}
    assert sizes[array] == sizes[lines] > 0  # the same records (held-out keys differ: file names differ)
    (tmp_path / "one.json").write_text(json.dumps({"train": alpaca_records(2)}, indent=2))
    (problem,) = precheck(["data=jsonl", f"data.path={tmp_path / 'one.json'}"])
    assert (
        "one.json:1: not valid JSON" in problem.message
        and "is one JSON object (keys: train)" in problem.message
    )


@pytest.mark.parametrize("kind", ["jsonl", "files"])
def test_a_dataset_info_registry_is_named_with_the_files_it_lists(tmp_path, kind) -> None:
    write_json(tmp_path / "alpaca_en_demo.json", alpaca_records(5))
    registry = {
        "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
        "chats": {"file_name": "chats.json", "formatting": "sharegpt"},
        "hub": {"hf_hub_url": "someone/data"},
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(registry, indent=2))
    for path in (tmp_path, tmp_path / "dataset_info.json"):
        (problem,) = precheck([f"data={kind}", f"data.path={path}"])
        assert problem.keys == ("data.path",)
        assert "is a dataset registry (LLaMA-Factory's dataset_info.json)" in problem.message
        assert (
            f"alpaca_en_demo -> {tmp_path / 'alpaca_en_demo.json'} (data.format=instruction)"
            in problem.message
        )
        assert (
            "chats.json (data.format=sharegpt)" in problem.message
            and "hub -> someone/data" in problem.message
        )


def test_a_template_error_is_refused_before_launch_with_exit_2(tmp_path, mistral_tok, capsys) -> None:
    path = write_jsonl(tmp_path / "chat.jsonl", chat_records(3))  # a system turn in every record
    argv = ["data=jsonl", f"data.path={path}", "data.format=chat", "tokenizer=hf",
            f"tokenizer.path={mistral_tok.path}", f"run_dir={tmp_path / 'run'}"]  # fmt: skip
    assert cli.run(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert (
        f"{path}:1: the tokenizer's chat template refused the conversation (TemplateError: Conversation "
        in err
    )
    assert "roles must alternate" in err and "set `data.system_prompt_merge=true`" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
    assert precheck([*argv, "data.system_prompt_merge=true"]) == []


def test_system_prompt_merge_folds_the_system_turn_into_the_first_user_turn(mistral_tok) -> None:
    ids, trained = _encode(chat_records(2)[1], mistral_tok, format="chat", system_prompt_merge=True)
    text = load_tokenizer(mistral_tok).tok.decode(ids)
    assert text == (
        "<|bos|>[INST] You answer briefly.\n\nWhat is 1 plus 1? [/INST]1 plus 1 is 2.<|eos|>"
        "[INST] And times two? [/INST]That is 4.<|eos|>"
    )
    assert _trained_text(ids, trained, mistral_tok) == "1 plus 1 is 2.<|eos|>That is 4.<|eos|>"
    with pytest.raises(RecordError, match="no user turn follows it"):
        _encode({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]},
                mistral_tok, format="chat", system_prompt_merge=True)  # fmt: skip


def test_a_template_error_past_the_sample_stops_tokenization_the_same_way(tmp_path, mistral_tok) -> None:
    merged = [
        {"messages": r["messages"][1:]} for r in chat_records(1010)
    ]  # no system turn: the template takes them
    merged[1005] = chat_records(1)[0]
    path = write_jsonl(tmp_path / "big.jsonl", merged)
    argv = ["data=jsonl", f"data.path={path}", "data.format=chat", "tokenizer=hf",
            f"tokenizer.path={mistral_tok.path}", f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    spec, errors = compose.validate(compose.compose(argv))
    assert errors == []  # the first 1,000 records are fine
    (problem,) = prepare_data(spec)
    assert f"{path}:1006: the tokenizer's chat template refused the conversation" in problem.message
    assert "data.system_prompt_merge=true" in problem.message and "no rank was started" in problem.message


def test_a_sweep_point_with_format_auto_is_unchanged_against_its_own_spec(tmp_path) -> None:
    from launcher.front import rundir, sweep

    path = write_jsonl(tmp_path / "sg.jsonl", sharegpt_records(5))
    argv = ["data=jsonl", f"data.path={path}", "data.format=auto"]
    built = compose.build(compose.compose(argv))
    assert built.errors == () and built.spec.data.format == "sharegpt"
    assert built.config.data.format == "sharegpt"  # the config the spec was built from holds the decision too
    rundir.write(built, tmp_path)
    assert sweep._changed_keys(tmp_path / "spec.yaml", compose.build(compose.compose(argv))) == []
    changed = compose.build(compose.compose([*argv, "data.seq_len=64"]))
    assert sweep._changed_keys(tmp_path / "spec.yaml", changed) == ["data.seq_len"]
