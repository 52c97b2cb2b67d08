"""What the ditserve deployments' processes write to Serve's logs.

Serve logs every exception a replica's method raises as an ERROR "Request failed." with its
traceback (``ray/serve/_private/replica.py``, ``_handle_errors_and_metrics``), and its log
reaches the console of ``serve run`` and of any driver that calls the app's handle
(``log_to_driver``). A ditserve error other than a 500 is the request's answer, not a failure
of the server: a bad field (400), an overload's 429 with ``Retry-After``, a deadline passed
(504). Each such record becomes one line naming the status, code and message, without the
traceback (INFO below 500, WARNING from it); anything else keeps Serve's ERROR and traceback.

The Router's calls are the app's own (a lease each Ingress renews every second, the long polls
of running batches): :func:`no_access_log` leaves them out of its log. A filter in the process,
not the deployment's ``logging_config``: one of those would replace the application's
``logging_config`` for the Router (Serve copies an application's only onto deployments that set
none: ``ray/serve/_private/application_state.py``).
"""

from __future__ import annotations

import logging

from pipeline.errors import DitServeError, InternalError

SERVE_LOGGER = "ray.serve"


class AnswersNotFailures(logging.Filter):
    """Rewrites Serve's "Request failed." record of a ditserve error that is an answer (any
    but :class:`InternalError`) to one line; passes every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if record.msg == "Request failed." and isinstance(error, DitServeError) \
                and not isinstance(error, InternalError):
            record.levelno = logging.INFO if error.status_code < 500 else logging.WARNING
            record.levelname = logging.getLevelName(record.levelno)
            record.msg, record.args = "Request answered %s %s: %s", (error.status_code, error.code, error.message)
            record.exc_info, record.exc_text = None, None
        return True


def answers_are_not_failures() -> None:
    """Install :class:`AnswersNotFailures` on Serve's logger in this process (once)."""
    logger = logging.getLogger(SERVE_LOGGER)
    if not any(isinstance(f, AnswersNotFailures) for f in logger.filters):
        logger.addFilter(AnswersNotFailures())


def _not_an_access_log(record: logging.LogRecord) -> bool:
    return not getattr(record, "serve_access_log", False)  # Serve's access-log records carry it


def no_access_log() -> None:
    """Leave Serve's access-log lines of this process's replica out of its log (once)."""
    logger = logging.getLogger(SERVE_LOGGER)
    if _not_an_access_log not in logger.filters:
        logger.addFilter(_not_an_access_log)
