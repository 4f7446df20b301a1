"""User-facing errors: raised for bad input, printed by the CLI without a traceback."""


class OrbitError(Exception):
    """An error caused by the user's input (a path, a flag, a file); the message says which."""
