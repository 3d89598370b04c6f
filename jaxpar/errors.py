"""The one exception type for mistakes a user can make in a config or an input."""


class UserError(Exception):
    """A config or input mistake; the CLI prints its one-sentence message and exits with 2."""
