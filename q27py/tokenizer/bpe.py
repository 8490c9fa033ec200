"""The BPE model: one pre-token (in the byte-level alphabet) -> token ids.

Semantics follow Hugging Face `tokenizers`' BPE: start from single characters and repeatedly
apply the adjacent merge with the lowest rank (its index in the merges list), the leftmost one
on ties; with `ignore_merges`, a pre-token that is itself a vocabulary entry is taken whole.
A min-heap over candidate pairs keeps a long pre-token (a 50 KB run of letters) O(n log n).
"""

from __future__ import annotations

import heapq

from q27py.errors import TokenizerError


class BPE:
    def __init__(self, vocab: dict[str, int], merges: dict[tuple[str, str], int], ignore_merges: bool):
        self.vocab = vocab
        self.merge_ranks = merges
        self.ignore_merges = ignore_merges

    def encode_word(self, word: str) -> list[int]:
        """Token ids for one pre-token already mapped to the byte-level alphabet."""
        vocab = self.vocab
        if self.ignore_merges and word in vocab:
            return [vocab[word]]
        pieces = self.merge(list(word))
        try:
            return [vocab[p] for p in pieces]
        except KeyError as exc:
            raise TokenizerError(f"BPE produced {exc.args[0]!r}, which is not in the vocabulary") from None

    def merge(self, symbols: list[str]) -> list[str]:
        """Apply merges to a symbol sequence until none applies; returns the final pieces."""
        ranks = self.merge_ranks
        n = len(symbols)
        if n < 2:
            return symbols
        # Doubly linked list over positions; a merged-away position is marked by nxt = -2.
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        heap: list[tuple[int, int, str, str]] = []
        for i in range(n - 1):
            rank = ranks.get((symbols[i], symbols[i + 1]))
            if rank is not None:
                heap.append((rank, i, symbols[i], symbols[i + 1]))
        heapq.heapify(heap)
        while heap:
            _, i, left, right = heapq.heappop(heap)
            j = nxt[i]
            # Stale entry: either side has been merged into something else since it was pushed.
            if j < 0 or symbols[i] != left or symbols[j] != right:
                continue
            merged = left + right
            symbols[i] = merged
            k = nxt[j]
            nxt[i] = k
            nxt[j] = -2
            if k >= 0:
                prv[k] = i
                rank = ranks.get((merged, symbols[k]))
                if rank is not None:
                    heapq.heappush(heap, (rank, i, merged, symbols[k]))
            p = prv[i]
            if p >= 0:
                rank = ranks.get((symbols[p], merged))
                if rank is not None:
                    heapq.heappush(heap, (rank, p, symbols[p], merged))
        return [symbols[i] for i in range(n) if nxt[i] != -2]
