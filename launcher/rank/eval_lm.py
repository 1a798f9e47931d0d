"""The model as trained, as lm-evaluation-harness's `LM`: loglikelihood and generation run in the ranks.

Every rank runs the harness on the same requests; `RankLM` gives request i to data-parallel rank
i % dp_size, so the ranks of one model replica (tensor-parallel peers, pipeline stages) take the same
requests and every forward is collective where the parallel layout needs it; each rank runs the same
number of forwards (a rank short of requests repeats one and drops its result). The scores are then
summed over the ranks that hold them (tensor-parallel rank 0 of the pipeline's last stage, as the
held-out loss counts them), so every rank returns the same answers.

Requests are tokenized as the harness's `--model hf` does (lm_eval.models.huggingface.HFLM): the
context/continuation split of `TemplateLM._encode_pair`, inputs cut to the model's context from the
left, generation's context cut to leave room for `max_gen_toks`, greedy tokens cut at the first `until`
string. Token scores go through the runner's held-out path (`runner.eval_loss`, so a pipeline's stages
take part) with `TokenScores` as the objective; generation through the key-value cache generator
(launcher.components.model.generation), or, under a pipeline, one greedy token per pass of that path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from launcher.components.model import generation
from launcher.components.model.loss import full_logits
from launcher.components.precision import autocast
from launcher.parallel.dims import DistContext
from launcher.parallel.runner import Runner

Request = tuple[Any, list[int], list[int]]
"""A loglikelihood request as the harness hands it on: (its strings, context ids, continuation ids)."""


class TokenScores:
    """An objective for the held-out path that keeps each row's summed log-probability of its labelled tokens
    and whether every one of them is the greedy choice, instead of a loss."""

    counts_processed_tokens = False

    def __init__(self) -> None:
        self.rows: list[tuple[float, bool]] = []

    def loss_sum(
        self, outputs: Any, batch: dict[str, torch.Tensor], *, train: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record the batch's rows; the (zero) loss and count the runner returns are not read."""
        logits = full_logits(outputs)
        if hasattr(logits, "full_tensor"):  # tensor parallel: the vocabulary gathered whole
            logits = logits.full_tensor()
        labels = batch["labels"].to(logits.device)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        wanted = labels != -100
        picked = logprobs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        greedy = (logprobs.argmax(-1) == labels) | ~wanted
        for row in range(labels.shape[0]):
            self.rows.append((float(picked[row][wanted[row]].double().sum()), bool(greedy[row].all())))
        zero = logits.new_zeros((), dtype=torch.float32)
        return zero, zero


@contextlib.contextmanager
def _scoring(runner: Runner, scores: TokenScores) -> Iterator[None]:
    """The runner's objective swapped for `scores` while requests are scored."""
    objective = runner.objective
    runner.objective = scores
    try:
        yield
    finally:
        runner.objective = objective


