"""The one error type users see: a single line naming the problem and the fix."""


class MobilecError(Exception):
    """A problem with the user's input or environment; the CLI prints it as one line and exits 2."""
