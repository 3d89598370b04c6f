"""The exception types whose message is all a user needs: the CLI prints it as one sentence."""


class UserError(Exception):
    """A config or input mistake; the CLI prints its one-sentence message and exits with 2."""


class RunFailed(Exception):
    """A run that cannot go on for a reason other than a user mistake (a checkpoint that cannot be
    restored although it is not damaged, a coordinator that stops answering); the CLI prints its
    one-sentence message and exits with `exit_code`.

    `everywhere` says that every process of a multi-process run raises it, so process 0 alone
    reports it.
    """

    exit_code = 1

    def __init__(self, message: str, everywhere: bool = False):
        super().__init__(message)
        self.everywhere = everywhere