class RankLM(TemplateLM):
    """lm-evaluation-harness's view of the model being trained (see the module's docstring)."""

    def __init__(
        self, *, model: Any, runner: Runner, dist: DistContext, tokenizer: Any, context: int,
        dtype: torch.dtype, batch_size: int, max_gen_tokens: int, pipelined: bool,
    ) -> None:  # fmt: skip
        super().__init__()
        self.model, self.runner, self.dist, self.tokenizer = model, runner, dist, tokenizer
        self.context, self.dtype, self.batch_size = context, dtype, batch_size
        self.max_gen_tokens, self.pipelined = max_gen_tokens, pipelined
        self.device = dist.device

    # ----- tokens, as HFLM makes them -----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        """The end-of-text id (eos)."""
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What scores a continuation with no context: bos, else eos (as HFLM)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        """The model's context (position count)."""
        return self.context

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of `string`, special tokens as HFLM.tok_encode adds them."""
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and string.startswith(self.tokenizer.decode([self.prefix_token_id])):
            special = {"add_special_tokens": False}
        return list(self.tokenizer.encode(string, **special))

    def tok_decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens dropped (as HFLM decodes completions)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ----- spreading requests over the ranks -----------------------------------------------------------
    def _mine(self, count: int) -> tuple[list[int], int]:
        """This rank's request indices (i % dp_size == dp_rank) and the batches every rank runs."""
        mine = list(range(self.dist.dp_rank, count, self.dist.dp_size))
        most = -(-count // self.dist.dp_size)
        return mine, -(-most // self.batch_size)

    def _gathered(self, count: int, width: int, local: dict[int, list[float]]) -> list[list[float]]:
        """Each request's values, summed over the ranks that report (each request is reported once)."""
        reports = self.dist.dims.counts_data(self.dist.rank)
        values = torch.zeros(count, width, dtype=torch.float64)
        for index, row in local.items() if reports else ():
            values[index] = torch.tensor(row, dtype=torch.float64)
        if self.dist.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(values)
        return values.tolist()

    # ----- loglikelihood -------------------------------------------------------------------------------
    def _score_batch(self, requests: list[Request]) -> list[tuple[float, bool]]:
        """(summed log-probability, greedy) of each request's continuation, one forward for the batch."""
        rows, targets = [], []
        for _, context, continuation in requests:
            whole = (context + continuation)[-(self.context + 1) :]
            rows.append(whole[:-1])
            targets.append((whole[1:], len(continuation)))
        width = max(len(row) for row in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, (row, (shifted, scored)) in enumerate(zip(rows, targets, strict=True)):
            ids[i, : len(row)] = torch.tensor(row)
            labels[i, len(row) - scored : len(row)] = torch.tensor(shifted[-scored:])
        batch = {"input_ids": ids.to(self.device), "labels": labels.to(self.device)}
        scores = TokenScores()
        with _scoring(self.runner, scores), torch.no_grad():
            self.runner.eval_loss(batch, self.dtype)
        return scores.rows

    def _loglikelihood_tokens(self, requests: list[Request], **kwargs: Any) -> list[tuple[float, bool]]:
        """Every request's (log-probability, greedy), its work split over the data-parallel ranks."""
        if not requests:
            return []
        mine, batches = self._mine(len(requests))
        local: dict[int, list[float]] = {}
        for b in range(batches):
            chunk = mine[b * self.batch_size : (b + 1) * self.batch_size]
            rows = self._score_batch([requests[i] for i in chunk] or [requests[0]])
            for index, (logprob, greedy) in zip(chunk, rows, strict=False):
                local[index] = [logprob, 1.0 if greedy else 0.0]
        return [(value, bool(flag > 0.5)) for value, flag in self._gathered(len(requests), 2, local)]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Each text's summed log-probability over disjoint windows of the context (as HFLM)."""
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for window in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            ):  # fmt: skip
                context, continuation = lm_utils.make_disjoint_window(window)
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += logprob
        return totals

    # ----- generation ----------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Each request's greedy text up to its first `until` string, split over the data-parallel ranks."""
        args = [req.args for req in requests]
        if not args:
            return []
        mine, batches = self._mine(len(args))
        local: dict[int, list[int]] = {}
        for b in range(batches):
            chunk = mine[b * self.batch_size : (b + 1) * self.batch_size]
            run = chunk or [0]  # a rank short of requests repeats one: the group takes the same steps
            limits = [int(args[i][1].get("max_gen_toks", self.max_gen_tokens)) for i in run]
            prompts = [
                self.tok_encode(args[i][0])[-max(self.context - limit, 1) :]
                for i, limit in zip(run, limits, strict=True)
            ]
            completions = self._greedy(prompts, max(limits))
            for i, new, limit in zip(chunk, completions, limits, strict=False):
                local[i] = new[:limit]
        merged = self._merged(local)
        return [self._cut(merged[i], args[i][1]) for i in range(len(args))]

    def _merged(self, local: dict[int, Any]) -> dict[int, Any]:
        """Every rank's reported values by request index (the reporting rank of each replica sends its own)."""
        if self.dist.world_size == 1:
            return local
        import torch.distributed as dist

        parts: list[Any] = [None] * self.dist.world_size
        dist.all_gather_object(parts, local if self.dist.dims.counts_data(self.dist.rank) else {})
        return {index: value for part in parts for index, value in part.items()}

    def _cut(self, ids: list[int], kwargs: dict[str, Any]) -> str:
        """The completion's text up to the first of its `until` strings."""
        text = self.tok_decode(ids)
        until = kwargs.get("until") or []
        for term in [until] if isinstance(until, str) else until:
            if term:
                text = text.split(term)[0]
        return text

    def _greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy new ids of each prompt (stopping at eos), the whole group taking the same steps."""
        if self.pipelined:
            return self._greedy_by_passes(prompts, max_new_tokens)
        eos = self.eot_token_id  # a folder's tokenizer may declare none: then only max_gen_toks stops
        with autocast(self.dtype, self.device.type):
            done = generation.generate(
                self.model, prompts, max_new_tokens=max_new_tokens, stop_ids=[] if eos is None else [eos],
                context=self.context, vocab_limit=len(self.tokenizer), pad_id=eos or 0,
            )  # fmt: skip
        return [completion.ids for completion in done]

    def _greedy_by_passes(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy decoding through the runner's held-out path, the whole text again for each new token."""
        texts = [list(prompt) for prompt in prompts]
        new: list[list[int]] = [[] for _ in prompts]
        ended = [False] * len(prompts)
        for _ in range(max_new_tokens):
            tokens = self._next_tokens(texts)
            for row, token in enumerate(tokens):
                if not ended[row]:
                    ended[row] = token == self.eot_token_id
                    if not ended[row]:
                        new[row].append(token)
                texts[row].append(token)
            if self.dist.all_true(all(ended)):
                break
        return new

    def _next_tokens(self, texts: list[list[int]]) -> list[int]:
        """Each row's most likely next token (right-padded rows), agreed on by every rank of the replica."""
        rows = [text[-self.context :] for text in texts]
        width = max(len(row) for row in rows)
        ids = torch.full((len(rows), width), self.eot_token_id or 0, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row)
        picks = _LastTokens([len(row) for row in rows], len(self.tokenizer))
        batch = {"input_ids": ids.to(self.device), "labels": torch.zeros_like(ids).to(self.device)}
        with _scoring(self.runner, picks), torch.no_grad():
            self.runner.eval_loss(batch, self.dtype)
        if self.dist.world_size == 1:
            return picks.tokens
        import torch.distributed as dist

        parts: list[Any] = [None] * self.dist.world_size
        reports = self.dist.dims.counts_data(self.dist.rank)
        dist.all_gather_object(parts, (self.dist.dp_rank, picks.tokens) if reports else None)
        for part in parts:  # this replica's reporting rank holds the tokens
            if part is not None and part[0] == self.dist.dp_rank:
                return part[1]
        raise RuntimeError("no rank of this replica holds the last pipeline stage's tokens")


class _LastTokens(TokenScores):
    """An objective for the held-out path that keeps each row's greedy token after its last real position."""

    def __init__(self, lengths: list[int], vocab_limit: int) -> None:
        super().__init__()
        self.lengths, self.vocab_limit = lengths, vocab_limit
        self.tokens: list[int] = []

    def loss_sum(
        self, outputs: Any, batch: dict[str, torch.Tensor], *, train: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Record each row's argmax at its last real position."""
        logits = full_logits(outputs)
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        for row, length in enumerate(self.lengths):
            self.tokens.append(int(logits[row, length - 1, : self.vocab_limit].float().argmax()))
        zero = logits.new_zeros((), dtype=torch.float32)
        return zero, zero
