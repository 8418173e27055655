"""Attention masks for splash attention: which (query, key) pairs may attend.

The names and constructors are those of JAX's ``ops.tpu`` splash attention masks. A mask is
a lazy 2-d (or, ``MultiHeadMask``, 3-d) boolean array: ``mask[q_slice, kv_slice]`` gives the
dense piece. Beyond JAX's interface each mask answers two questions the kernel asks:

* ``block_kinds(block_q, block_kv)``: an int8 ``[q_blocks, kv_blocks]`` array saying of each
  block whether it is ``EMPTY`` (nothing attends: skipped, no copy, no compute), ``PARTIAL``
  (masked in the kernel) or ``FULL`` (computed with no mask arithmetic). Structured masks
  answer from their formulas (no dense evaluation, so a 128k x 128k causal mask costs
  nothing); the others are evaluated block row by block row.
* ``kernel_function``: a function of broadcast ``(query ids, key ids)`` int32 arrays, written
  with operators only, that the kernel evaluates on its partial blocks instead of loading
  them from memory; None where the mask must be materialized (a ``NumpyMask``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2


def _kinds_from_bounds(any_visible: np.ndarray, all_visible: np.ndarray) -> np.ndarray:
    return np.where(all_visible, FULL, np.where(any_visible, PARTIAL, EMPTY)).astype(np.int8)


def _block_edges(n: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """First and last index of each block of an axis of ``n`` (a multiple of ``block``)."""
    first = np.arange(0, n, block, dtype=np.int64)
    return first, first + block - 1


def _check_blocks(shape, block_q: int, block_kv: int) -> None:
    q_len, kv_len = shape[-2:]
    if q_len % block_q or kv_len % block_kv:
        raise ValueError(
            f"splash attention: the mask's shape {tuple(shape)} must be divisible by the blocks "
            f"(block_q={block_q}, block_kv={block_kv})"
        )


def _slice_bounds(idx, size: int) -> tuple[int, int]:
    if not isinstance(idx, slice) or idx.step not in (None, 1):
        raise NotImplementedError(f"splash attention masks take unit-step slices, got {idx!r}")
    start, stop, _ = idx.indices(size)
    return start, max(start, stop)


def _block_bounds(mask, idx) -> tuple[int, int, int, int]:
    """``(q0, q1, k0, k1)``: the rows and columns ``mask[idx]`` takes (``idx`` two unit-step slices)."""
    if not isinstance(idx, tuple) or len(idx) != 2:
        raise NotImplementedError(f"{type(mask).__name__} takes [q_slice, kv_slice], got {idx!r}")
    return (*_slice_bounds(idx[0], mask.shape[0]), *_slice_bounds(idx[1], mask.shape[1]))


class Mask:
    """The base of the splash attention masks: a lazy boolean ``[q_seq_len, kv_seq_len]`` array."""

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def __getitem__(self, idx) -> np.ndarray:
        raise NotImplementedError

    def __bool__(self) -> bool:
        raise NotImplementedError(
            "A splash attention Mask has no truth value: combine masks with & and |, not `and`/`or`"
        )

    def _combine(self, other: Mask, how: type) -> Mask:
        if not isinstance(other, Mask):
            raise TypeError(f"splash attention masks combine with other masks, got {type(other).__name__}")
        if self.shape != other.shape:
            raise ValueError(f"Invalid shape for other: {other.shape}, expected: {self.shape}")
        return how(self, other)

    def __or__(self, other: Mask) -> Mask:
        return self._combine(other, LogicalOr)

    def __and__(self, other: Mask) -> Mask:
        return self._combine(other, LogicalAnd)

    # The kernel's questions (see the module docstring).

    @property
    def kernel_function(self) -> Callable[..., Any] | None:
        return None

    def block_kinds(self, block_q: int, block_kv: int) -> np.ndarray:
        """EMPTY / PARTIAL / FULL of each ``(block_q, block_kv)`` block, from the dense mask."""
        _check_blocks(self.shape, block_q, block_kv)
        q_len, kv_len = self.shape
        nq, nkv = q_len // block_q, kv_len // block_kv
        kinds = np.empty((nq, nkv), np.int8)
        for i in range(nq):
            rows = np.asarray(self[i * block_q : (i + 1) * block_q, :], dtype=bool)
            tiles = rows.reshape(block_q, nkv, block_kv)
            kinds[i] = _kinds_from_bounds(tiles.any(axis=(0, 2)), tiles.all(axis=(0, 2)))
        return kinds


def make_causal_mask(shape: tuple[int, int], offset: int = 0) -> np.ndarray:
    """A dense causal mask: query ``i`` sees key ``j`` when ``i + offset >= j``.

    Args:
      shape: ``(q_seq_len, kv_seq_len)``.
      offset: where the queries start among the keys; positive shifts the visible triangle up
        (more keys visible), negative down (the first ``-offset`` rows see nothing).
    """
    q, kv = np.ogrid[: shape[0], : shape[1]]
    return q + offset >= kv


def make_local_attention_mask(
    shape: tuple[int, int], window_size: tuple[int | None, int | None], *, offset: int = 0
) -> np.ndarray:
    """A dense local (sliding window) mask: query ``i`` sees keys ``i + offset - left`` to
    ``i + offset + right`` (a side of None: unbounded)."""
    q, kv = np.ogrid[: shape[0], : shape[1]]
    keep = np.ones(shape, dtype=np.bool_)
    left, right = window_size
    if left is not None:
        keep &= kv >= q + offset - left
    if right is not None:
        keep &= kv <= q + offset + right
    return keep


def make_chunk_attention_mask(shape: tuple[int, int], chunk_size: int) -> np.ndarray:
    """A dense chunked causal mask: causal within chunks of ``chunk_size`` tokens, nothing across."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    q, kv = np.ogrid[: shape[0], : shape[1]]
    return (q // chunk_size == kv // chunk_size) & (q >= kv)


def make_random_mask(shape: tuple[int, int], sparsity: float, seed: int) -> np.ndarray:
    """A dense random mask, each entry visible with probability ``1 - sparsity``."""
    np.random.seed(seed)
    return np.random.binomial(n=1, p=1.0 - sparsity, size=shape).astype(np.bool_)


@dataclasses.dataclass
class _Combined(Mask):
    """Two masks of one shape combined entry by entry with ``_op``."""

    left: Mask
    right: Mask
    _op = staticmethod(operator.or_)  # not a field: each subclass names its own
    _kinds = staticmethod(np.maximum)  # the kinds of a block from the two masks' kinds

    def __post_init__(self):
        if self.left.shape != self.right.shape:
            raise ValueError(
                f"{type(self).__name__}: shapes differ: {self.left.shape} and {self.right.shape}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return self.left.shape

    def __getitem__(self, idx) -> np.ndarray:
        return self._op(self.left[idx], self.right[idx])

    def __hash__(self):
        return hash((type(self), self.left, self.right))

    def block_kinds(self, block_q, block_kv):
        a, b = self.left.block_kinds(block_q, block_kv), self.right.block_kinds(block_q, block_kv)
        # ``_kinds`` of the two; where both are partial, look at the dense mask.
        return _refine(self, self._kinds(a, b), (a == PARTIAL) & (b == PARTIAL), block_q, block_kv)

    @property
    def kernel_function(self):
        f, g, op = self.left.kernel_function, self.right.kernel_function, self._op
        if f is None or g is None:
            return None
        return lambda q, kv: op(f(q, kv), g(q, kv))


class LogicalOr(_Combined):
    """Visible where either mask is."""

    _op = staticmethod(operator.or_)
    # FULL if either is; EMPTY only if both are (two partial blocks may fill each other)
    _kinds = staticmethod(np.maximum)


class LogicalAnd(_Combined):
    """Visible where both masks are."""

    _op = staticmethod(operator.and_)
    # EMPTY if either is; FULL only if both are (two partial blocks may not overlap at all)
    _kinds = staticmethod(np.minimum)


def _refine(mask: Mask, kinds: np.ndarray, unsure: np.ndarray, block_q: int, block_kv: int) -> np.ndarray:
    """``kinds`` with the ``unsure`` blocks classified from the dense mask."""
    for i, j in zip(*np.nonzero(unsure)):
        piece = np.asarray(
            mask[i * block_q : (i + 1) * block_q, j * block_kv : (j + 1) * block_kv], dtype=bool
        )
        kinds[i, j] = FULL if piece.all() else (PARTIAL if piece.any() else EMPTY)
    return kinds


@dataclasses.dataclass
class MultiHeadMask(Mask):
    """One mask per head: shape ``(heads, q_seq_len, kv_seq_len)``."""

    masks: Sequence[Mask]

    def __post_init__(self):
        if not self.masks:
            raise ValueError("MultiHeadMask needs at least one mask, got none")
        if not all(isinstance(m, Mask) for m in self.masks):
            bad = next(type(m).__name__ for m in self.masks if not isinstance(m, Mask))
            raise ValueError(f"MultiHeadMask: masks should be of type Mask, got a {bad}")
        if any(isinstance(m, MultiHeadMask) for m in self.masks):
            raise ValueError("MultiHeadMask: nesting MultiHeadMasks is not supported")
        shape = self.masks[0].shape
        for m in self.masks[1:]:
            if m.shape != shape:
                raise ValueError(f"MultiHeadMask: Unexpected mask shape, got: {m.shape}, expected: {shape}")

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.masks), *self.masks[0].shape)

    def __getitem__(self, idx) -> np.ndarray:
        if not isinstance(idx, tuple) or len(idx) != 3:
            raise NotImplementedError(f"MultiHeadMask takes [head, q_slice, kv_slice], got {idx!r}")
        head, rest = idx[0], idx[1:]
        if isinstance(head, (int, np.integer)):
            return self.masks[cast(int, head)][rest]
        return np.stack([m[rest] for m in cast(Sequence[Mask], self.masks[head])])  # head: a slice

    def __eq__(self, other: object):
        if not isinstance(other, MultiHeadMask):
            return NotImplemented
        return len(self.masks) == len(other.masks) and all(a == b for a, b in zip(self.masks, other.masks))

    def __hash__(self):
        return hash((type(self), *self.masks))


def _fill_slice(inp_slice: slice, size: int) -> slice:
    start, stop = _slice_bounds(inp_slice, size)
    return slice(start, stop)


class _ComputableMask(Mask):
    """A mask given by ``mask_function(q_ids, kv_ids)`` (operators only, so that it runs on
    NumPy arrays here and on the kernel's int32 vectors alike): the kernel computes its partial
    blocks instead of loading them.

    Attributes:
      q_sequence: the position of each query row (``arange(q_seq_len)``; a permutation of it
        reorders the queries, e.g. striped for load balance, and the mask is then materialized).
      mask_function: the mask as a function of broadcast query and key positions.
    """

    _shape: tuple[int, int]
    q_sequence: np.ndarray
    mask_function: Callable[..., Any]

    def __init__(self, shape: tuple[int, int], mask_function: Callable[..., Any], shard_count: int = 1):
        if len(shape) != 2:
            raise ValueError(f"{type(self).__name__}: shape must be (q_seq_len, kv_seq_len), got {shape}")
        self._shape = cast(tuple[int, int], tuple(int(n) for n in shape))
        self.mask_function = mask_function
        if shard_count < 1 or self._shape[0] % shard_count:
            raise ValueError(
                f"{type(self).__name__}: shard_count={shard_count} must divide q_seq_len={self._shape[0]}"
            )
        self.q_sequence = np.arange(self._shape[0], dtype=np.int32)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def __getitem__(self, idx) -> np.ndarray:
        q0, q1, k0, k1 = _block_bounds(self, idx)
        rows = self.q_sequence[q0:q1, None]
        cols = np.arange(k0, k1, dtype=np.int32)[None, :]
        return np.broadcast_to(self.mask_function(rows, cols), (q1 - q0, k1 - k0))

    def _in_order(self) -> bool:
        return np.array_equal(self.q_sequence, np.arange(self._shape[0]))

    @property
    def kernel_function(self):
        return self.mask_function if self._in_order() else None

    def _key(self) -> tuple:
        return ()

    def __eq__(self, other: object):
        if type(other) is not type(self):
            return NotImplemented
        return (
            self._shape == other._shape
            and self._key() == other._key()
            and np.array_equal(self.q_sequence, other.q_sequence)
        )

    def __hash__(self):
        return hash((type(self), self._shape, self._key(), self.q_sequence.tobytes()))

    def _bounds_kinds(self, block_q, block_kv):
        """None, or (any_visible, all_visible) of each block from the formula."""
        return None

    def block_kinds(self, block_q: int, block_kv: int) -> np.ndarray:
        _check_blocks(self._shape, block_q, block_kv)
        if self._in_order():
            found = self._bounds_kinds(block_q, block_kv)
            if found is not None:
                return _kinds_from_bounds(*found)
        return super().block_kinds(block_q, block_kv)

    def _edges(self, block_q, block_kv):
        r0, r1 = _block_edges(self._shape[0], block_q)
        c0, c1 = _block_edges(self._shape[1], block_kv)
        return r0[:, None], r1[:, None], c0[None, :], c1[None, :]


