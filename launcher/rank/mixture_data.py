"""A mixture's data on a rank: each source's corpus from the cache, the weighted interleave, per-source held-out sets."""

from __future__ import annotations

from launcher.components.batch_split import BatchSplit
from launcher.components.data import mixture
from launcher.components.data.interleave import HeldOut, MixtureStream
from launcher.components.data.sequences import PackedSequences
from launcher.components.data.tokens import build_cache, load_corpus, uses_cache
from launcher.parallel.dims import DistContext
from launcher.spec import RunSpec


def build_mixture(
    spec: RunSpec, dist: DistContext, batch: BatchSplit
) -> tuple[MixtureStream, tuple[HeldOut, ...]]:
    """The training stream and each source's held-out sequences.

    Rank 0 tokenizes a source the launching process did not (each into its own cache entry) while
    the others wait; every rank then memory-maps them.
    """
    d, tok = spec.data, spec.tokenizer
    sources = mixture.resolve(d)
    if any(uses_cache(source.data, tok) for source in sources):
        if dist.is_main:
            for source in sources:
                if uses_cache(source.data, tok):
                    build_cache(source.data, tok, check_contents=False)  # the launcher checked them
        dist.barrier()
    corpora = {source.name: load_corpus(source.data, tok) for source in sources}
    train = {
        name: PackedSequences(corpus.train, d.seq_len, document_mask=d.document_mask)
        for name, corpus in corpora.items()
    }
    stream = MixtureStream(
        train,
        {source.name: source.weight for source in sources},
        micro_batch_size=batch.micro_batch_size,
        seed=spec.train.seed,
        rank=dist.dp_rank,
        world_size=dist.dp_size,
    )
    held_out = tuple(
        HeldOut(
            name=source.name,
            sequences=PackedSequences(corpora[source.name].val, d.seq_len, document_mask=d.document_mask),
            weight=source.weight,
        )
        for source in sources
    )
    return stream, held_out
