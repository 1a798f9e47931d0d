"""Per-turn training flags, reasoning traces and legacy function calls, read from the token cache's masks;
and data.format=auto that never guesses: preference pairs refused for SFT, ambiguous records refused."""

from __future__ import annotations

import json

import pytest
from data_assets import with_chat_template, write_jsonl
from preference_assets import pair_records

from conftest import run_inline
from launcher.components.data.formats import encode_record
from launcher.components.data.layouts import detect, matches
from launcher.components.data.sources import RecordError
from launcher.components.data.tokenizer import load_tokenizer
from launcher.components.data.tokens import START, TRAINED, load_corpus
from launcher.config.data import DataConfig
from launcher.config.tokenizer import TokenizerConfig
from launcher.front import cli
from launcher.front.cli import precheck

QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query_index=messages|length - 1, found=false) %}"
    "{%- for m in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if not ns.found and m.role == 'user' %}{%- set ns.found = true %}{%- set ns.last_query_index = index %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{%- set content = m.content %}{%- set r = '' %}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none %}{%- set r = m.reasoning_content %}"
    "{%- elif '</think>' in content %}{%- set r = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or r) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen3's chat template in substance: reasoning_content (or a <think> block in the content) rendered as a
<think> block on the assistant turns after the last user turn, the other turns without it."""
STRIPPING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'].split('</think>')[-1] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""DeepSeek-R1's habit: the template keeps only what follows </think>."""
TOOL_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% for c in m.get('tool_calls', []) %}<call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}</call>{% endfor %}{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
USER = {"role": "user", "content": "What is 2+2?"}
LLAMAFACTORY_PAIR = {
    "conversations": [{"from": "human", "value": "What is 2+2?"}],
    "chosen": {"from": "gpt", "value": "It is 4."},
    "rejected": {"from": "gpt", "value": "It is 5."},
}
"""LLaMA-Factory's dpo_en_demo layout."""


def _with_template(source, folder, template: str) -> TokenizerConfig:
    """A copy of the test tokenizer whose tokenizer_config.json holds `template`."""
    return TokenizerConfig(kind="hf", path=str(with_chat_template(source, folder, template)))


@pytest.fixture(scope="module")
def plain(hf_tokenizer) -> TokenizerConfig:
    return TokenizerConfig(kind="hf", path=str(hf_tokenizer))


@pytest.fixture(scope="module")
def qwen3(hf_tokenizer, tmp_path_factory) -> TokenizerConfig:
    return _with_template(hf_tokenizer, tmp_path_factory.mktemp("t") / "qwen3", QWEN3_TEMPLATE)


def _cached(records: list[dict], tok_cfg: TokenizerConfig, tmp_path, **data) -> list[tuple[str, str]]:
    """(whole text, trained text) of each record as the token cache holds it (every record on the train side)."""
    path = write_jsonl(tmp_path / "train.jsonl", records)
    val = write_jsonl(tmp_path / "val.jsonl", records[:1])
    cfg = DataConfig(kind="jsonl", path=str(path), val_path=str(val), cache_dir=str(tmp_path / "c"), **data)
    store = load_corpus(cfg, tok_cfg).train
    tokens, flags = store.tokens.tolist(), store.flags.tolist()
    starts = [i for i, f in enumerate(flags) if f & START] + [len(tokens)]
    decode = load_tokenizer(tok_cfg).tok.decode
    return [
        (
            decode(tokens[a:b]),
            decode([t for t, f in zip(tokens[a:b], flags[a:b], strict=True) if f & TRAINED]),
        )
        for a, b in zip(starts, starts[1:], strict=False)
    ]


def _trained(record: dict, tok_cfg: TokenizerConfig, **data) -> str:
    tokenizer = load_tokenizer(tok_cfg)
    ids, trained = encode_record(record, DataConfig(**{"format": "chat", **data}), tok_cfg, tokenizer, "r")
    return tokenizer.tok.decode([i for i, t in zip(ids, trained, strict=True) if t])


def test_per_turn_flags_reach_the_token_cache(plain, tmp_path) -> None:
    weighted = {"messages": [USER, {"role": "assistant", "content": "It is 5.", "weight": 0},
                             {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "It is 4.", "weight": 1}]}  # fmt: skip
    axolotl = {"messages": [{"role": "system", "content": "Be brief."}, {**USER, "train": True},
                            {"role": "assistant", "content": "It is 4.", "train": False}]}  # fmt: skip
    detail = {"messages": [USER, {"role": "assistant", "content": "Sure. The answer is 4.", "train_detail": [
        {"begin_offset": 0, "end_offset": 4, "train": False}, {"begin_offset": 5, "end_offset": 21, "train": True}]}]}  # fmt: skip
    parts = {"messages": [USER, {"role": "assistant", "content": [
        {"type": "text", "text": "Let me see.", "train": False}, {"type": "text", "text": "It is 4."}]}]}  # fmt: skip
    cached = _cached([weighted, axolotl, detail, parts], plain, tmp_path, format="chat")
    assert [trained for _, trained in cached] == [
        "It is 4.<|eos|>\n",  # OpenAI's weight 0 leaves the first answer out
        "<|user|>\nWhat is 2+2?<|eos|>\n",  # axolotl's train: true / false per turn
        " The answer is 4.<|eos|>\n",  # train_detail: characters 0..4 untrained, 5..21 trained
        "\nIt is 4.<|eos|>\n",  # a part with train: false
    ]
    assert "It is 5." in cached[0][0] and "Let me see.\nIt is 4." in cached[3][0]  # in the text, not trained
    merged = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": "Hi.", "train": True}, {"type": "text", "text": "2+2?"}]}, {"role": "assistant", "content": "4"}]}  # fmt: skip
    assert (
        _trained(merged, plain, system_prompt_merge=True) == "Hi.4<|eos|>\n"
    )  # the span moved with the merge
    everything = _trained(weighted, plain, train_on="all")
    assert "It is 5." not in everything and "Again?" in everything  # an explicit flag wins over train_on=all
    with pytest.raises(RecordError, match=r"weight is 0\.5; OpenAI's layout takes 0"):
        _trained({"messages": [USER, {"role": "assistant", "content": "x", "weight": 0.5}]}, plain)
    with pytest.raises(RecordError, match=r"train_detail\[0\] spans characters 0\.\.99, outside"):
        _trained({"messages": [USER, {"role": "assistant", "content": "x",
                                      "train_detail": [{"begin_offset": 0, "end_offset": 99, "train": True}]}]}, plain)  # fmt: skip


def test_reasoning_is_rendered_before_the_content_where_the_template_has_no_notion_of_it(
    plain, tmp_path
) -> None:
    answer = {"role": "assistant", "content": "It is 4.", "reasoning_content": "2+2 makes 4."}
    layouts = [
        {"messages": [USER, answer]},
        {"messages": [USER, {"role": "assistant", "content": "<think>\n2+2 makes 4.\n</think>\nIt is 4."}]},
        {"messages": [USER, {"role": "assistant", "content": "It is 4.", "reasoning": "2+2 makes 4."}]},
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "reasoning", "reasoning": "2+2 makes 4."},
                        {"type": "text", "text": "It is 4."},
                    ],
                },
            ]
        },  # fmt: skip
    ]
    for choice, trained in (("auto", "<think>\n2+2 makes 4.\n</think>\nIt is 4.<|eos|>\n"),
                            ("false", "It is 4.<|eos|>\n")):  # fmt: skip
        cached = _cached(layouts, plain, tmp_path / choice, format="chat", train_reasoning=choice)
        assert [t for _, t in cached] == [trained] * 4
        assert all("<|assistant|>\n<think>\n2+2 makes 4.\n</think>\nIt is 4." in text for text, _ in cached)
    with pytest.raises(RecordError, match="only assistant turns reason"):
        _trained({"messages": [{**USER, "reasoning_content": "hm"}, answer]}, plain)
    terse = {
        "conversations": [
            {"from": "human", "value": "2+2?"},
            {"from": "gpt", "value": "<think>sum</think>\n\n4"},
        ]
    }
    tokenizer = load_tokenizer(plain)
    ids, trained = encode_record(
        terse, DataConfig(format="sharegpt", train_reasoning="false"), plain, tokenizer, "r"
    )
    assert "<|assistant|>\n<think>sum</think>\n\n4<|eos|>" in tokenizer.tok.decode(ids)  # written as it was
    assert tokenizer.tok.decode([i for i, t in zip(ids, trained, strict=True) if t]) == "4<|eos|>\n"


def test_a_qwen3_template_renders_reasoning_content_and_masks_follow_the_choice(qwen3, tmp_path) -> None:
    record = {
        "messages": [USER, {"role": "assistant", "content": "It is 4.", "reasoning_content": "2+2 makes 4."}]
    }
    text = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n2+2 makes 4.\n</think>\n\nIt is 4.<|im_end|>\n"  # fmt: skip
    trained = {}
    for choice in ("auto", "true", "false"):
        ((whole, trained[choice]),) = _cached(
            [record], qwen3, tmp_path / choice, format="chat", train_reasoning=choice
        )
        assert whole == text  # the template's own <think> block, not ours
    assert trained["auto"] == trained["true"] == "<think>\n2+2 makes 4.\n</think>\n\nIt is 4.<|im_end|>\n"
    assert (
        trained["false"] == "<think>\n\n</think>\n\nIt is 4.<|im_end|>\n"
    )  # the trace untrained, the tags as without it
    two_turns = {"messages": [*record["messages"], {"role": "user", "content": "Sure?"},
                              {"role": "assistant", "content": "Yes.", "reasoning_content": "Checked."}]}  # fmt: skip
    with pytest.raises(RecordError, match="Templates like Qwen3's render an assistant turn's reasoning"):
        _trained(two_turns, qwen3)
    assert "Checked." in _trained(two_turns, qwen3, train_on="all")


