"""Errors that end a command with a one-line message (exit 2), never a traceback."""

import signal


class UserError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""

    exit_code = 2


class SpecError(UserError):
    """An invalid configuration value; ``key`` is the dotted config key the user can override."""

    def __init__(self, key: str, message: str):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


class RunFailed(Exception):
    """A launched job failed (worker crash, hang, timeout): exit status 1, run recorded as FAILED."""

    exit_code = 1


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) to `bench run`: handled like Ctrl-C; the run is recorded as KILLED."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"signal {signum}")


def stopped_by(exc: KeyboardInterrupt) -> signal.Signals:
    """The signal that interrupted a command (Ctrl-C: SIGINT; :class:`Interrupted`: its own)."""
    return signal.Signals(getattr(exc, "signum", signal.SIGINT))
