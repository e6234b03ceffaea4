"""The one error type users see: a single line naming the problem and the fix. (TVM learns of it in
compiler/passes/__init__.py, so that importing the CLI does not import TVM.)"""


class MobilecError(Exception):
    """A problem with the user's input or environment; the CLI prints it as one line and exits 2."""
