"""Values derived from a mask, built once per (mask object, key) and dropped with the mask.

Masks compare by identity, so every layer that derives something costly from one (classification,
kernel tables, device copies, CP plans and executors) keys it on the mask object; this cache does
that in one place, thread-safe, holding the mask weakly and optionally bounded in size.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from .mask import Mask

T = TypeVar("T")


class MaskCache:
    """build() results per (mask object, key), freed when the mask is; with `size`, at most that
    many entries, the least recently used dropped first."""

    def __init__(self, size: int | None = None) -> None:
        self._size = size
        self._values: weakref.WeakKeyDictionary[Mask, dict[Hashable, Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._order: OrderedDict[tuple[int, Hashable], weakref.ref] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, mask: Mask, key: Hashable, build: Callable[[], T]) -> T:
        """The value for (mask, key), calling build() the first time."""
        with self._lock:
            per_mask = self._values.get(mask)
            if per_mask is not None and key in per_mask:
                self._touch(mask, key)
                return per_mask[key]
        value = build()
        with self._lock:
            self._values.setdefault(mask, {})[key] = value
            self._touch(mask, key)
            self._evict()
        return value

    def _touch(self, mask: Mask, key: Hashable) -> None:
        if self._size is not None:
            self._order[(id(mask), key)] = weakref.ref(mask)
            self._order.move_to_end((id(mask), key))

    def _evict(self) -> None:
        while self._size is not None and len(self._order) > self._size:
            (_, key), ref = self._order.popitem(last=False)
            mask = ref()
            if mask is not None:
                self._values.get(mask, {}).pop(key, None)
