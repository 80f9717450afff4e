"""A log filter that keeps orbax's repeated tracebacks of a failed write off the user's screen."""

from __future__ import annotations

import logging


class DropOrbaxLogs(logging.Filter):
    """Orbax logs a failed background write several times with tracebacks (and asyncio logs each of its
    futures whose error nobody read, at exit); the save raises it once, on one line."""

    LOGGERS = ("absl", "asyncio")

    def filter(self, record: logging.LogRecord) -> bool:
        return "orbax" not in record.pathname and not _raised_in_orbax(record)

    def attach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)

    def detach(self) -> None:
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)


def _raised_in_orbax(record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    tb = error.__traceback__ if error is not None else None
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False
