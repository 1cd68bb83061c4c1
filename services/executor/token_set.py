"""The ids a guided row may take next, kept as the shorter of two lists (``TokenSet``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenSet:
    """The ids a guided row may take: ``ids`` when ``keep``, else every id but ``ids`` (whichever
    list is the shorter; most states allow a few hundred tokens or all but a few hundred)."""

    keep: bool
    ids: np.ndarray  # int64, sorted, unique

    @classmethod
    def from_mask(cls, mask: np.ndarray) -> "TokenSet":
        allowed = int(mask.sum())
        return cls(True, np.flatnonzero(mask)) if 2 * allowed <= mask.size else cls(False, np.flatnonzero(~mask))

    @property
    def empty(self) -> bool:
        return self.keep and not len(self.ids)

    def adding(self, token_ids: list[int]) -> "TokenSet":
        extra = np.asarray(token_ids, np.int64)
        if self.keep:
            return TokenSet(True, np.union1d(self.ids, extra))
        return TokenSet(False, np.setdiff1d(self.ids, extra))

    def only_among(self, token_ids: list[int]) -> bool:
        """Whether every allowed id is one of ``token_ids`` (false for a set of all but a few)."""
        return self.keep and bool(np.isin(self.ids, token_ids).all())

    def as_mask(self, size: int) -> np.ndarray:
        ids = self.ids[self.ids < size]
        mask = np.zeros(size, bool) if self.keep else np.ones(size, bool)
        mask[ids] = self.keep
        return mask
