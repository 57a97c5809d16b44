"""The exceptions users see: each message is a single line saying what is wrong and how to fix it."""


class JaxseqError(Exception):
    """A problem the user can fix (bad path, bad config, bad flag). Scripts print it as one line, exit 1."""

    label = "error"
    exit_code = 1


class Interrupted(JaxseqError):
    """Training stopped by a signal after saving a checkpoint: exit 128 + the signal's number (130 for
    SIGINT/Ctrl-C, 143 for SIGTERM), as a shell reports a process killed by it."""

    label = "interrupted"

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def first_line(error: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message (at most ``limit`` characters), or its type's name
    when the message is empty: for one-line errors that quote a library's own."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:limit] if lines else type(error).__name__