class CausalMask(_ComputableMask):
    """Causal: query ``i`` sees key ``j`` when ``i + offset >= j``.

    Attributes:
      offset: where the queries start among the keys; positive shifts the visible triangle up,
        negative down (then the first ``-offset`` rows see nothing: the kernels give them zeros).
    """

    offset: int

    def __init__(self, shape: tuple[int, int], offset: int = 0, shard_count: int = 1):
        self.offset = int(offset)
        shift = self.offset
        super().__init__(
            shape, (lambda q, kv: q + shift >= kv) if shift else (lambda q, kv: q >= kv), shard_count
        )

    def _key(self):
        return (self.offset,)

    def _bounds_kinds(self, block_q, block_kv):
        r0, r1, c0, c1 = self._edges(block_q, block_kv)
        return r1 + self.offset >= c0, r0 + self.offset >= c1


class ChunkedCausalMask(_ComputableMask):
    """Causal within chunks of ``chunk_size`` tokens, nothing across chunks (Llama 4's local layers).

    Attributes:
      chunk_size: the tokens of a chunk.
    """

    chunk_size: int

    def __init__(self, shape: tuple[int, int], chunk_size: int, shard_count: int = 1):
        if chunk_size <= 0:
            raise ValueError(f"ChunkedCausalMask: chunk_size must be positive, got {chunk_size}")
        self.chunk_size = size = int(chunk_size)
        if size & (size - 1) == 0:  # a power of two: the chunk start by a bit mask (no vector division)
            start = ~(size - 1)

            def function(q, kv):
                return (kv <= q) & (kv >= (q & start))
        else:

            def function(q, kv):
                return (kv <= q) & (kv >= q - q % size)

        super().__init__(shape, function, shard_count)

    def _key(self):
        return (self.chunk_size,)

    def _bounds_kinds(self, block_q, block_kv):
        r0, r1, c0, c1 = self._edges(block_q, block_kv)
        size = self.chunk_size
        # Query q sees keys [q - q % size, q]; over the block's rows these intervals join into
        # [r0 - r0 % size, r1] (each starts where the last ended or earlier).
        some = (r0 - r0 % size <= c1) & (r1 >= c0)
        every = (r1 - r1 % size <= c0) & (c1 <= r0)
        return some, every

    @property
    def kernel_function(self):
        if self.chunk_size & (self.chunk_size - 1):
            return None  # a vector remainder by a non-power of two: materialized instead
        return super().kernel_function


