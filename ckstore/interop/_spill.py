"""Tensors that live in memory up to a budget and in temporary files past it.

Formats whose readers or writers need every tensor at once (a DCP load, ``torch.save``) get
their tensors from a :class:`Spill`: the first ``budget`` bytes are ordinary tensors, the rest
are memory-mapped temporary files (shared mappings, so the kernel writes them back and drops
the pages under pressure instead of growing the process). The files go when the spill closes.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from types import TracebackType

import torch

SPILL_ENV = "CKSTORE_SPILL_DIR"
"""Where spill files go by default (else the system's temporary directory)."""


class Spill:
    """Allocate tensors within ``budget`` bytes of memory, past it in files under ``parent``."""

    def __init__(self, budget: int, parent: str | None = None) -> None:
        self.budget = budget
        self.parent = parent or os.environ.get(SPILL_ENV) or tempfile.gettempdir()
        self.used = 0
        self.spilled = 0
        self._dir: str | None = None
        self._n = 0

    def empty(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A new contiguous CPU tensor (uninitialised)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0 or self.used + nbytes <= self.budget:
            self.used += nbytes
            return torch.empty(shape, dtype=dtype)
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="ckstore-spill-", dir=self.parent)
        self._n += 1
        path = os.path.join(self._dir, f"{self._n}.bin")
        with open(path, "wb") as f:
            f.truncate(nbytes)
        self.spilled += nbytes
        flat = torch.from_file(path, shared=True, size=math.prod(shape), dtype=dtype)
        return flat.reshape(shape)

    def close(self) -> None:
        """Delete the spill files (tensors from them must no longer be used)."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> Spill:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
