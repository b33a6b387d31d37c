"""Errors a user can cause or must act on. The CLI maps these to one clean line."""


# control characters as escapes: messages quote bucket content (keys, ids, reasons)
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(32), 127)} | {9: "\\t", 10: "\\n", 13: "\\r"}


class DdilocoError(Exception):
    """Base of every error ddiloco reports to the user without a traceback. Its message
    is always one line: control characters in it are shown as escapes."""

    exit_code = 1

    def __str__(self) -> str:
        return super().__str__().translate(_ESCAPES)


class UsageError(DdilocoError):
    """Bad flags or invalid hyperparameter combination; the message names the flag."""

    exit_code = 2


class StoreAccessError(DdilocoError):
    """The bucket cannot be used: missing bucket, no permission, wrong URL, unreachable."""

    exit_code = 3


class StoreUnavailableError(DdilocoError):
    """The bucket kept failing after every retry (an outage, a network partition): worth
    running the same command again later. Exit 75 (EX_TEMPFAIL), so a supervisor that
    stops restarting on usage and access errors (systemd RestartPreventExitStatus=2 3)
    still restarts it."""

    exit_code = 75


class ProtocolError(DdilocoError):
    """Bucket content violates the protocol (bad schema, newer major version, ...)."""

    exit_code = 4


class FencedError(DdilocoError):
    """A syncer found a higher epoch that covers its fragments: it must stop."""

    exit_code = 5


class InvalidPayloadError(DdilocoError):
    """A payload read from the bucket failed validation (size, sha256, shape, dtype,
    non-finite values). The message says what and where; the caller quarantines it."""
