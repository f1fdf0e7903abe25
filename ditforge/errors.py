"""The two kinds of error a run reports as one line (``cli.main`` prints them on stderr, no traceback)."""


class UserError(Exception):
    """Bad input from the user (a flag, a file, a checkpoint); the message names it and what was expected.
    Exit code 2."""


class RunError(Exception):
    """A run that stopped on an accident of its own, not on bad input: a diverged loss, a full disk. The message
    says what happened and where the last good checkpoint is. Exit code 1."""
