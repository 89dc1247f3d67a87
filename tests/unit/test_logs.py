"""pd-serve's logging inside num_replicas: records reach Serve's logger; cancelled requests' tasks
do not print tracebacks, every other unretrieved exception still does."""

from __future__ import annotations

import asyncio
import logging

import pytest
from ray.exceptions import TaskCancelledError

from serve_app.runtime.logs import LOGGER, quiet_cancelled_requests, to_serve_logs
from tests.support.log_capture import RecordList


@pytest.fixture
def asyncio_records():
    capture = RecordList()
    logger = logging.getLogger("asyncio")
    logger.addHandler(capture)
    yield capture.records
    logger.removeHandler(capture)
    logger.filters.clear()


def report(exc: BaseException) -> None:
    """What asyncio's default handler does with an exception nobody retrieved."""
    loop = asyncio.new_event_loop()
    try:
        loop.default_exception_handler({"message": "Future exception was never retrieved", "exception": exc})
    finally:
        loop.close()


@pytest.mark.parametrize("exc", [TaskCancelledError(), asyncio.CancelledError()])
def test_a_cancelled_requests_unretrieved_exception_is_not_reported(asyncio_records, exc):
    quiet_cancelled_requests()
    report(exc)
    assert asyncio_records == []


def test_other_unretrieved_exceptions_are_still_reported(asyncio_records):
    quiet_cancelled_requests()
    quiet_cancelled_requests()  # idempotent
    report(RuntimeError("a real bug"))
    assert len(asyncio_records) == 1 and asyncio_records[0].exc_info[1].args == ("a real bug",)


def test_pd_serve_records_go_through_the_serve_logger():
    capture = RecordList()
    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addHandler(capture)
    try:
        to_serve_logs()
        logging.getLogger(LOGGER + ".router").info("request %s ended", "cmpl-1")
        assert [r.getMessage() for r in capture.records] == ["request cmpl-1 ended"]
    finally:
        serve_logger.removeHandler(capture)


@pytest.mark.parametrize("serve_level", [logging.INFO, logging.DEBUG])
def test_pd_serve_logs_at_the_level_serve_was_given(serve_level):
    """Serve sets its logger's level from the deployment's ``logging_config.log_level`` (the app's
    ``log_level``); pd-serve's records follow it, so DEBUG lines appear only when asked for."""
    capture = RecordList()
    serve_logger = logging.getLogger("ray.serve")
    saved = serve_logger.level
    serve_logger.addHandler(capture)
    serve_logger.setLevel(serve_level)
    try:
        to_serve_logs()
        logging.getLogger(LOGGER + ".router").debug("request %s attempt 1", "cmpl-1")
        logging.getLogger(LOGGER + ".router").info("request %s ended", "cmpl-1")
        expected = (["request cmpl-1 attempt 1"] if serve_level == logging.DEBUG else []) + ["request cmpl-1 ended"]
        assert [r.getMessage() for r in capture.records] == expected
    finally:
        serve_logger.removeHandler(capture)
        serve_logger.setLevel(saved)
        to_serve_logs(logging.INFO)
