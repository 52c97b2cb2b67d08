"""HTTP plumbing of the Ingress: error envelopes, bounded bodies, forms, bearer-token auth.

Every error response is OpenAI's envelope ``{"error": {"message", "type", "param", "code"}}``.
Bodies are read with a size cap before anything parses them (413), only the media types a
route takes are accepted (415), and JSON that cannot be parsed (malformed, or nested deeper
than the parser allows) is a 400. Torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from ray.exceptions import ActorUnavailableError, ObjectRefStreamEndOfStreamError, RayActorError
from ray.serve.exceptions import DeploymentUnavailableError
from python_multipart.multipart import parse_options_header
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.proxy import BODY_SCOPE_KEY, admission_header
from pipeline.contract.base import MAX_ERRORS_LISTED
from pipeline.contract.text import shown
from pipeline.errors import (AuthenticationError, DitServeError, InternalError, InvalidRequestError,
                             PayloadTooLargeError, PermissionDeniedError, ServiceUnavailableError,
                             UnsupportedMediaTypeError)

JSON_TYPE = "application/json"
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
MAX_FORM_FIELDS = 256  # Starlette's parser stops at this many fields (a request has a few dozen)

# Status codes Starlette/FastAPI raise themselves, as OpenAI-style error codes.
_HTTP_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
               413: "body_too_large", 415: "unsupported_media_type", 422: "invalid_value"}


def _unwrap(exc: BaseException) -> BaseException:
    """A Ray-wrapped error from the router or a replica → the error it carries."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


# The Router's actor gone, or (DeploymentUnavailableError) its deployment has no replica left,
# as after a failed redeploy
_ROUTER_GONE = (RayActorError, ActorUnavailableError, ObjectRefStreamEndOfStreamError, DeploymentUnavailableError)


def as_ditserve_error(exc: BaseException) -> DitServeError:
    """An exception as the error a client gets: a ditserve error as it is; the Router's actor
    gone (stopping, dead, restarting; or its Serve replica ended the call's stream without an
    answer as it stopped) as 503 ``unavailable``; anything else as a 500 that names no
    internals (never a trace or a path)."""
    cause = _unwrap(exc)
    if isinstance(cause, DitServeError):
        return cause
    if isinstance(cause, _ROUTER_GONE) or isinstance(exc, _ROUTER_GONE):
        return ServiceUnavailableError("the router is unavailable (restarting, shutting down, or its deployment "
                                       "failed: see `serve status`); retry shortly", code="unavailable")
    return InternalError(f"internal error ({type(cause).__name__})")


def error_response(exc: DitServeError) -> JSONResponse:
    """The envelope with the error's status, ``Retry-After`` for 429 / 503, and
    ``x-should-retry: false`` for an error a retry would meet again (a request's own
    ``timeout_s``): OpenAI's SDKs retry every status >= 500 unless told so (``max_retries`` 2 by
    default; ``openai/_base_client.py``, ``_should_retry``), and ran such a request three times."""
    headers = {}
    if getattr(exc, "retry_after_s", None) is not None:
        headers["Retry-After"] = str(exc.retry_after_s)
    if not getattr(exc, "retryable", True):
        headers["x-should-retry"] = "false"
    return JSONResponse(exc.to_envelope(), status_code=exc.status_code, headers=headers or None)


def _methods_of(request: Request) -> str:
    """The methods the app's routes take on ``request``'s path, as an ``Allow`` header lists them:
    each method a route fully matches (Starlette's own ``Allow`` names only the first route of the
    path's, and Serve's ingress nests a class's routes in one included router)."""
    from starlette.routing import Match

    return ", ".join(method for method in ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
                     if any(route.matches({**request.scope, "method": method})[0] == Match.FULL
                            for route in request.app.routes))


def install_error_handlers(app) -> None:
    """Make every error ``app`` answers an envelope: ditserve's, Starlette's own (no such
    route or method, unparsable form), FastAPI's parameter validation, and anything else."""

    @app.exception_handler(DitServeError)
    async def _ditserve_error(_request: Request, exc: DitServeError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
        message = str(exc.detail)[:500]
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # RFC 9110 15.5.6: a 405 names the path's methods (helper-59: no Allow)
            allow = _methods_of(request)  # Starlette's Allow names only its first route of the path's
            headers["Allow"] = allow
            message = f"{request.method} is not allowed on {shown(request.url.path)}; it takes {allow}"
        elif exc.status_code == 404 and message == "Not Found":
            message = f"no route {shown(request.url.path)} (GET /docs lists the API)"
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                       "code": code}}, status_code=exc.status_code, headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def _parameter_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        where = ".".join(str(p) for p in (exc.errors()[0].get("loc") or ())) if exc.errors() else "request"
        return error_response(InvalidRequestError(f"{where}: invalid value", param=where, code="invalid_value"))

    @app.exception_handler(Exception)
    async def _unexpected_error(_request: Request, exc: Exception) -> JSONResponse:
        return error_response(as_ditserve_error(exc))


