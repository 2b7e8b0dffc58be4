"""The package logger, set up the way transformers sets up its own.

Records of ``hf_tidar.*`` loggers go to stderr as ``[hf_tidar] message`` from level INFO up (notices
about waits the package causes, such as profiling the machine); ``HF_TIDAR_VERBOSITY`` (``debug``,
``info``, ``warning``, ``error``) changes the level. The package's root logger does not propagate, so an
application's own logging setup does not print these twice.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

LIBRARY = "hf_tidar"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_lock = threading.Lock()
_configured = False


class _CurrentStderr(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is when a record is emitted
    (a redirected or captured stderr, as the standard library's last-resort handler does)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property always reads sys.stderr
        pass


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` for a module of this package, with the package's handler installed once."""
    global _configured
    with _lock:
        if not _configured:
            root = logging.getLogger(LIBRARY)
            handler = _CurrentStderr()
            handler.setFormatter(logging.Formatter(f"[{LIBRARY}] %(message)s"))
            root.addHandler(handler)
            root.setLevel(_LEVELS.get(os.environ.get("HF_TIDAR_VERBOSITY", "").lower(), logging.INFO))
            root.propagate = False
            _configured = True
    return logging.getLogger(name)