def test_train_reasoning_true_refuses_a_template_that_drops_the_trace(hf_tokenizer, tmp_path) -> None:
    stripping = _with_template(hf_tokenizer, tmp_path / "r1", STRIPPING_TEMPLATE)
    record = {
        "messages": [USER, {"role": "assistant", "content": "It is 4.", "reasoning_content": "2+2 makes 4."}]
    }
    assert _trained(record, stripping) == "\nIt is 4.<|eos|>\n"  # auto: what the template renders
    with pytest.raises(RecordError, match="data.train_reasoning=true trains every reasoning trace"):
        _trained(record, stripping, train_reasoning="true")
    problems = precheck(["data=jsonl", f"data.path={write_jsonl(tmp_path / 't.jsonl', [{'text': 'x'}])}",
                         "data.format=text", "data.train_reasoning=false"])  # fmt: skip
    assert ("data.train_reasoning", "data.format") in [p.keys for p in problems]


def test_openai_legacy_function_call_turns_render_as_tool_calls(hf_tokenizer, tmp_path) -> None:
    tools = _with_template(hf_tokenizer, tmp_path / "tools", TOOL_TEMPLATE)
    legacy = {"messages": [USER, {"role": "assistant", "content": None,
                                  "function_call": {"name": "add", "arguments": '{"a": 2, "b": 2}'}},
                           {"role": "function", "name": "add", "content": "4"}, {"role": "assistant", "content": "It is 4."}]}  # fmt: skip
    current = {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
        {"role": "tool", "name": "add", "content": "4"}, {"role": "assistant", "content": "It is 4."}]}  # fmt: skip
    tokenizer = load_tokenizer(tools)
    cfg = DataConfig(format="chat")
    assert encode_record(legacy, cfg, tools, tokenizer, "r") == encode_record(
        current, cfg, tools, tokenizer, "r"
    )
    assert _trained(legacy, tools) == '<call>add {"a": 2, "b": 2}</call><|eos|>\nIt is 4.<|eos|>\n'