# -- bodies ---------------------------------------------------------------------------------
def request_body(model, *, forms: bool = False) -> dict:
    """``openapi_extra`` publishing ``model``'s JSON schema as a route's request body in
    ``/openapi.json`` (the routes parse their own bodies, under the caps below); ``forms``: the
    route takes the same fields as a form too."""
    schema = _inline_refs(model.model_json_schema())
    content = {JSON_TYPE: {"schema": schema}}
    if forms:
        content.update({kind: {"schema": schema} for kind in FORM_TYPES})
    return {"requestBody": {"required": True, "content": content}}


def _inline_refs(schema: dict) -> dict:
    """A pydantic JSON schema with its ``$defs`` references inlined (OpenAPI components differ)."""
    defs = schema.pop("$defs", {})

    def resolve(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(dict(defs[node["$ref"].rsplit("/", 1)[1]]))
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


def media_type(request: Request) -> str:
    """The request's ``Content-Type`` without parameters, lower-cased ("" when absent)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes: a larger ``Content-Length`` is refused before
    reading, a longer stream as soon as it passes the limit. A small body the proxy sent in the
    scope (``deployments.proxy.BodyInScope``) is taken from there. Raises ``PayloadTooLargeError``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"request body of {int(declared)} bytes; at most {limit} are accepted",
                                   param="body", code="body_too_large")
    sent = request.scope.get(BODY_SCOPE_KEY)
    if isinstance(sent, bytes):
        if len(sent) > limit:
            raise PayloadTooLargeError(f"request body over {limit} bytes", param="body", code="body_too_large")
        return sent
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(f"request body over {limit} bytes", param="body", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class _RepeatedKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _object_of_unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's members as a dict; raises ``_RepeatedKey`` for a key given twice (the
    last silently won: ``{"prompt": "x", "prompt": "y"}`` ran "y")."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise _RepeatedKey(key)
        obj[key] = value
    return obj


class _HugeInteger(Exception):
    def __init__(self, digits: int):
        super().__init__(digits)
        self.digits = digits


def _bounded_int(text: str) -> int:
    """A JSON integer; raises ``_HugeInteger`` for one of more digits than Python converts
    (``sys.get_int_max_str_digits()``, 4300: its ValueError named Python's setting)."""
    if len(text) > MAX_INTEGER_DIGITS:
        raise _HugeInteger(len(text.lstrip("-")))
    return int(text)


_MARK = object()  # what a second parse puts where the first one found a problem
# The most digits a JSON integer may have: Python's int_max_str_digits default (a longer one was
# Python's ValueError, naming its setting); far past any field's bound (a seed has 19).
MAX_INTEGER_DIGITS = 4300


def _marked_field(raw: bytes, **hooks) -> str | None:
    """The request field a problem the first parse of ``raw`` met belongs to: a second parse with
    ``hooks`` (``json.loads``'s) that put :data:`_MARK` where it is, then the top-level key whose
    value holds it (at any depth; the key itself for a top-level repeat); None when not found."""
    try:
        value = json.loads(raw, **hooks)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict):
        return None
    for key, member in value.items():
        stack = [member]
        while stack:
            item = stack.pop()
            if item is _MARK:
                return key
            stack.extend(item.values() if isinstance(item, dict) else item if isinstance(item, list) else ())
    return None


def parse_json(raw: bytes):
    """JSON text → value. Raises ``InvalidRequestError`` for malformed or too deeply nested
    JSON, for an object that gives a key more than once (as a form field given twice), and for an
    integer of more than ``MAX_INTEGER_DIGITS`` digits, each naming the request field it is in
    (helper-75: a key repeated inside ``cache_dit_params`` named the inner key, an integer of
    100,000 digits was "Exceeds the limit (4300 digits) ... sys.set_int_max_str_digits()")."""
    try:
        return json.loads(raw or b"null", object_pairs_hook=_object_of_unique_keys, parse_int=_bounded_int)
    except _RepeatedKey as exc:
        field = _marked_field(raw, parse_int=lambda text: 0, object_pairs_hook=lambda pairs: (
            _MARK if len({key for key, _ in pairs}) < len(pairs) else dict(pairs))) or exc.key
        where = "" if field == exc.key else f" inside {shown(field)}"
        raise InvalidRequestError(f"request body gives the key {shown(exc.key)} more than once in one object{where}; "
                                  "it takes one value", param=field[:64], code="invalid_json") from None
    except _HugeInteger as exc:
        field = _marked_field(raw, parse_int=lambda text: _MARK if len(text) > MAX_INTEGER_DIGITS else 0) or "body"
        raise InvalidRequestError(f"{field}: an integer of {exc.digits} digits; no field takes a number that large",
                                  param=field[:64], code="invalid_value") from None
    except RecursionError:
        raise InvalidRequestError("request body nests too deeply", param="body", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {str(exc)[:200]}", param="body",
                                  code="invalid_json") from None


def _unsupported(request: Request, accepted: tuple[str, ...]) -> UnsupportedMediaTypeError:
    return UnsupportedMediaTypeError(
        f"Content-Type {media_type(request) or 'missing'!r} is not accepted here; send {' or '.join(accepted)}",
        param="Content-Type", code="unsupported_media_type")


async def json_body(request: Request, max_json_bytes: int):
    """A JSON request's body (``Content-Type: application/json`` only, at most ``max_json_bytes``
    bytes). Raises ``UnsupportedMediaTypeError`` for another type, ``PayloadTooLargeError``
    (:func:`read_body`) and ``InvalidRequestError`` (:func:`parse_json`)."""
    if media_type(request) != JSON_TYPE:
        raise _unsupported(request, (JSON_TYPE,))
    return parse_json(await read_body(request, max_json_bytes))


async def json_or_form_body(request: Request, max_json_bytes: int, max_body_bytes: int,
                            files: tuple[str, ...] = (), json: bool = True, file_lists: tuple[str, ...] = ()) -> dict:
    """A body sent as JSON or as a form (multipart or url-encoded, how OpenAI's SDK sends
    ``videos.create`` and ``images.edit``), as a JSON-like dict; forms go through
    :func:`form_to_body`, uploads of the fields named in ``files`` become bytes (a list for
    those in ``file_lists``, given as ``name[]`` or repeated). ``json=False``: forms only (415 for JSON).
    ``max_json_bytes`` / ``max_body_bytes``: the most bytes a JSON / form body may have. Raises
    ``UnsupportedMediaTypeError`` for another type, ``PayloadTooLargeError`` (:func:`read_body`)
    and ``InvalidRequestError`` for a malformed JSON or form body (:func:`form_to_body`'s too)."""
    kind = media_type(request)
    if kind == JSON_TYPE and json:
        return parse_json(await read_body(request, max_json_bytes))
    if kind not in FORM_TYPES:
        raise _unsupported(request, (JSON_TYPE, *FORM_TYPES) if json else FORM_TYPES[:1])
    raw = await read_body(request, max_body_bytes)
    if kind == FORM_TYPES[0]:
        check_multipart_ends(request.headers.get("content-type", ""), raw)

    async def replay():
        return {"type": "http.request", "body": raw, "more_body": False}

    try:
        form = await Request(request.scope, replay).form(max_files=16, max_fields=MAX_FORM_FIELDS)
    except Exception as exc:  # Starlette's multipart / url-encoded parse errors
        detail = str(getattr(exc, "detail", exc))[:200]
        if files and detail.startswith("Too many files"):  # the uploads' field, not the body (helper-63)
            raise InvalidRequestError(f"{' and '.join(files)}: more than 16 files in one form; no model takes as many",
                                      param=files[0], code="invalid_form") from None
        raise InvalidRequestError(f"request body is not a valid form: {detail}", param="body",
                                  code="invalid_form") from None
    items = []
    for key, value in form.multi_items():
        if not isinstance(value, str) and key.removesuffix("[]") in files:
            value = await value.read()  # an upload (already inside the capped body)
        items.append((key, value))
    return form_to_body(items, files, file_lists)


def check_multipart_ends(content_type: str, raw: bytes) -> None:
    """Raise ``InvalidRequestError`` (``param`` ``body``, code ``invalid_form``) for a multipart
    body without its close delimiter ``--<boundary>--`` (RFC 2046 section 5.1.1): one cut short.
    Starlette's parser keeps a part only once the next delimiter arrives and raises nothing at
    such an end, so the unfinished last part (a ``mask``, an ``input_reference``, a ``strength``)
    was dropped and the request ran without it. A missing boundary is left to the parser's error."""
    boundary = parse_options_header(content_type)[1].get(b"boundary")
    if boundary and b"--" + boundary + b"--" not in raw:
        closing = shown(f"--{boundary.decode('latin-1')}--", 80)
        raise InvalidRequestError(f"the multipart body ends without its closing boundary {closing}: it was cut "
                                  "short, and its last part would be lost", param="body", code="invalid_form")


_ABSENT = object()  # a form path given no value
_FORM_KEY = re.compile(r"^([^\[\]]+)((?:\[[^\[\]]*\])*)$")
# kept as text, never read as JSON (a prompt "123", an adapter named "1"); keys as the SDK writes them
_FORM_TEXT_FIELDS = {"prompt", "negative_prompt", "model", "size", "user", "safety_identifier", "seconds",
                     "lora[][name]"}


def form_to_body(items: list[tuple[str, object]], files: tuple[str, ...] = (),
                 file_lists: tuple[str, ...] = ()) -> dict:
    """Form fields → a JSON body, decoding the names OpenAI's SDK writes (``array_format``
    "brackets", ``openai/_qs.py``).

    Nested keys in bracket notation (``cache_dit_params[Fn_compute_blocks]=2``) become objects,
    a trailing ``[]`` appends to a list (``cache_dit_params[scm_cache_bins][]=2``), and ``[]``
    inside a name is a list of objects (``lora[][name]=a``). The SDK sends such a list grouped
    by field, not item by item (``lora[][name]=a``, ``lora[][name]=b``, ``lora[][scale]=0.8``,
    ``lora[][scale]=0.5``), so item i takes the i-th value of each field. A 400 names the field
    whose item fields give different numbers of values (items giving different fields: their
    values cannot be matched to items), a list inside a list's items, a list given both as
    objects and as values (``lora[]=a`` with ``lora[][name]=b``), and a field other than a list
    or upload given twice. Items giving different fields with equal counts cannot be told
    from fewer, fuller items (``[{"name": "a"}, {"scale": 0.5}]`` is the form of ``[{"name": "a",
    "scale": 0.5}]``) and are read so: only JSON text in one field says which is meant. Values of
    fields other than the text fields are read as JSON when they parse (``8`` → 8, ``true`` →
    True, ``[{"name": "a"}]``), else kept as text, and validation then names bad ones.

    Uploads (bytes) are accepted for the fields named in ``files`` only; elsewhere a file is a
    400 naming the field. An upload field of ``file_lists`` given twice becomes a list, as
    ``name[]`` does; another upload field takes one file (given twice, or as ``name[]``: a 400).
    """
    body: dict = {}
    lists: dict[tuple[str, ...], dict[tuple[str, ...], list]] = {}  # list path -> item field path -> values
    whole: set[tuple[str, ...]] = set()  # paths given a value whole (not by name[] items)
    for key, value in items:
        match = _FORM_KEY.match(key)
        if not match:
            raise InvalidRequestError(f"malformed form field name {key[:40]!r}", param=key[:40], code="invalid_form")
        path = [match.group(1), *re.findall(r"\[([^\[\]]*)\]", match.group(2))]
        if isinstance(value, bytes) and path[0] in files and path[1:] == [""] and path[0] not in file_lists:
            raise InvalidRequestError(f"{path[0]}: takes one file, sent as {path[0]} (not {path[0]}[])",
                                      param=path[0], code="invalid_form")
        if isinstance(value, bytes) and path[0] in files and len(path) <= 2 and path[1:] in ([], [""]):
            pass  # an upload where one is expected
        elif not isinstance(value, str):
            accepted = f" (uploads go in {', '.join(files)})" if files else ""
            raise InvalidRequestError(f"{path[0]}: a file upload is not accepted in this field{accepted}",
                                      param=path[0], code="invalid_value")
        elif path[0] in files:
            raise InvalidRequestError(f"{path[0]}: expected an uploaded file, got a text field", param=path[0],
                                      code="invalid_value")
        elif key not in _FORM_TEXT_FIELDS:
            try:
                value = json.loads(value, object_pairs_hook=_object_of_unique_keys)
            except json.JSONDecodeError as exc:
                if value.lstrip().startswith(("[", "{")):  # meant as a list or object: say why it is not one
                    raise InvalidRequestError(f"form field {key[:40]!r} is not valid JSON ({exc.msg} at character "
                                              f"{exc.pos}); a list or object goes as JSON text", param=path[0],
                                              code="invalid_json") from None
            except (ValueError, RecursionError):
                pass
            except _RepeatedKey as exc:
                raise InvalidRequestError(f"form field {key[:40]!r} gives the key {shown(exc.key)} more than once "
                                          "in one object; it takes one value", param=path[0],
                                          code="invalid_form") from None
        if "" not in path[:-1]:
            if path[-1] == "" and tuple(path[:-1]) in whole:  # lora=[...] then lora[]=...: was one list of both
                raise InvalidRequestError(f"form field {key[:40]!r} mixes a value and a list: "
                                          f"{_form_name(path[:-1])} is given whole and item by item; send it one way",
                                          param=path[0], code="invalid_form")
            _form_put(body, path, value, key, repeatable=path[0] in file_lists)
            if path[-1] != "":
                whole.add(tuple(path))
            continue
        at = path.index("")
        if "" in path[at + 1:]:
            raise InvalidRequestError(f"form field {key[:40]!r}: a list inside a list's items cannot be sent as "
                                      f"form fields (its items cannot be told apart); send {path[0]} as JSON text "
                                      "in one field", param=path[0], code="invalid_form")
        lists.setdefault(tuple(path[:at]), {}).setdefault(tuple(path[at + 1:]), []).append(value)
    for at, fields in lists.items():
        node = body
        for part in at:
            node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
        if node is not _ABSENT:  # also given as a value or a list of values (lora[]=a, lora=null with lora[][name]=b)
            item_fields = ", ".join(f"{_form_name(at)}[]{_form_name(('', *field))}" for field in fields)
            raise InvalidRequestError(f"{_form_name(at)}: given both as a list of objects ({item_fields[:120]}) and "
                                      f"as {_form_name(at)} or {_form_name(at)}[]; send it one way",
                                      param=at[0], code="invalid_form")
        _form_put(body, list(at), _form_items(at, fields), f"{_form_name(at)}[]", repeatable=False)
    return body


def _form_name(path) -> str:
    """``("a", "b", "")`` → ``a[b][]``."""
    return path[0] + "".join(f"[{part}]" for part in path[1:])


def _form_items(at: tuple[str, ...], fields: dict[tuple[str, ...], list]) -> list[dict]:
    """The items of the list of objects at ``at`` (``fields``: each item field's values, in
    order): item i takes the i-th value of each field."""
    names = {field: f"{_form_name(at)}[]{_form_name(('', *field))}" for field in fields}
    if len({len(values) for values in fields.values()}) > 1:
        given = ", ".join(f"{names[field]}: {len(values)}" for field, values in fields.items())
        raise InvalidRequestError(
            f"{at[0]}: the items of a list sent as form fields must each give the same fields, else a value "
            f"cannot be matched to its item (values given: {given[:300]}); give every item each field, or send "
            f"{at[0]} as JSON text in one field", param=at[0], code="invalid_form")
    items = [{} for _ in next(iter(fields.values()))]
    for field, values in fields.items():
        for item, value in zip(items, values, strict=True):
            _form_put(item, list(field), value, names[field], repeatable=False, param=at[0])
    return items


def _form_put(body: dict, path: list[str], value, key: str, *, repeatable: bool, param: str | None = None) -> None:
    """Set ``value`` at ``path`` in ``body`` (a trailing ``""`` appends to a list). A field given
    twice is a 400, unless ``repeatable`` (upload fields: the values become a list)."""
    param = param or path[0]
    node = body
    parts, append = (path[:-1], True) if path[-1] == "" else (path, False)
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise InvalidRequestError(f"form field {key[:40]!r} mixes a value and an object", param=param,
                                      code="invalid_form")
    last = parts[-1]
    if append:
        node = node.setdefault(last, [])
        if not isinstance(node, list):
            raise InvalidRequestError(f"form field {key[:40]!r} mixes a value and a list", param=param,
                                      code="invalid_form")
        node.append(value)
    elif last not in node:
        node[last] = value
    elif repeatable:  # a repeated upload field (curl -F image=@a -F image=@b)
        node[last] = [*(node[last] if isinstance(node[last], list) else [node[last]]), value]
    elif isinstance(node[last], dict):
        raise InvalidRequestError(f"form field {key[:40]!r} mixes a value and an object", param=param,
                                  code="invalid_form")
    else:
        one = "file" if isinstance(value, bytes) else "value"
        raise InvalidRequestError(f"form field {key[:40]!r} is given more than once; it takes one {one}",
                                  param=param, code="invalid_form")


# -- query strings ----------------------------------------------------------------------------
def query_params(request: Request, accepted: tuple[str, ...]) -> dict[str, str]:
    """The query string's parameters, each given once and each one of ``accepted`` (as a body's
    unknown field is refused, so is an unknown parameter: a misspelt ``limt`` would otherwise
    be ignored without a word). Raises ``InvalidRequestError`` (400) naming every bad one."""
    params: dict[str, str] = {}
    problems: list[tuple[str, str]] = []
    for key, value in request.query_params.multi_items():
        if key not in accepted:
            problems.append((key, f"unknown query parameter {shown(key)}"))
        elif key in params:
            problems.append((key, f"query parameter {key} given more than once"))
        params[key] = value
    if problems:
        message = "; ".join(m for _, m in problems[:MAX_ERRORS_LISTED])
        if len(problems) > MAX_ERRORS_LISTED:
            message += f"; and {len(problems) - MAX_ERRORS_LISTED} more problems"
        raise InvalidRequestError(f"{message} (accepted: {', '.join(accepted) or 'none'})",
                                  param=problems[0][0][:40], code="invalid_value")
    return params


# -- authentication ---------------------------------------------------------------------------
def load_api_keys(api_keys_env: str | None = None, api_keys_file: str | None = None,
                  field: str = "api_keys") -> tuple[str, ...]:
    """The accepted API keys: one per line (or comma-separated) in environment variable
    ``api_keys_env`` and in file ``api_keys_file`` (UTF-8, a byte-order mark ignored); a ``#``
    at the start of a line or after a space or comma starts a comment to the end of the line
    (helper-59: a file's ``# API keys`` header made ``#`` and ``API`` keys; helper-62: after a
    comma, and after a byte-order mark, it still did), so a key may hold ``#`` past its first
    character (helper-61: ``sk-abc#123`` was cut to ``sk-abc``). Raises ``ValueError`` naming ``auth.<field>_env`` /
    ``auth.<field>_file`` when a source is configured but yields no key (an open server by mistake)."""

    def split(text: str) -> list[str]:
        return [k for line in text.splitlines() for k in re.split(r"[\s,]+", re.sub(r"(^|[\s,])#.*", "", line)) if k]

    keys: list[str] = []
    if api_keys_env is not None:
        found = split(os.environ.get(api_keys_env, ""))
        if not found:  # unset, empty, or separators only (",")
            raise ValueError(f"auth.{field}_env names {api_keys_env}, which is unset or holds no key (# comments "
                             "aside) in the "
                             "Ingress replica's environment: Ray gives replicas the environment of their Ray node "
                             "(where `ray start` ran on it, or the `serve run` / `ditserve serve` that started a "
                             f"local cluster), not the deploying shell's; set {api_keys_env} on every node, or in "
                             "the application's runtime_env.env_vars (serve run, serve deploy, a RayService)")
        keys += found
    if api_keys_file is not None:
        path = Path(api_keys_file)
        if not path.is_file():
            raise ValueError(f"auth.{field}_file {api_keys_file} is not a readable file")
        found = split(path.read_text(encoding="utf-8-sig"))
        if not found:
            raise ValueError(f"auth.{field}_file {api_keys_file} holds no key (# comments aside)")
        keys += found
    return tuple(keys)


MIN_API_KEY_CHARS = 16  # OpenAI's keys have over 40; a short key can be guessed


def api_key_sets(auth: dict) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(api_keys, batch_api_keys)`` of an ``auth`` config section (:func:`load_api_keys`).
    Raises ``ValueError`` for a key given in both sets (its requests' default priority would
    be ambiguous); logs a warning naming how many keys are shorter than ``MIN_API_KEY_CHARS``
    (accepted: a test setup's keys may be short)."""
    keys = load_api_keys(auth.get("api_keys_env"), auth.get("api_keys_file"))
    batch_keys = load_api_keys(auth.get("batch_api_keys_env"), auth.get("batch_api_keys_file"), "batch_api_keys")
    both = set(keys) & set(batch_keys)
    if both:
        raise ValueError(f"{len(both)} key(s) are both in auth.api_keys_* and in auth.batch_api_keys_*: a key's "
                         "requests default to one priority, so give each key in one set only")
    short = sum(len(k) < MIN_API_KEY_CHARS for k in (*keys, *batch_keys))
    if short:
        logging.getLogger("ray.serve").warning(
            "%d API key(s) are shorter than %d characters and could be guessed; use long random keys "
            "(python -c 'import secrets; print(secrets.token_urlsafe(32))')", short, MIN_API_KEY_CHARS)
    return keys, batch_keys


class AdmissionHeader:
    """ASGI middleware: every response names the app's admission limit, route prefix and this
    replica's start (``deployments.proxy.admission_header``, from ``app.state.admission_limit``
    and ``app.state.admission_epoch``), so the proxy's :class:`deployments.proxy.AdmissionGate`
    refuses at that limit without asking this process."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        state = scope.get("app") and scope["app"].state
        if scope["type"] != "http" or getattr(state, "admission_limit", None) is None:
            await self.app(scope, receive, send)
            return

        async def with_header(message):
            if message["type"] == "http.response.start":  # the limit as it is now (the lease updates it)
                header = admission_header(state.admission_limit, scope.get("root_path", ""),
                                          getattr(state, "admission_epoch", 0))
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        await self.app(scope, receive, with_header)


class BearerAuth:
    """ASGI middleware: with keys configured, every request but ``GET`` / ``HEAD`` of ``/health``
    and of the static playground page (``/``, whose own API calls carry the key) needs
    ``Authorization: Bearer <key>`` (OpenAI's header; the SDK's ``api_key``), compared in
    constant time; otherwise 401 in the envelope. ``/docs``, ``/redoc`` and ``/openapi.json``
    are behind it too. Keys come from :func:`load_api_keys` via ``app.state.api_keys``."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        state = scope.get("app") and scope["app"].state
        keys = getattr(state, "api_keys", ()) if scope["type"] == "http" else ()
        if keys and not self._public(scope):
            if not self._matches(scope, keys):
                sent = len(_authorization_headers(scope))
                response = error_response(AuthenticationError(
                    "missing or invalid API key: send 'Authorization: Bearer <key>'"
                    + (f" once (it came {sent} times)" if sent > 1 else ""), param=None, code="invalid_api_key"))
                await response(scope, receive, send)
                return
            if self._matches(scope, getattr(state, "batch_api_keys", ())):  # request.state.default_priority
                scope.setdefault("state", {})["default_priority"] = "batch"
        await self.app(scope, receive, send)

    @staticmethod
    def _public(scope) -> bool:
        """``GET`` / ``HEAD`` of the app's own ``/health`` and of its root (the static playground
        page); nothing else (``/v1/videos/health`` reached the Router without a key, and any
        other method on ``/health`` was answered 405 without one, where the API answers 401)."""
        path = scope["path"].rstrip("/")
        root = scope.get("root_path", "").rstrip("/")
        return path in (root, f"{root}/health") and scope.get("method") in ("GET", "HEAD")

    @staticmethod
    def _matches(scope, keys: tuple[bytes, ...]) -> bool:
        token = bearer_token(scope)
        if token is None:
            return False
        matched = False
        for key in keys:  # every key compared, each in constant time
            matched |= hmac.compare_digest(token, key)
        return matched


SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


class CrossSiteGuard:
    """ASGI middleware: on a server without API keys, a browser's request from another site that
    would change state (every method but ``GET``, ``HEAD`` and ``OPTIONS``) is refused 403 in
    the envelope (code ``cross_site_request``). A page on any site could otherwise make its
    visitors' browsers post edits and video jobs there (helper-66): a multipart form is a CORS
    "simple" request, sent without asking the server first. With keys, nothing is needed: a
    browser never adds ``Authorization: Bearer`` by itself, and a page cannot add it across
    sites without a CORS preflight, which ditserve does not answer.

    Browsers say where a request comes from: ``Sec-Fetch-Site`` (``cross-site`` and
    ``same-site`` are refused; ``same-origin`` and ``none``, typed by the user, pass), sent to
    HTTPS and loopback servers; else ``Origin``, refused when ``null`` or when its host matches
    none of ``Host``, ``X-Forwarded-Host`` and ``Forwarded: host=`` (a trailing dot and the
    scheme's default port ignored; one of them without a port matches any port: nginx's
    ``$host``). Clients that are not browsers (the OpenAI SDK, curl, handle calls) send
    neither and pass; so does the playground page's own fetch. Not covered: DNS rebinding, whose
    page is same-origin in the browser's eyes (a server without keys should listen on a trusted
    network). Fetch Metadata: https://www.w3.org/TR/fetch-metadata/."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        state = scope.get("app") and scope["app"].state
        if (scope["type"] == "http" and scope.get("method") not in SAFE_METHODS
                and not getattr(state, "api_keys", ()) and self.cross_site(scope)):
            response = error_response(PermissionDeniedError(
                "cross-site request refused: a browser sent it from a page of another site (Sec-Fetch-Site or "
                "Origin); call the API from this server's own page, or from a client that is not a browser (behind "
                "a proxy that rewrites Host, have it send X-Forwarded-Host)", param=None, code="cross_site_request"))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def cross_site(scope) -> bool:
        """Whether a browser says the request ``scope`` comes from another site (see the class)."""
        headers = {}
        for name, value in scope.get("headers") or ():
            headers.setdefault(name, value.decode("latin-1").strip())
        fetch_site = headers.get(b"sec-fetch-site", "").lower()
        if fetch_site:
            return fetch_site not in ("same-origin", "none")
        origin = headers.get(b"origin")
        if origin is None:
            return False
        try:  # "null" (a sandboxed frame's page, or a file's) has no host, and matches none
            parts = urlsplit(origin.lower())
            origin_host = (parts.hostname or "").rstrip(".")
            origin_port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
        except ValueError:  # a port that is not a number
            return True
        forwarded = re.search(r'(?:^|[;,\s])host="?([^";,\s]+)', headers.get(b"forwarded", ""), re.IGNORECASE)
        candidates = [headers.get(b"host", ""), headers.get(b"x-forwarded-host", "").split(",")[0].strip(),
                      forwarded.group(1) if forwarded else ""]
        for candidate in filter(None, candidates):
            try:
                own = urlsplit(f"//{candidate.lower()}")
                host, port = (own.hostname or "").rstrip("."), own.port
            except ValueError:
                continue
            if host and host == origin_host and port in (None, origin_port):
                return False
        return True


_DEFAULT_PORTS = {"http": 80, "https": 443}


MAX_IDEMPOTENCY_KEY_CHARS = 255


def _authorization_headers(scope) -> list[bytes]:
    return [value for name, value in scope.get("headers") or () if name == b"authorization"]


def bearer_token(scope) -> bytes | None:
    """The token of an ASGI request ``scope``'s ``Authorization: Bearer <token>`` header (the
    scheme in any case, the token without surrounding spaces), or None for another scheme, an
    empty token, none, or several ``Authorization`` headers (helper-59: the last one won, where a
    repeated ``Idempotency-Key`` or field is refused; for the key check and the key's namespace
    alike)."""
    headers = _authorization_headers(scope)
    scheme, _, token = (headers[0] if len(headers) == 1 else b"").partition(b" ")
    return (token.strip() or None) if scheme.lower() == b"bearer" else None


def single_header(request: Request, name: str) -> str | None:
    """Header ``name`` of ``request``, or None without it. Raises ``InvalidRequestError`` naming
    it when it is sent more than once (helper-59: a second ``Idempotency-Key`` was ignored)."""
    values = request.headers.getlist(name)
    if len(values) > 1:
        raise InvalidRequestError(f"{name} was sent {len(values)} times; send it once", param=name,
                                  code="invalid_value")
    return values[0] if values else None


def caller_scope(request: Request | None) -> str:
    """Whose ``Idempotency-Key`` namespace a create is in: an HTTP caller's by the API key it
    sends (:func:`bearer_token`, as :class:`BearerAuth` reads it: ``Bearer sk-1`` and
    ``bearer  sk-1`` are one caller; without keys configured, the token the client sends all the
    same, none or an empty one: one namespace), a handle caller's (``request`` None) apart from every HTTP one."""
    if request is None:
        return "handle"
    token = bearer_token(request.scope)
    return "http" if token is None else "http:" + hashlib.sha256(token).hexdigest()


def idempotency_scope(key: object, scope: str) -> str | None:
    """``key`` (an ``Idempotency-Key``: Stripe's and OpenAI's header for a request safe to send
    again) in the namespace ``scope`` (:func:`caller_scope`), or None without a key: keys of
    different callers never meet. Raises ``InvalidRequestError`` naming ``Idempotency-Key``
    for one that is not a string of 1-255 printable ASCII characters."""
    if key is None:
        return None
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY_CHARS or not (
            key.isascii() and key.isprintable()):
        raise InvalidRequestError(f"Idempotency-Key must be a string of 1-{MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII "
                                  f"characters, got {shown(_as_sent(key))}", param="Idempotency-Key",
                                  code="invalid_value")
    return f"{hashlib.sha256(scope.encode()).hexdigest()[:16]}:{key}"


def _as_sent(value: object) -> object:
    """A header value as its sender wrote it: HTTP headers reach Starlette as bytes it decodes
    as Latin-1, so UTF-8 text ("é") read as "Ã©"; a value that is not UTF-8 bytes so read
    stays as it is."""
    if not isinstance(value, str):
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return value


def request_fingerprint(request: BaseModel) -> str:
    """SHA-256 of a validated request's fields, defaults included (uploads by their own
    SHA-256): two bodies that mean the same request (a field left out or given as ``null``, a
    dict or the model) have the same fingerprint, so the same ``Idempotency-Key`` finds its job."""
    text = json.dumps(request.model_dump(), sort_keys=True, separators=(",", ":"),
                      default=lambda v: hashlib.sha256(v).hexdigest() if isinstance(v, bytes) else repr(v))
    return hashlib.sha256(text.encode()).hexdigest()


def key_default_priority(body, request):
    """``body`` with ``priority`` set to its API key's default (``auth.batch_api_keys_env``)
    when it gives none, itself or in ``extra_body`` (``null`` gives none: it means the default,
    as it does for every field); otherwise ``body`` unchanged."""
    default = getattr(request.state, "default_priority", None)
    if default is None or not isinstance(body, dict):
        return body
    nested = body.get("extra_body")
    if body.get("priority") is not None or (isinstance(nested, dict) and nested.get("priority") is not None):
        return body
    if isinstance(nested, dict) and "priority" in nested:  # set where it was given
        return {**body, "extra_body": {**nested, "priority": default}}
    return {**body, "priority": default}
