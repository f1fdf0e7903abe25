"""User-facing errors: `cli.main` prints them as one line on stderr and exits with code 2."""


class UserError(Exception):
    """Bad input from the user (a flag, a file, a checkpoint); the message names it and what was expected."""
