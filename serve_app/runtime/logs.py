"""pd-serve's log lines inside Serve replicas.

pd-serve logs under the ``pd_serve`` logger. In a replica, Serve owns the ``ray.serve`` logger:
its file (``logs/serve/replica_<app>_<deployment>_<id>.log``), its format (plain or JSON, from
the deployment's ``logging_config``) and the request id it stamps on every line. ``to_serve_logs``
hands each pd-serve record to that logger, so pd-serve's lines land in the same file, in the same
format, with the same request ids as Serve's own, and the dashboard shows them together.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
from collections.abc import Iterator

LOGGER = "pd_serve"


def attempt_log_level(number: int) -> int:
    """The level of an attempt's own lines (its start, its disaggregated hand-off): DEBUG for a
    request's first attempt, INFO for the retries and resumes after it. At INFO a request that
    goes through at once logs one line, at its end (attempts, engines, tokens, finish reason);
    one that needed more attempts logs why and each attempt after the first. A line costs the
    router about 0.3 ms of CPU (Serve's log file and stderr handlers), and at INFO the first
    attempt's line would be written before its decode call goes out, adding to every request's
    TTFT."""
    return logging.DEBUG if number == 1 else logging.INFO


class _ToServeLogger(logging.Handler):
    """Forwards records to the ``ray.serve`` logger (looked up per record: Serve may reconfigure
    its handlers when a deployment's logging_config changes)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("ray.serve").handle(record)


def to_serve_logs(level: int | None = None) -> None:
    """Forward pd-serve's records to Serve's logger, at ``level`` or else at the level Serve set
    from the deployment's ``logging_config.log_level`` (the app's ``log_level``)."""
    ours = logging.getLogger(LOGGER)
    if not any(isinstance(h, _ToServeLogger) for h in ours.handlers):
        ours.addHandler(_ToServeLogger())
    ours.setLevel(level if level is not None else (logging.getLogger("ray.serve").level or logging.INFO))
    ours.propagate = False


class _CancelledRequestFilter(logging.Filter):
    """Drops asyncio's "exception was never retrieved" report when the exception is a
    cancellation (see ``quiet_cancelled_requests``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        import asyncio

        from ray.exceptions import TaskCancelledError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, (asyncio.CancelledError, TaskCancelledError)) and "never retrieved" in record.getMessage():
            logging.getLogger(LOGGER).debug("a cancelled request's task ended: %s", record.getMessage().splitlines()[0])
            return False
        return True


def quiet_cancelled_requests() -> None:
    """Keep a cancelled request to one log line (call it in a replica).

    Serve runs each request as a task on the replica's user-code event loop, behind a future on
    its main loop. When the caller goes away (an HTTP client disconnects, the router cancels an
    engine call), Serve cancels them, and the one nothing awaits any more ends with a
    ``TaskCancelledError`` that asyncio reports as "... exception was never retrieved", with a
    traceback. pd-serve already logs the disconnect once, with the request's id, so those reports
    (on whichever loop) are dropped from asyncio's logger; every other one is still logged.
    """
    asyncio_logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _CancelledRequestFilter) for f in asyncio_logger.filters):
        asyncio_logger.addFilter(_CancelledRequestFilter())


@contextlib.contextmanager
def serve_log_file_kept() -> Iterator[None]:
    """Keep this replica's Serve log file working across vLLM's start.

    When vLLM starts an engine it applies its logging config with ``logging.config.dictConfig``,
    which closes every handler in the process: Serve's replica log file
    (``logs/serve/replica_*.log``) would receive nothing more. Serve writes that file through a
    ``MemoryHandler`` whose ``close`` drops its target; this puts the target back (the file handler
    reopens its file on the next record).
    """
    saved = [(h, h.target) for h in logging.getLogger("ray.serve").handlers if isinstance(h, logging.handlers.MemoryHandler)]
    try:
        yield
    finally:
        for handler, target in saved:
            if handler.target is None and target is not None:
                handler.target = target
