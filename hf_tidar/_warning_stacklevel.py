"""Where a warning should point: the first frame outside hf_tidar, transformers and torch."""

from __future__ import annotations

import os
import sys

import torch
import transformers

_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(module.__file__)) + os.sep
    for module in (sys.modules[__package__], transformers, torch)
)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by this function's caller that names the user's line.

    A warning raised inside ``generate`` passes through transformers' and torch's frames, a number that
    changes between versions; pointing at library code would also defeat ``filterwarnings(module=...)``.
    """
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level
