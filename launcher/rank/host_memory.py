"""On CPU ranks, malloc keeps the memory a step frees for the next step instead of giving it back.

A training step allocates and frees the same tensors every step, and on the CPU they come from the C
library's malloc. glibc hands the free top of its heap back to the kernel past its trim threshold
(twice its mmap threshold, which rises to at most 32 MiB), and maps every block above the mmap
threshold on its own: the next step faults those pages in again, zero-filled by the kernel (a
gpt_tiny step on 2 cores took 1,500-4,000 page faults; a gpt_125m step on one thread 141,000, about
550 MB). For the loop, blocks up to 32 MiB come from the heap, the heap is not trimmed, and it grows
in steps of 256 MiB, which also lets torch's 64-byte-aligned blocks find room where freed ones were
(glibc 2.36's aligned allocation skips a freed block of exactly its size): gpt_tiny 3 faults a step,
gpt_125m 40,000 and 13% faster, the resident size held at a step's peak. Larger blocks are still
mapped each time: mallopt takes no mmap threshold above 32 MiB, and turning mmap off makes aligned
allocations spread the heap (nine times a 64 MiB block's size, measured). On exit the thresholds are
put where glibc's dynamic rule takes them in a torch process and the free heap is returned.
`memory.cpu_malloc_reuse=false` leaves malloc alone; so does a C library other than glibc.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator
from typing import Any

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
"""mallopt's parameters (glibc malloc.h)."""
KEEP = {M_MMAP_THRESHOLD: 32 * 2**20, M_TRIM_THRESHOLD: 2**31 - 1, M_TOP_PAD: 256 * 2**20}
"""In the loop: blocks up to 32 MiB (glibc's ceiling) from the heap; no trimming short of 2 GiB free
(mallopt takes an int); the heap grown 256 MiB beyond each request."""
AFTER = {M_MMAP_THRESHOLD: 32 * 2**20, M_TRIM_THRESHOLD: 64 * 2**20, M_TOP_PAD: 128 * 2**10}
"""After it: the thresholds glibc's dynamic rule reaches in a torch process (any mallopt call ends
that rule, so they are set as numbers) and the default pad."""


@functools.cache
def _glibc() -> Any:
    """glibc, or None where the C library is another one (musl, macOS): loaded once."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # only glibc has it  # noqa: B018
        return libc
    except (OSError, AttributeError):
        return None


def _set(libc: Any, params: dict[int, int]) -> bool:
    return all(libc.mallopt(key, value) == 1 for key, value in params.items())


def release_free_heap() -> None:
    """Give the free pages of malloc's heap back to the kernel (glibc's malloc_trim; elsewhere nothing)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def reuse_freed_memory(enabled: bool) -> Iterator[bool]:
    """Keep freed blocks in the heap for the loop (when `enabled` and the C library is glibc); yields
    whether it does. On exit: the thresholds in AFTER, and the free heap returned to the kernel."""
    libc = _glibc() if enabled else None
    active = libc is not None and _set(libc, KEEP)
    try:
        yield active
    finally:
        if active:
            _set(libc, AFTER)
            release_free_heap()
