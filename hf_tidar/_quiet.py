"""Silencing notices about choices hf_tidar makes itself, and only those, only while it makes them."""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator


class _DropPrefix(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).startswith(self.prefixes)


@contextlib.contextmanager
def drop_log_records(logger_name: str, *prefixes: str) -> Iterator[None]:
    """Drop records of ``logger_name`` whose message starts with one of ``prefixes`` inside the block.

    For a library notice that describes what this package chose on the user's behalf (nothing the user
    could act on); every other record of that logger still goes through.
    """
    logger = logging.getLogger(logger_name)
    record_filter = _DropPrefix(prefixes)
    logger.addFilter(record_filter)
    try:
        yield
    finally:
        logger.removeFilter(record_filter)


@contextlib.contextmanager
def ignore_warnings(*messages: str, category: type[Warning] = Warning) -> Iterator[None]:
    """``warnings.catch_warnings`` that ignores the warnings whose message matches one of ``messages`` (regexes)."""
    with warnings.catch_warnings():
        for message in messages:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield
