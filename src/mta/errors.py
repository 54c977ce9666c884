"""The one exception type the CLI turns into a clean message and a non-zero exit."""


class MtaError(Exception):
    """A problem the user can fix: the message names the file, line or key and the fix."""
