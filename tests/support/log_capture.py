"""A logging handler that keeps the records it is given, for tests that read log records."""

from __future__ import annotations

import logging


class RecordList(logging.Handler):
    def __init__(self, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
