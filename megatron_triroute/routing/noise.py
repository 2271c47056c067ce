"""Counter-based Gumbel noise keyed on a token's identity, not on its place in a tensor.

A stateful generator (`torch.rand`) gives a token different noise when the batch is split
differently across data-parallel ranks, when a sequence is sharded across tensor-parallel
ranks, or after a resume. Here every noise value is a pure hash of

    (seed, step, layer, axis, global sample index, position, counter)

(the counter enumerates a token's trailing dims, e.g. head x option), so the same token draws the
same noise under any parallel layout, on every rank, and after a restart. The hash is `lowbias32`
(a 32-bit integer finaliser with good avalanche) applied as a chain over the key fields; it runs on
int64 tensors holding 32-bit values, with multiplications split into 16-bit halves so no
intermediate exceeds 2^49 (no signed overflow anywhere).

The same arithmetic runs on Python integers, so the scalar fields that lead the chain (seed,
step, layer, axis) are folded on the host, and the step and layer reach the tensor part only as the
chain's value, a tensor (no Python integer a compiled graph would specialise on). What a field
adds to its link (its chain word) does not depend on the step or layer: the sample's and the
position's are computed once per micro-batch (`token_words`, shared by every layer through
`NoiseKey.words`; one kernel call per field, `chain_words`), the counters' once per count
(`counter_words`). A layer's tensor work is the three links, once for all its axes
(`NoiseKey.gumbel_axes`, over `counter_gumbel`): one kernel call where `triroute_kernels` has one for
the device (C++ on a CPU, Triton on a GPU; the same bits, tested against the chain), the chain itself
otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, TypeVar

import torch

from .device_values import to_device
from .kernel_check import checked_once, first_use_check

_MASK32 = 0xFFFFFFFF
_CHAIN = 0x85EBCA6B

Word = TypeVar("Word", torch.Tensor, int)
"""32-bit values: an int64 tensor or a Python int (the same arithmetic, bit for bit)."""


def _mul32(x: Word, c: int) -> Word:
    """(x * c) mod 2^32 for x in [0, 2^32) without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _mix32(x: Word) -> Word:
    """lowbias32 finaliser on 32-bit values stored in int64 (or a Python int)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _field(key: Word, i: int) -> Word:
    """Key field i mixed alone, with a distinct odd constant so (a, b) and (b, a) differ."""
    return _mix32((key & _MASK32) ^ ((0x9E3779B9 * (i + 1)) & _MASK32))


def _chain_word(field: Word) -> Word:
    """What a mixed field contributes to its link of the chain."""
    return _mul32(field, _CHAIN)


def _link(h: Word, field: Word) -> Word:
    """One link of the chain: the running hash h with the next mixed field folded in."""
    return _mix32(h ^ _chain_word(field))


_COUNTER_WORDS: dict[tuple[int, str], torch.Tensor] = {}


def counter_words(n: int, device: torch.device | str) -> torch.Tensor:
    """(n,) int64: the chain words of the counters 0 .. n-1 (field 6), the same for every token,
    layer and step: computed once per (n, device) and kept."""
    key = (n, str(device))
    if key not in _COUNTER_WORDS:
        _COUNTER_WORDS[key] = _chain_word(_field(torch.arange(n, dtype=torch.int64, device=device), 6))
    return _COUNTER_WORDS[key]


def hash_keys(*keys: torch.Tensor | int) -> torch.Tensor:
    """Hash a broadcastable tuple of integer keys to uniform 32-bit values (int64 tensor).

    Leading Python-int keys are folded on the host (no tensor op); the chain becomes a tensor at
    the first tensor key."""
    if not keys:
        raise ValueError("hash_keys needs at least one key")
    h: torch.Tensor | int | None = None
    for i, key in enumerate(keys):
        if not isinstance(key, int):
            key = torch.as_tensor(key, dtype=torch.int64)
        k = _field(key, i)
        h = k if h is None else _link(h, k)
    return torch.as_tensor(h, dtype=torch.int64)


def uniform_from_keys(*keys: torch.Tensor | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniform samples in the open interval (0, 1), one per broadcast key tuple."""
    return _uniform(hash_keys(*keys)).to(dtype)


