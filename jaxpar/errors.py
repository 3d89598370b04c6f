"""The exception types whose message is all a user needs (the CLI prints it as one sentence), and
the exit codes of `jaxpar` and `jaxpar launch`."""

EXIT_FAILED = 1  # the run cannot go on: its loss diverged, or a RunFailed
EXIT_USAGE = 2  # a user mistake (config, input, devices), reported before anything is compiled
EXIT_LOST = 3  # a peer process was lost, or the coordinator stopped answering
EXIT_INTERRUPTED = 130  # Ctrl-C that the run did not handle itself, as shells report SIGINT (128 + 2)


class UserError(Exception):
    """A config or input mistake; the CLI prints its one-sentence message and exits with EXIT_USAGE."""


class ConfigError(UserError):
    """A config key, value or combination that cannot work."""


class DataError(UserError):
    """A data source that is missing, unreadable, or too small for the model."""


class RunFailed(Exception):
    """A run that cannot go on for a reason other than a user mistake (a checkpoint that cannot be
    restored although it is not damaged, a coordinator that stops answering); the CLI prints its
    one-sentence message and exits with `exit_code`.

    `everywhere` says that every process of a multi-process run raises it, so process 0 alone
    reports it.
    """

    exit_code = EXIT_FAILED

    def __init__(self, message: str, everywhere: bool = False):
        super().__init__(message)
        self.everywhere = everywhere
