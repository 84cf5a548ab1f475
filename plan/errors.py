"""The one error a plan, a cluster or a limit raises for bad input."""

from __future__ import annotations


class PlanError(ValueError):
    """A plan or cluster that cannot be used, with a message naming the file, the field and the fix.

    The message is always one line: a newline that came in with user data is shown escaped.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))
