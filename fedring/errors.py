"""Errors that fedring reports to the user rather than as a traceback."""


class ConfigError(ValueError):
    """A setting is unknown or out of range.

    Raised before any work starts; the command line turns it into one message and exit
    code 2 on every rank.

    Parameters
    ----------
    key : str
        The setting, as the user writes it (``rounds``, ``krum.variant``, ``--clients``).
    message : str
        What is wrong and what is allowed.
    """

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


class ResultsError(RuntimeError):
    """The results file cannot be written (its file system is full, or it may not grow).

    Reported as one message, without a traceback: the file keeps every round written before,
    and ``--resume`` continues from its last checkpoint once there is room.
    """
