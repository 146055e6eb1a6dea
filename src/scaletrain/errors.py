"""The one exception type that reaches the user as a clean, one-line message."""


class UserError(Exception):
    """Bad input from the user (config, paths, data): printed as one line, exit code 2.

    The message names the problem and what is accepted; the CLI prints it without a
    traceback. Anything else that escapes is a bug in scaletrain and keeps its traceback.
    """
