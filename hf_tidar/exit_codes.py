"""The exit codes of ``hf-tidar``, and the one place that says which error ends a command with which."""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1  # bad input: a missing folder, a refused output, a wrong option combination
EXIT_USAGE = 2  # argparse's own code for a flag it cannot parse
EXIT_HUB = 3  # the Hub refused or could not be reached; the input itself was fine


def exit_code_for(error: BaseException) -> int | None:
    """The exit code ``error`` ends a command with, or ``None`` for an error that is a bug (to be re-raised)."""
    from .hub import HubPushError  # here, not at import: ``hf-tidar --help`` needs no Hub client

    if isinstance(error, HubPushError):
        return EXIT_HUB
    if isinstance(error, (ValueError, FileNotFoundError)):
        return EXIT_ERROR
    return None