class LocalMask(_ComputableMask):
    """A sliding window: query ``i`` sees keys ``i + offset - left`` to ``i + offset + right``.

    Attributes:
      window_size: ``(left, right)``, each None for no bound on that side.
      offset: where the queries start among the keys.
    """

    window_size: tuple[int | None, int | None]
    offset: int

    def __init__(
        self,
        shape: tuple[int, int],
        window_size: tuple[int | None, int | None],
        offset: int,
        shard_count: int = 1,
    ):
        if len(window_size) != 2:
            raise ValueError(f"LocalMask: window_size must be (left, right), got {window_size!r}")
        self.window_size = cast(
            tuple[int | None, int | None], tuple(None if w is None else int(w) for w in window_size)
        )
        self.offset = int(offset)
        left, right = self.window_size
        shift = self.offset

        def function(q, kv):
            keep = None
            if left is not None:
                keep = kv >= q + (shift - left)
            if right is not None:
                upper = kv <= q + (shift + right)
                keep = upper if keep is None else keep & upper
            return (q >= 0) | (kv >= 0) if keep is None else keep  # no bound: all visible

        super().__init__(shape, function, shard_count)

    def _key(self):
        return (self.window_size, self.offset)

    def _bounds_kinds(self, block_q, block_kv):
        r0, r1, c0, c1 = self._edges(block_q, block_kv)
        left, right = self.window_size
        some, every = np.ones((1, 1), bool), np.ones((1, 1), bool)
        if left is not None:
            some = some & (c1 >= r0 + self.offset - left)
            every = every & (c0 >= r1 + self.offset - left)
        if right is not None:
            some = some & (c0 <= r1 + self.offset + right)
            every = every & (c1 <= r0 + self.offset + right)
        # Query q sees keys [q + offset - left, q + offset + right]; over the block's rows these
        # intervals join into one (for a window of width >= 0; a narrower one is only partial).
        shape = (r0.shape[0], c0.shape[1])
        return np.broadcast_to(some, shape), np.broadcast_to(every, shape)