def _uniform(h: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1) from 32-bit hashes: the 24 high bits (exact in float32), +0.5
    keeps both ends open."""
    return ((h >> 8).to(torch.float64) + 0.5).div(2.0**24)


def token_words(sample: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain words of a batch's per-token fields, the same at every layer and step: sample
    (B,) global sample indices -> (B,); positions (T,) or (B, T) positions in the full sequence ->
    (1, T) or (B, T)."""
    positions = positions if positions.dim() == 2 else positions.view(1, -1)
    return chain_words(sample.to(torch.int64), 4), chain_words(positions.to(torch.int64), 5)


def chain_words(keys: torch.Tensor, field: int) -> torch.Tensor:
    """The chain words of key field `field` for int64 `keys` (any shape): `chain_words_torch`'s bits,
    in one kernel call where `triroute_kernels` has one for the device (as `counter_uniform`)."""
    kernel = None if torch.compiler.is_compiling() else _words_kernel(keys.device)
    if kernel is not None:
        return kernel(keys, field)
    return chain_words_torch(keys, field)


def chain_words_torch(keys: torch.Tensor, field: int) -> torch.Tensor:
    """`chain_words` as tensor ops (about twenty-four): the definition."""
    return _chain_word(_field(keys, field))


def counter_gumbel(prefix: torch.Tensor, sample_words: torch.Tensor, position_words: torch.Tensor,
                   counters: torch.Tensor) -> torch.Tensor:
    """float64 Gumbel(0, 1) noise (A, B, T, n) from the chain's values after its scalar fields.

    prefix (A,) int64: one chain value per axis (`NoiseKey.prefix`); sample_words (B,) and
    position_words (B or 1, T): `token_words` of the global sample indices and positions;
    counters (n,): `counter_words(n)`, the last link's words for the counters 0 .. n-1. The
    per-token words are computed once and shared by every axis (and, passed in, by every layer).
    Pure tensor code with no Python integer from the step or layer: the function `router.compile`
    compiles.
    """
    return -torch.log(-torch.log(counter_uniform(prefix, sample_words, position_words, counters)))


def counter_uniform(prefix: torch.Tensor, sample_words: torch.Tensor, position_words: torch.Tensor,
                    counters: torch.Tensor) -> torch.Tensor:
    """float64 uniforms (A, B, T, n) in (0, 1): the chain's last three links (sample, position,
    counter) and `_uniform`, from `counter_gumbel`'s arguments. Where a kernel of the same bits runs
    (`triroute_kernels`: C++ on a CPU where built, Triton on a GPU) it computes them in one pass
    instead of about sixty tensor ops; under torch.compile, and elsewhere, the tensor chain does."""
    kernel = None if torch.compiler.is_compiling() else _hash_kernel(prefix.device)
    if kernel is not None:
        return kernel(prefix, sample_words, position_words, counters)
    return counter_uniform_torch(prefix, sample_words, position_words, counters)


def counter_uniform_torch(prefix: torch.Tensor, sample_words: torch.Tensor, position_words: torch.Tensor,
                          counters: torch.Tensor) -> torch.Tensor:
    """`counter_uniform` as tensor ops: the definition."""
    A, B, (_, T), n = prefix.shape[0], sample_words.shape[0], position_words.shape, counters.shape[0]
    h = _mix32(prefix.view(A, 1, 1, 1) ^ sample_words.view(1, B, 1, 1))  # sample's link, (A, B, 1, 1)
    h = _mix32(h ^ position_words.view(1, -1, T, 1))  # position's link, (A, B, T, 1)
    h = _mix32(h ^ counters.view(1, 1, 1, n))  # the counter's link, (A, B, T, n)
    return _uniform(h)


