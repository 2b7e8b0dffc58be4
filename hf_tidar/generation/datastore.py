"""A retrieval draft source: continuations of the context's last n-gram in a corpus of the model's own text.

Prompt lookup only finds n-grams the context already holds. A datastore (REST, He et al. 2023) holds a
corpus: for the shipped SmolLM2 adapter, the base model's own greedy answers to thousands of training
prompts, so the phrases the model tends to write ("Here is a ...", ``def __init__(self``) are there before
the context repeats them. Drafts are verified like any other, so the output never depends on the corpus.

The corpus is one flat token array with ``-1`` between documents. For each n-gram order ``n`` the index is
the sorted packed keys of every position's ``n`` preceding tokens, so a lookup is one binary search; the
draft is the most frequent continuation among the matches, chosen token by token (a greedy walk of the trie
REST builds). A proposal carries the order that matched and how many matches agreed on its first token:
together they predict how many of its drafts will be accepted, which the decoder weighs against the other
sources (:meth:`DraftDatastore.expected_accepted`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SEPARATOR = -1
"""Between documents of the corpus: no n-gram and no continuation crosses it."""

MAX_MATCHES = 256
"""Matches a proposal is chosen from (the last ones in the corpus): bounds a lookup's cost on common n-grams."""

AGREEMENT_EDGES = (0.5, 0.8)
"""Buckets of the share of matches that continue with the proposal's first token."""


@dataclass(frozen=True)
class Retrieval:
    """One datastore proposal: its tokens, the n-gram order that matched, the matches' agreement on the
    first token, and the accepted drafts expected of it (calibrated on the corpus, see :meth:`calibrate`)."""

    tokens: list[int]
    order: int
    agreement: float
    expected: float


