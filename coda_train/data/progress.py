"""Progress of a long preparation: a tqdm bar on a terminal, else one log line every LOG_EVERY_SECONDS."""

from __future__ import annotations

import logging
import sys
import time
from typing import Optional

from tqdm import tqdm

log = logging.getLogger(__name__)

LOG_EVERY_SECONDS = 30.0


class Progress:
    """Bytes of input read (of total_bytes when known), documents and tokens so far, for one stage of preparation."""

    def __init__(self, stage: str, total_bytes: Optional[int]):
        self.stage, self.total = stage, total_bytes
        self.start = self.last_log = time.perf_counter()
        self.bar = tqdm(total=total_bytes, desc=stage, unit="B", unit_scale=True, leave=False) if sys.stderr.isatty() else None

    def update(self, bytes_read: int, documents: int, tokens: Optional[int] = None) -> None:
        if self.bar is not None:
            self.bar.update(bytes_read - self.bar.n)
            self.bar.set_postfix_str(f"{documents:,} docs" + (f", {tokens:,} tokens" if tokens is not None else ""), refresh=False)
            return
        now = time.perf_counter()
        if now - self.last_log >= LOG_EVERY_SECONDS:
            self.last_log = now
            done = f" of {self.total / 1e6:,.0f} MB ({100 * bytes_read / self.total:.0f}%)" if self.total else ""
            read = f"{bytes_read / 1e6:,.0f} MB{done} read ({bytes_read / 1e6 / (now - self.start):.1f} MB/s), " if bytes_read else ""
            tokens_part = f", {tokens:,} tokens" if tokens is not None else ""
            log.info("%s: %s%s documents%s", self.stage, read, f"{documents:,}", tokens_part)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