def test_auto_never_guesses_pairs_are_refused_for_sft_and_ambiguity_names_the_choices(
    tmp_path, plain, capsys
) -> None:
    assert detect(LLAMAFACTORY_PAIR) == ("preference", "chosen")
    assert detect({"prompt": "a", "completion": "b", "label": False}) == ("kto", "completion")
    pairs = write_jsonl(tmp_path / "dpo_en_demo.jsonl", [LLAMAFACTORY_PAIR] * 40)
    argv = ["data=jsonl", f"data.path={pairs}", "data.format=auto", f"run_dir={tmp_path / 'run'}"]
    assert cli.run(argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "data.format=auto found preference data in" in err and "objective=dpo (or simpo, orpo)" in err
    assert not (tmp_path / "run").exists()
    for fmt in ("chat", "sharegpt"):  # no hint at a format that would drop the responses
        with pytest.raises(RecordError, match="objective=dpo") as refusal:
            _trained(LLAMAFACTORY_PAIR, plain, format=fmt)
        assert "data.format=sharegpt" not in str(refusal.value).replace(f"data.format={fmt} would", "")
    answer = {"role": "assistant", "content": "It is 4."}
    ultrafeedback = {"prompt": "What is 2+2?", "chosen": [USER, answer], "messages": [USER, answer],
                     "rejected": [USER, {"role": "assistant", "content": "It is 5."}]}  # fmt: skip
    assert (
        _trained(ultrafeedback, plain) == "It is 4.<|eos|>\n"
    )  # its whole `messages` fine-tuned on, as asked
    feedback = write_jsonl(tmp_path / "ultrafeedback.jsonl", [ultrafeedback] * 40)
    (problem,) = precheck(["data=jsonl", f"data.path={feedback}", "data.format=auto"])
    assert (
        "objective=dpo" in problem.message
        and "also hold, set data.format=chat ('messages'" in problem.message
    )
    both = {"messages": [USER], "text": "What is 2+2?"}
    assert len(matches(both)) == 2 and detect(both) is None
    (problem,) = precheck(["data=jsonl", f"data.path={write_jsonl(tmp_path / 'both.jsonl', [both])}", "data.format=auto"])  # fmt: skip
    assert "data.format=auto will not guess" in problem.message
    assert "data.format=chat (" in problem.message and "or data.format=text (" in problem.message


def test_a_llamafactory_pair_file_trains_under_dpo_with_format_auto(tmp_path) -> None:
    records = [
        {"system": "Add.", "conversations": [{"from": "human", "value": r["prompt"]}],
         "chosen": {"from": "gpt", "value": r["chosen"]}, "rejected": {"from": "gpt", "value": r["rejected"]}}
        for r in pair_records(24)
    ]  # fmt: skip
    path = write_jsonl(tmp_path / "dpo.jsonl", records)
    tokenizer = load_tokenizer(TokenizerConfig())
    ids, flags = encode_record(records[0], DataConfig(format="preference"), TokenizerConfig(), tokenizer, "r")
    text = bytes(ids).decode()
    assert text.count("<|system|>\nAdd.") == 2  # both sides, each whole with the record's system string
    assert records[0]["chosen"]["value"] in text and records[0]["rejected"]["value"] in text
    as_list = {**records[0], "chosen": [records[0]["chosen"]], "rejected": [records[0]["rejected"]]}
    assert encode_record(as_list, DataConfig(format="preference"), TokenizerConfig(), tokenizer, "r") == (
        ids,
        flags,
    )
    run_dir = tmp_path / "run"
    argv = ["objective=dpo", "data=jsonl", "data.format=auto", f"data.path={path}", "data.seq_len=160",  # the rendered prompt (system, template) takes ~60 bytes: a shorter seq_len leaves no response token
            "model=gpt_tiny", "train.max_steps=2", "train.micro_batch_size=4", "log.progress=false",
            "log.summary_table=false", f"run_dir={run_dir}"]  # fmt: skip
    assert run_inline(argv, run_dir) == 0
    assert "format: preference" in (run_dir / "spec.yaml").read_text()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/margins" in s for s in steps)
