"""The one exception type users see: a clear message, never a traceback."""


class SpecdecodeError(Exception):
    """Bad input or an impossible request (wrong path, mismatched vocabularies, prompt too long).

    Raised before anything is changed, so the caller's state stays as it was.
    The CLI prints the message and exits with status 2.
    """