class DraftDatastore:
    """Continuations of every n-gram (``n = 1..max_ngram``) of a token corpus.

    Build one with :meth:`from_sequences` (then :meth:`calibrate` it), keep it with :meth:`save` and
    :meth:`load`; ``generate(strategy="tidar", draft_source="best" | "prompt_lookup", datastore=...)``
    drafts from it.
    """

    def __init__(self, tokens: np.ndarray, calibration: np.ndarray | None = None):
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.ndim != 1 or not len(tokens):
            raise ValueError("a datastore needs a non-empty 1-D token array")
        if tokens.min() < SEPARATOR:
            raise ValueError(f"token ids must be >= 0 (and {SEPARATOR} between documents)")
        self.tokens = tokens
        self.max_token = int(tokens.max())  # read at every generate call (the vocabulary check)
        self.bits = max(1, self.max_token.bit_length())
        self.max_ngram = min(4, 64 // self.bits)
        self.calibration = calibration
        self._keys, self._positions = zip(*(self._index(n) for n in range(1, self.max_ngram + 1)), strict=True)

    @classmethod
    def from_sequences(cls, sequences: Iterable[Sequence[int]]) -> DraftDatastore:
        """A datastore of these token sequences (documents), uncalibrated."""
        flat: list[int] = []
        for sequence in sequences:
            flat.extend(int(token) for token in sequence)
            flat.append(SEPARATOR)
        return cls(np.array(flat, dtype=np.int64))

    def documents(self) -> list[list[int]]:
        """The corpus as the documents it was built from (the runs between separators)."""
        cuts = np.flatnonzero(self.tokens == SEPARATOR)
        starts = np.concatenate([[0], cuts + 1])
        ends = np.concatenate([cuts, [len(self.tokens)]])
        return [self.tokens[start:end].tolist() for start, end in zip(starts, ends, strict=True) if end > start]

    @property
    def num_tokens(self) -> int:
        """Tokens in the corpus (separators not counted)."""
        return int((self.tokens != SEPARATOR).sum())

    def _pack(self, ngram: Sequence[int]) -> np.uint64:
        key = 0
        for token in ngram:
            key = (key << self.bits) | int(token)
        return np.uint64(key)

    def _index(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Sorted keys of the ``n`` tokens before every position that continues an n-gram, and those positions."""
        tokens = self.tokens
        valid = tokens != SEPARATOR
        keys = np.zeros(len(tokens), dtype=np.uint64)
        for back in range(n, 0, -1):  # oldest token first: the same order as _pack
            before = np.full(len(tokens), SEPARATOR, dtype=np.int64)
            before[back:] = tokens[:-back]
            valid &= before != SEPARATOR
            keys = (keys << np.uint64(self.bits)) | np.where(before < 0, 0, before).astype(np.uint64)
        positions = np.nonzero(valid)[0]
        order = np.argsort(keys[positions], kind="stable")  # stable: matches stay in corpus order
        return keys[positions][order], positions[order]

    def _matches(self, context: Sequence[int]) -> tuple[np.ndarray, int]:
        """Continuation positions of the longest suffix n-gram of ``context`` found (and its order; 0: none)."""
        for n in range(min(self.max_ngram, len(context)), 0, -1):
            ngram = context[len(context) - n:]
            if any(token < 0 or token >> self.bits for token in ngram):
                continue  # a token the corpus cannot hold
            keys, positions = self._keys[n - 1], self._positions[n - 1]
            key = self._pack(ngram)
            low, high = np.searchsorted(keys, key), np.searchsorted(keys, key, side="right")
            if high > low:
                return positions[max(low, high - MAX_MATCHES):high], n
        return self._positions[0][:0], 0

    def propose(self, context: Sequence[int], count: int) -> Retrieval | None:
        """Up to ``count`` drafts continuing ``context`` (``None``: no n-gram of it is in the corpus)."""
        matches, order = self._matches(context)
        if not order:
            return None
        drafts: list[int] = []
        agreement = 0.0
        last = len(self.tokens) - 1
        for step in range(count):
            following = self.tokens[np.minimum(matches + step, last)]
            values, counts = np.unique(following, return_counts=True)
            best = int(np.argmax(counts))
            if step == 0:
                agreement = float(counts[best] / counts.sum())
            if values[best] == SEPARATOR:
                break
            drafts.append(int(values[best]))
            matches = matches[following == values[best]]
        if not drafts:
            return None
        return Retrieval(drafts, order, agreement, self.expected_accepted(order, agreement))

    def expected_accepted(self, order: int, agreement: float) -> float:
        """Drafts a proposal of this order and agreement had accepted on the calibration documents (the mean
        over its bucket); 0.5 when uncalibrated."""
        if self.calibration is None:
            return 0.5
        return float(self.calibration[order - 1, _agreement_bucket(agreement)])

    @classmethod
    def calibrate(cls, documents: Sequence[Sequence[int]], held_out: Sequence[tuple[Sequence[int], int]],
                  count: int = 4) -> DraftDatastore:
        """A datastore of ``documents`` calibrated on ``held_out``: ``(tokens, start)`` pairs, where drafts
        are proposed at every position from ``start`` on by a datastore that does not hold them; then the
        held-out documents join the corpus. The calibration is each bucket's mean accepted drafts (0 for a
        bucket with no proposals, so that it is never preferred)."""
        probe = cls.from_sequences(documents)
        sums = np.zeros((probe.max_ngram, len(AGREEMENT_EDGES) + 1))
        counts = np.zeros_like(sums)
        for tokens, start in held_out:
            tokens = [int(token) for token in tokens]
            for position in range(max(start, 1), len(tokens)):
                proposal = probe.propose(tokens[:position], count)
                if proposal is None:
                    continue
                bucket = proposal.order - 1, _agreement_bucket(proposal.agreement)
                sums[bucket] += _accepted(proposal.tokens, tokens[position:])
                counts[bucket] += 1
        calibration = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
        store = cls.from_sequences([*documents, *(tokens for tokens, _ in held_out)])
        store.calibration = calibration[: store.max_ngram]
        return store

    def save(self, path: str | os.PathLike) -> None:
        """Write the corpus (and calibration) to one ``.npz`` file."""
        arrays = {"tokens": self.tokens.astype(np.int32)}
        if self.calibration is not None:
            arrays["calibration"] = self.calibration.astype(np.float32)
        with open(path, "wb") as file:
            np.savez_compressed(file, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> DraftDatastore:
        """Read a datastore written by :meth:`save`."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no datastore file at {path} (write one with DraftDatastore.save)")
        with np.load(path) as arrays:
            if "tokens" not in arrays:
                raise ValueError(f"{path} is not a datastore: it holds no 'tokens' array")
            calibration = arrays["calibration"].astype(np.float64) if "calibration" in arrays else None
            return cls(arrays["tokens"].astype(np.int64), calibration)


def _agreement_bucket(agreement: float) -> int:
    return int(np.searchsorted(AGREEMENT_EDGES, agreement, side="right"))


def _accepted(drafts: Sequence[int], truth: Sequence[int]) -> int:
    """Leading drafts equal to the tokens that followed."""
    accepted = 0
    for draft, token in zip(drafts, truth, strict=False):
        if draft != token:
            break
        accepted += 1
    return accepted