def _hash_kernel(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The kernel of `counter_uniform` on `device` here, or None (`_kernel`)."""
    return _kernel(device, "counter_uniform", _checked_triton_kernel)


def _words_kernel(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The kernel of `chain_words` on `device` here, or None (`_kernel`)."""
    return _kernel(device, "chain_words", _checked_words_kernel)


def _kernel(device: torch.device, op: str, checked: Callable[[torch.device], Callable[..., torch.Tensor] | None]
            ) -> Callable[..., torch.Tensor] | None:
    """`torch.ops.triroute.<op>` on a CPU (the kernels are built once per machine), the Triton
    kernel `checked(device)` gives on a GPU where triton is installed (once per process and
    device), else None."""
    try:
        from triroute_kernels import HAS_TRITON, cpu_ops_available
    except ImportError:  # model code without the kernels: the tensor chain
        return None
    if device.type == "cpu":
        return getattr(torch.ops.triroute, op) if cpu_ops_available() else None
    if device.type == "cuda" and HAS_TRITON:
        return checked_once((op, str(device)), lambda: checked(device))
    return None


def _checked_words_kernel(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """`chain_words_triton` once it has given the chain's bits on a probe on `device` (as
    `_checked_triton_kernel`)."""
    def load():
        from triroute_kernels.triton_noise import chain_words_triton

        return chain_words_triton

    keys = (torch.arange(8, dtype=torch.int64, device=device) * 0x9E3779B9 % 2**33).view(2, 4)  # some past 2^32
    return first_use_check(device, load, chain_words_torch, (keys, 5), "the routing noise's chain words")


def _checked_triton_kernel(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The Triton kernel once it has given the chain's bits on a probe on `device` (one comparison
    per process), else None with a warning: the chain serves instead, the noise never changes."""
    def load():
        from triroute_kernels.triton_noise import counter_uniform_triton

        return counter_uniform_triton

    words = torch.arange(7, dtype=torch.int64, device=device) * 0x9E3779B9 % 2**32
    probe = (words[:2], words[2:5], words.view(1, 7), counter_words(5, device))
    return first_use_check(device, load, counter_uniform_torch, probe, "the routing noise's hash")


@dataclass(frozen=True)
class NoiseKey:
    """The identity of a batch of tokens at one layer and optimizer step.

    `sample_index` (B,) is each sequence's index in the global sample order (the same index
    whatever rank or micro-batch it lands on); `positions` (T,) or (B, T) are positions within
    the full (unsharded) sequence.
    """

    seed: int
    step: int
    layer: int
    sample_index: torch.Tensor
    positions: torch.Tensor
    words: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    """Gives `token_words(sample_index, positions)` when the caller keeps them (every layer of a
    micro-batch shares one computation; called only when noise is drawn); None: computed here."""

    def prefix(self, axis: int) -> int:
        """The hash chain over the scalar fields (seed, step, layer, axis), on the host."""
        h = _field(self.seed, 0)
        for i, key in enumerate((self.step, self.layer, axis), start=1):
            h = _link(h, _field(key, i))
        return h

    def gumbel(self, shape: tuple[int, ...], axis: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Gumbel(0, 1) noise of `shape` = (B, T, *rest); `axis` separates the router axes.

        Trailing dims are enumerated in row-major order, so a (B, T, H, M) request gives
        head h, option m the counter h * M + m.
        """
        return self.gumbel_axes({axis: shape}, dtype)[axis]

    def gumbel_axes(self, shapes: Mapping[int, tuple[int, ...]], dtype: torch.dtype = torch.float32,
                    noise_fn=counter_gumbel) -> dict[int, torch.Tensor]:
        """`gumbel` for several axes {axis: (B, T, *rest)} in one tensor computation (each equal to
        its own `gumbel` call bit for bit: an axis with fewer counters reads a prefix of them).
        `noise_fn` is `counter_gumbel` or a compiled twin of it."""
        axes = list(shapes)
        B, T = shapes[axes[0]][:2]
        if any(tuple(s[:2]) != (B, T) for s in shapes.values()):
            raise ValueError(f"gumbel_axes: every shape must start with the same (B, T); got {dict(shapes)}")
        counts = {a: torch.Size(shapes[a][2:]).numel() for a in axes}
        device = self.sample_index.device
        prefix = to_device([self.prefix(a) for a in axes], torch.int64, device)
        if self.words is not None:
            sample_words, position_words = self.words()
        else:
            pos = self.positions.to(device)
            sample_words, position_words = token_words(self.sample_index.view(B), pos if pos.dim() == 1 else pos.view(B, T))
        g = noise_fn(prefix, sample_words, position_words, counter_words(max(counts.values()), device))  # (A, B, T, n_max)
        g = g.to(dtype)  # every axis in one cast
        return {a: g[i, :, :, : counts[a]].reshape(shapes[a]) for i, a in enumerate(axes)}