@dataclasses.dataclass
class NumpyMask(Mask):
    """A mask held as a dense boolean NumPy array (its partial blocks are materialized)."""

    array: np.ndarray

    def __post_init__(self):
        if not isinstance(self.array, np.ndarray) or self.array.ndim != 2:
            raise ValueError(
                f"NumpyMask: Expected a 2-dim NumPy array, got {getattr(self.array, 'shape', self.array)}"
            )
        if self.array.dtype != np.bool_:
            raise ValueError(f"NumpyMask: Mask must be a boolean array, got {self.array.dtype}")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.array.shape

    def __getitem__(self, idx) -> np.ndarray:
        return self.array[idx]

    def __eq__(self, other: object):
        if not isinstance(other, NumpyMask):
            return NotImplemented
        return self.array.shape == other.array.shape and np.array_equal(self.array, other.array)

    def __hash__(self):
        return hash((type(self), self.array.shape, self.array.tobytes()))

    def block_kinds(self, block_q, block_kv):
        _check_blocks(self.shape, block_q, block_kv)
        (q_len, kv_len) = self.shape
        tiles = self.array.reshape(q_len // block_q, block_q, kv_len // block_kv, block_kv)
        return _kinds_from_bounds(tiles.any(axis=(1, 3)), tiles.all(axis=(1, 3)))


@dataclasses.dataclass(frozen=True)
class FullMask(Mask):
    """Everything visible."""

    _shape: tuple[int, int]

    def __post_init__(self):
        if not isinstance(self._shape, tuple) or len(self._shape) != 2:
            raise ValueError(
                f"FullMask: Unsupported shape type: {self._shape!r} (want (q_seq_len, kv_seq_len))"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def __getitem__(self, idx) -> np.ndarray:
        q0, q1, k0, k1 = _block_bounds(self, idx)
        return np.ones((q1 - q0, k1 - k0), dtype=np.bool_)

    @property
    def kernel_function(self):
        return lambda q, kv: (q >= 0) | (kv >= 0)

    def block_kinds(self, block_q, block_kv):
        _check_blocks(self._shape, block_q, block_kv)
        return np.full((self._shape[0] // block_q, self._shape[1] // block_kv), FULL, np.int8)
