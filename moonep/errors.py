"""Errors raised by moonep beyond plain ValueError (user error)."""


class MoonEPTimeoutError(TimeoutError):
    """A collective moonep call did not complete on every rank in time.

    Raised instead of hanging when a peer died, raised mid-call, or called a different sequence of
    collective operations. The message names the call and, where known, the ranks that were missing.
    """
