"""The built-in tokenizer (UTF-8 bytes, 256 ids) and the built-in chat layout of tokenizers without a template."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy only where records are encoded: the launching process answers --help without it
    import numpy as np


def default_chat(messages: list[dict[str, Any]], eos: str, *, add_generation_prompt: bool) -> str:
    """The built-in chat layout: `<|role|>` line, content, eos, newline per message."""
    text = "".join(f"<|{m['role']}|>\n{m['content']}{eos}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; the 0 byte ends a document (eos), there is no bos."""

    name = "bytes"
    vocab_size = 256
    bos_id = None
    eos_id = 0
    has_chat_template = False
    adds_bos = False

    def encode(self, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
        """Bytes of each segment, flagged with the segment's trained flag."""
        ids: list[int] = []
        trained: list[bool] = []
        for text, is_trained in segments:
            data = text.encode("utf-8", "surrogateescape")  # bytes read from a file survive unchanged
            ids.extend(data)
            trained.extend([is_trained] * len(data))
        return ids, trained

    def encode_batch(self, documents: list[list[tuple[str, bool]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """`encode` of each document as arrays: the bytes as they are, each byte flagged with its segment's flag."""
        import numpy as np

        encoded = []
        for segments in documents:
            parts = [text.encode("utf-8", "surrogateescape") for text, _ in segments]
            ids = np.frombuffer(b"".join(parts), dtype=np.uint8)
            flags = np.array([is_trained for _, is_trained in segments], dtype=bool)
            encoded.append((ids, np.repeat(flags, [len(part) for part in parts])))
        return encoded

    def render_chat(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools: list[dict] | None = None
    ) -> str:
        """The built-in chat layout, messages ended by the 0 byte (it renders no tools: the data group refuses them)."""
        return default_chat(messages, "\0", add_generation_prompt=add_generation_prompt)

    def special_tokens(self) -> dict[str, str]:
        """Only eos: the 0 byte."""
        return {"eos": "\\x00 (id 0)"}
