"""The one error hierarchy of ditserve.

Every error carries the fields of OpenAI's error envelope (``message``, ``type``,
``param``, ``code``) and the HTTP status the ingress maps it to. Handle callers catch the
same classes (Ray re-raises them on the caller's side). Only the ingress turns them into
HTTP responses.
"""

from __future__ import annotations


class DitServeError(Exception):
    """Base class. ``status_code`` is the HTTP status the ingress answers with."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 request_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.request_id = request_id

    def __reduce__(self):
        # Exceptions pickle their positional args only; keep the keyword fields (and any set
        # later, such as about_adapter's) across Ray.
        return (_rebuild, (type(self), self.message, self.param, self.code, self.request_id), self.__dict__)

    def to_envelope(self) -> dict:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}


def _rebuild(cls, message, param, code, request_id):
    return cls(message, param=param, code=code, request_id=request_id)


def about_adapter(error: DitServeError, adapter: str) -> DitServeError:
    """``error``, a batch's error about LoRA adapter ``adapter`` (kept as its ``adapter``): the
    Router answers each request of the batch with it naming the field that request named the
    adapter in, ``model`` or ``lora`` (``SamplingParams.adapter_field``; helper-79)."""
    error.adapter = adapter
    return error


class InvalidRequestError(DitServeError):
    """400: the request is malformed; ``message`` lists every problem found."""

    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(DitServeError):
    """401: the API key is missing or not one of the configured keys."""

    status_code = 401
    error_type = "invalid_request_error"


class PermissionDeniedError(DitServeError):
    """403: the request is refused whatever its key (a browser's cross-site request)."""

    status_code = 403
    error_type = "invalid_request_error"


class PayloadTooLargeError(DitServeError):
    """413: the request body is larger than ``limits.max_body_bytes`` (``max_json_body_bytes`` for JSON)."""

    status_code = 413
    error_type = "invalid_request_error"


class UnsupportedMediaTypeError(DitServeError):
    """415: the body's ``Content-Type`` is not one the route accepts."""

    status_code = 415
    error_type = "invalid_request_error"


class ModelNotFoundError(DitServeError):
    """404: the ``model`` field names a model this deployment does not serve."""

    status_code = 404
    error_type = "invalid_request_error"


class NotFoundError(DitServeError):
    """404: no such video job (never created, deleted, or evicted after its retention)."""

    status_code = 404
    error_type = "invalid_request_error"


class OverloadedError(DitServeError):
    """429: the router's queue bound is reached; retry after ``retry_after_s`` seconds."""

    status_code = 429
    error_type = "rate_limit_error"
    retry_after_s = 1


class ServiceUnavailableError(DitServeError):
    """503: no healthy replica, the router is restarting, or the server is shutting down; retry
    after ``retry_after_s`` seconds."""

    status_code = 503
    error_type = "server_error"
    retry_after_s = 1


class ReplicaUnavailableError(ServiceUnavailableError):
    """503: the replica a batch was sent to is broken or stopping and refused it before
    running anything; the Router requeues the batch's requests rather than failing them."""


class RequestTimeoutError(DitServeError, TimeoutError):
    """504: the request's ``timeout_s`` deadline passed before it finished. Not worth retrying
    (the deadline is the caller's own): HTTP answers say so (``x-should-retry: false``)."""

    status_code = 504
    error_type = "timeout_error"
    retryable = False


class InternalError(DitServeError):
    """500: a batch failed inside a replica. The message names the request id, never a trace."""

    status_code = 500
    error_type = "server_error"


class OutputEncodingError(InternalError):
    """500 ``encoding_failed``: one request's media could not be encoded (its batch-mates' were).
    A retry would meet it again: HTTP answers say so (``x-should-retry: false``)."""

    retryable = False


class LoraLoadError(InternalError):
    """500 ``lora_load_failed``: a LoRA adapter a batch names could not be loaded or activated
    (its file went missing or is corrupt). Raised before the denoising loop on every rank alike,
    so a sequence-parallel replica stays in step; the adapter is unloaded and the replica keeps
    serving."""


class BatchCancelled(Exception):
    """Not an answer to a client: control flow inside a replica. A running batch was stopped at
    a step boundary because no caller wanted it any more; ``steps_done`` of ``steps`` ran.
    ``dropped``: batch index -> steps done when that request's rows left the batch earlier
    (its caller left first; ``pipeline.loop.LoopOutput.dropped``), so its saved work is counted
    as a dropped request's, not lost with the stopped batch."""

    def __init__(self, steps_done: int, steps: int, dropped: dict[int, int] | None = None):
        super().__init__(f"batch stopped after {steps_done} of {steps} steps")
        self.steps_done, self.steps, self.dropped = steps_done, steps, dict(dropped or {})

    def __reduce__(self):  # a rank > 0 raises it through Ray, which pickles it; Exception's
        # default re-calls __init__ with the message alone, which fails (the rank group then
        # saw an unpicklable error, not a consistent stop, and broke the replica)
        return type(self), (self.steps_done, self.steps, self.dropped)


DROPPED_ROWS_ATTR = "ditserve_dropped_rows"


def record_dropped_rows(exc: BaseException, dropped: dict[int, int]) -> None:
    """Note on ``exc``, a batch's failure, the requests whose rows had left that batch before it
    failed (batch index -> steps done then; their callers had left), so that their saved work is
    still counted (the Router counts it from the replica's ``dropped`` event)."""
    if dropped:
        try:
            setattr(exc, DROPPED_ROWS_ATTR, dict(dropped))
        except (AttributeError, TypeError):  # an exception type that takes no attributes
            pass


def dropped_rows(exc: BaseException) -> dict[int, int]:
    """What :func:`record_dropped_rows` noted on ``exc`` (empty when nothing was dropped)."""
    return dict(getattr(exc, DROPPED_ROWS_ATTR, None) or {})


class SharedFailure(RuntimeError):
    """A step every rank of a sequence-parallel replica takes together failed on rank 0 (the
    encode of a batch's prompts, which rank 0 does for all): every rank raises it at the same
    point, so the ranks stay in step and the replica keeps serving. The batch's requests get
    a 500."""
