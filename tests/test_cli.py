"""The CLI as a person uses it: every failure is one line on stderr and a non-zero exit."""

from __future__ import annotations

import base64
import errno
import http.server
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from openai import APIConnectionError, APITimeoutError

from deployments.cli import CannotStart, _transport_modules, deploy_quiet_s, failure_line, main
from parallel.groups import free_port
from tests.helpers import wait_until


def test_no_server_is_one_line_saying_how_to_start_one(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    assert main(["generate", "a red circle", "-o", str(tmp_path / "a.png"), "--url", url]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: no ditserve server at {url}")
    assert "ditserve serve" in err and "Traceback" not in err
    assert not (tmp_path / "a.png").exists()
    assert main(["video", "a red circle", "-o", str(tmp_path / "a.mp4"), "--url", url]) == 1
    assert capsys.readouterr().err.startswith("error: no ditserve server")


def test_bad_extra_and_timeouts_are_one_line(tmp_path, capsys):
    """helper-48: NaN, Infinity (and 1e400, read as inf) in --extra, and a --lora scale nan or inf,
    were a traceback from the SDK's JSON encoder (``Out of range float values are not JSON
    compliant``); the client's 600 s wait could not be changed (--timeout)."""
    for option, value, said in (("--extra", "{nope", "not JSON"), ("--extra", "[1]", "must be a JSON object"),
                                ("--extra", '"x"', "must be a JSON object"),
                                ("--extra", '{"guidance_scale": NaN}', "not JSON (NaN is no JSON number"),
                                ("--extra", '{"a": [-Infinity]}', "not JSON (-Infinity is no JSON number"),
                                ("--extra", '{"guidance_scale": 1e400}', "1e400 is out of a float's range"),
                                ("--lora", "magenta:nan", "NAME:SCALE (a finite number)"),
                                ("--lora", "magenta:inf", "NAME:SCALE (a finite number)"),
                                ("--timeout", "0", "takes seconds, a number > 0"),
                                ("--timeout", "nan", "takes seconds, a number > 0"),
                                ("--timeout", "1e10", "at most 604800 (7 days)")):  # helper-49: OverflowError
        for command in ("generate", "video"):
            with pytest.raises(SystemExit) as exited:  # argparse's usage error: usage line, then the error
                main([command, "a", "-o", str(tmp_path / "a.png"), option, value, "--url", "http://x"])
            err = capsys.readouterr().err
            assert exited.value.code == 2 and f"argument {option}: " in err and said in err, err
            assert "Traceback" not in err, err
    timeout = APITimeoutError(request=httpx.Request("POST", "http://h/v1/images/generations"))
    assert failure_line(timeout, "http://h").startswith("error: http://h did not answer within 600 s (--timeout)")
    assert failure_line(timeout, "http://h", 2.5).startswith("error: http://h did not answer within 2.5 s")
    assert failure_line(KeyError("x"), "http://h") is None  # a bug, not a failed call: it raises


def test_a_server_answers_the_cli_to_a_person_not_to_a_program(capsys):
    """helper-48: a 429's line left out the Retry-After it was sent with; a 401 said to send an
    Authorization header, not the CLI's --api-key; TLS to ditserve's plain-HTTP port was "no
    ditserve server at https://...; start one"."""
    from openai import APIStatusError

    request = httpx.Request("POST", "http://h/v1/images/generations")
    for status, headers, said in ((429, {"retry-after": "1"}, "(Retry-After: 1 s)"),
                                  (503, {"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"},
                                   "(Retry-After: Wed, 21 Oct 2015 07:28:00 GMT)"),  # an HTTP date: no "s"
                                  (401, {}, "(the CLI sends --api-key, default $DITSERVE_API_KEY)")):
        response = httpx.Response(status, headers=headers, request=request, json={"error": {
            "message": "m", "type": "t", "param": None, "code": "c"}})
        line = failure_line(APIStatusError("m", response=response, body=None), "http://h")
        assert line == f"error {status} c: m {said}", line
    for transport in _transport_modules():
        sent = transport.Request("POST", "https://h:8000/v1/images/generations")
        tls = APIConnectionError(request=sent)
        tls.__cause__ = transport.ConnectError("[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1028)",
                                               request=sent)
        assert failure_line(tls, "https://h:8000") == (
            "error: https://h:8000 does not speak TLS ([SSL: WRONG_VERSION_NUMBER] wrong version number "
            "(_ssl.c:1028)); a ditserve server answers plain HTTP: --url http://h:8000")
        # helper-49: a TLS endpoint whose certificate fails is no plain-HTTP port (nor a missing server)
        tls.__cause__ = transport.ConnectError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: "
                                               "self-signed certificate (_ssl.c:1028)", request=sent)
        assert failure_line(tls, "https://h:8000").startswith(
            "error: the TLS handshake with https://h:8000 failed ([SSL: CERTIFICATE_VERIFY_FAILED]"), tls


def test_partial_images_without_stream_previews_is_a_usage_error(tmp_path, capsys):
    """helper-48: ``--extra '{"partial_images": 2}'`` without --stream-previews went to the
    server, which answered that previews need ``stream: true`` (a field the CLI sets)."""
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens: a request would say so
    for extra in ('{"partial_images": 2}', '{"extra_body": {"partial_images": 1}}'):
        assert main(["generate", "a", "-o", str(tmp_path / "a.png"), "--extra", extra, "--url", url]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "add --stream-previews DIR" in err, err
    assert main(["generate", "a", "-o", str(tmp_path / "a.png"), "--extra", '{"partial_images": 0}', "--url",
                 url]) == 1  # none asked: sent
    assert capsys.readouterr().err.startswith("error: no ditserve server")


def test_files_that_cannot_be_read_or_written_are_one_line_before_any_request(tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens: any request would say so
    (tmp_path / "file").write_text("")
    for argv, path in ((["generate", "a", "-o", str(tmp_path)], tmp_path),  # a directory
                       (["generate", "a", "-o", str(tmp_path / "file" / "a.png")], tmp_path / "file"),
                       (["generate", "a", "-o", str(tmp_path / "a.png"), "--stream-previews",
                         str(tmp_path / "file")], tmp_path / "file"),
                       (["edit", str(tmp_path / "missing.png"), "a", "-o", str(tmp_path / "b.png")],
                        tmp_path / "missing.png"),
                       (["video", "a", "-o", str(tmp_path)], tmp_path)):
        assert main([*argv, "--url", url]) == 1, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {path}: "), (argv, err)
        if path == tmp_path / "file":  # helper-48: said "File exists"
            assert err == f"error: {path}: Not a directory\n", err
    # helper-49: a file further up is named, not the directory that could not be made
    assert main(["generate", "a", "-o", str(tmp_path / "file" / "a" / "b" / "o.png"), "--url", url]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'file'}: Not a directory\n"
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert main(["generate", "a", "-o", str(tmp_path / "link" / "o.png"), "--url", url]) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'link'}: a symbolic link to nothing\n"
    if Path("/proc/self").is_dir():  # helper-48: root passes os.access; /proc takes no new file
        assert main(["generate", "a", "-o", "/proc/ditserve-test.png", "--url", url]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: /proc/ditserve-test.png: ") and "no ditserve server" not in err, err


@pytest.mark.parametrize("transport", _transport_modules(), ids=lambda m: m.__name__)
def test_a_connection_lost_mid_answer_is_not_called_a_missing_server(transport):
    """The SDK raises its transport's errors (httpx; httpx2 from openai 3) unwrapped when a
    stream's read fails, wrapped in ``APIConnectionError`` when the request does."""
    request = transport.Request("POST", "http://h/v1/images/generations")
    dropped = transport.RemoteProtocolError("peer closed connection without sending complete message body",
                                            request=request)
    assert failure_line(dropped, "http://h").startswith("error: the connection to http://h was lost")
    wrapped = APIConnectionError(request=request)
    wrapped.__cause__ = transport.ReadError("reset", request=request)
    assert failure_line(wrapped, "http://h").startswith("error: the connection to http://h was lost")
    refused = APIConnectionError(request=request)
    refused.__cause__ = transport.ConnectError("refused", request=request)
    assert failure_line(refused, "http://h").startswith("error: no ditserve server at http://h")


class _Answering(http.server.ThreadingHTTPServer):
    """A real HTTP server that answers every request (POST, GET, DELETE) with one fixed answer
    (status, type, body): a server or proxy that answers what ditserve never should, to see what
    the CLI prints. ``paths``/``bodies``: the POSTs'; ``requests``: (method, path) of each."""

    def __init__(self, status: int, content_type: str, body: bytes):
        self.answer, self.posts, self.paths, self.bodies, self.requests = (status, content_type, body), 0, [], [], []
        self.idempotency_keys = []  # the POSTs' Idempotency-Key headers (None: none sent)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(handler):  # noqa: N805 (the server is self)
                sent = handler.rfile.read(int(handler.headers.get("content-length") or 0))
                self.requests.append((handler.command, handler.path))
                if handler.command == "POST":
                    self.posts += 1
                    self.paths.append(handler.path)
                    self.bodies.append(sent)
                    self.idempotency_keys.append(handler.headers.get("idempotency-key"))
                status, content_type, body = self.answer
                handler.send_response(status)
                handler.send_header("content-type", content_type)
                handler.send_header("content-length", str(len(body)))
                handler.end_headers()
                handler.wfile.write(body)

            do_GET = do_DELETE = do_POST

            def log_message(handler, *args):  # noqa: N805
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def _sse(*events: tuple[str, str]) -> bytes:
    return "".join(f"event: {kind}\ndata: {data}\n\n" for kind, data in events).encode()


def _png_b64() -> str:
    """A 2x2 PNG, base64: the CLI reads an image's header before writing it."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (2, 2)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


_PNG = _png_b64()
_PARTIAL = json.dumps({"type": "image_generation.partial_image", "b64_json": _PNG, "partial_image_index": 0})


def _completed(b64_json) -> tuple[str, str]:
    return "image_generation.completed", json.dumps({"type": "image_generation.completed", "b64_json": b64_json})


@pytest.mark.parametrize("answer, stream, said", [
    ((200, "application/json", b'{"created": 1, "data": []}'), False, "holds no image"),
    ((200, "application/json", b'{"created": 1, "data": [{"b64_json": null}]}'), False, "holds no image"),
    ((200, "text/event-stream", _sse(("image_generation.partial_image", _PARTIAL))), True,
     "ended without its image"),
    ((200, "text/event-stream", _sse(("error", '{"error": "the replica stopped"}'))), True,
     "error: the replica stopped"),
    ((200, "text/event-stream", _sse(("image_generation.partial_image", "{nope"))), True, "is not valid JSON"),
    ((200, "application/json", b"{nope"), False, "is not valid JSON"),
    ((404, "text/html", b"<html>\n<body>Not Found</body>\n</html>"), False,
     "error 404: <html> <body>Not Found</body> </html>"),
    ((200, "application/json", b'{"data": 5}'), False, "holds no image (data is 5)"),
    ((200, "application/json", b'{"data": {"x": 1}}'), False, "holds no image"),
    ((200, "application/json", b'{"data": [{"b64_json": 5}]}'), False, "holds no image in data[0]"),
    ((200, "application/json", b'{"data": [{"b64_json": "!!!notbase64"}]}'), False, "holds no image in data[0]"),
    # helper-48: base64 of bytes that are no image was written as the image, exit 0
    ((200, "application/json", b'{"data": [{"b64_json": "AAAA"}]}'), False, "holds no image in data[0]"),
    ((200, "text/event-stream", _sse(_completed(base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()))), True,
     "holds no image in the completed event"),
    ((200, "text/event-stream", _sse(_completed(""))), True, "holds no image in the completed event"),
    ((200, "text/event-stream", _sse(_completed("!!!!!"))), True, "holds no image in the completed event"),
    ((200, "text/event-stream", _sse(_completed(None))), True, "holds no image in the completed event"),
    ((200, "text/event-stream", _sse(("image_generation.partial_image", json.dumps(
        {"type": "image_generation.partial_image", "b64_json": _PNG})))), True, "without a valid partial_image_index"),
    ((500, "application/json", b'{"error": {"code": "a\\nb", "param": "p\\nq", "message": "m"}}'), False,
     "error 500 a b (p q): m"),
    ((502, "text/plain", b""), False, "error 502: (the answer gave no message)"),
    ((200, "text/event-stream", _sse(("error", '{"error": {"code": "c\\nd", "param": "x", "message": "m1\\nm2"}}'))),
     True, "error c d (x): m1 m2"),
], ids=["no data", "null b64_json", "no completed event", "string error event", "bad event JSON", "bad JSON",
        "html 404", "data a number", "data an object", "b64_json a number", "b64_json not base64",
        "b64_json no image", "completed a png signature only",
        "completed empty", "completed not base64", "completed null", "preview without index", "multi-line fields",
        "empty 502", "multi-line error event"])
def test_answers_ditserve_never_gives_are_one_line(tmp_path, capsys, answer, stream, said):
    """A proxy's page, a stream cut short, an answer without its image: one line and exit 1,
    nothing written (these printed 'wrote' with exit 0, or an IndexError / TypeError /
    JSONDecodeError traceback)."""
    server = _Answering(*answer)
    try:
        out = tmp_path / "a.png"
        argv = ["generate", "a", "-o", str(out), "--url", server.url]
        assert main(argv + (["--stream-previews", str(tmp_path / "p")] if stream else [])) == 1
        err = capsys.readouterr().err
        last = err.splitlines()[-1]
        assert last.startswith("error") and said in last and "Traceback" not in err, err
        assert "\nerror" in "\n" + err  # on its own line, not after a progress bar's
        assert not out.exists() and "wrote" not in capsys.readouterr().out
    finally:
        server.shutdown()


def test_a_server_url_as_people_write_it_reaches_the_api(tmp_path, capsys):
    """``--url`` with a trailing slash (or OpenAI's base-URL form ending in /v1) asked
    ``//v1/images/generations`` and printed the server's 404; a URL without a scheme was
    called a connection lost mid-answer. Now the same routes are reached, and a URL that is
    not one is a usage error naming --url, before any request, for every command."""
    server = _Answering(200, "application/json", json.dumps({"created": 1, "data": [{"b64_json": _PNG}]}).encode())
    try:
        for url in (server.url, server.url + "/", server.url + "/v1", server.url + "/v1/", " " + server.url + "//"):
            assert main(["generate", "a", "-o", str(tmp_path / "a.png"), "--url", url]) == 0, url
        assert server.paths == ["/v1/images/generations"] * 5
        host = server.url.removeprefix("http://")
        for command in (["generate", "a"], ["edit", str(tmp_path / "a.png"), "a"], ["video", "a"]):
            for url in (host, "ftp://" + host, "http://", "http://h:port", "http://h:70000", server.url + "/?q=1"):
                with pytest.raises(SystemExit) as exited:
                    main([*command, "-o", str(tmp_path / "b.png"), "--url", url])
                err = capsys.readouterr().err
                assert exited.value.code == 2 and "argument --url: takes the server's URL" in err, (command, url, err)
        assert server.posts == 5
    finally:
        server.shutdown()


def test_stream_in_extra_is_refused_before_any_request(tmp_path, capsys):
    """``--extra '{"stream": true}'`` (itself or in a nested ``extra_body``) without
    ``--stream-previews`` was an AttributeError traceback after the generation ran."""
    server = _Answering(200, "application/json", b"{}")
    try:
        for command in (["generate", "a"], ["edit", str(tmp_path / "in.png"), "a"]):
            (tmp_path / "in.png").write_bytes(b"")
            for extra in ('{"stream": true}', '{"extra_body": {"stream": true}}', '{"stream": false}',
                          '{"stream": null, "extra_body": {"stream": true}}'):  # a clash: not flattened
                argv = [*command, "-o", str(tmp_path / "a.png"), "--url", server.url, "--extra", extra]
                assert main(argv) == 2, (argv, extra)
                err = capsys.readouterr().err
                assert err.count("\n") == 1 and err.startswith("error: --extra: stream is set by the command"), err
        assert server.posts == 0
    finally:
        server.shutdown()


def test_an_output_suffix_naming_no_image_format_is_refused_before_any_request(tmp_path, capsys):
    """``-o out.gif`` wrote PNG bytes under a .gif name (and previews as partial-N.gif)."""
    server = _Answering(200, "application/json", b"{}")
    try:
        (tmp_path / "in.png").write_bytes(b"")
        for command in (["generate", "a"], ["edit", str(tmp_path / "in.png"), "a"]):
            argv = [*command, "-o", str(tmp_path / "out.gif"), "--url", server.url]
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "out.gif: the suffix names the image format" in err and ".webp" in err, err
        assert server.posts == 0
    finally:
        server.shutdown()


@pytest.mark.parametrize("argv, said", [
    (["generate", "a", "-o", "{tmp}/b.webp", "--extra", '{"output_format": "png"}'],
     "--extra: output_format 'png' disagrees with -o"),  # PNG bytes were written as b.webp
    (["generate", "a", "-o", "{tmp}/b.png", "--extra", '{"extra_body": {"output_format": "jpeg"}}'],
     "--extra: output_format 'jpeg' disagrees with -o"),
    (["edit", "{tmp}/in.png", "a", "-o", "{tmp}/b.jpg", "--extra", '{"output_format": "webp"}'],
     "--extra: output_format 'webp' disagrees with -o"),
    (["generate", "a", "-o", "{tmp}/c.png", "--extra", '{"n": 2}'],
     "--extra: n 2: the command writes one image"),  # the second image was made and dropped
    (["edit", "{tmp}/in.png", "a", "-o", "{tmp}/c.png", "--extra", '{"n": 3}'],
     "--extra: n 3: the command writes one image"),
    (["video", "a", "-o", "{tmp}/v.gif"], "v.gif: a video is written as MP4"),  # MP4 bytes in a .gif
])
def test_an_extra_or_a_suffix_that_would_write_other_bytes_is_refused_before_any_request(tmp_path, capsys,
                                                                                       argv, said):
    _refused_before_any_request(tmp_path, capsys, argv, said)


def _refused_before_any_request(tmp_path, capsys, argv: list[str], said: str) -> None:
    """``argv`` (``{tmp}`` for ``tmp_path``, with ``in.png`` there) exits 2 with one line
    ``error: ...`` holding ``said``, and posts nothing to the server it is pointed at."""
    server = _Answering(200, "application/json", b"{}")
    try:
        (tmp_path / "in.png").write_bytes(b"")
        argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + ["--url", server.url]
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and said in err, err
        assert server.posts == 0
    finally:
        server.shutdown()


@pytest.mark.parametrize("argv, said", [
    (["generate", "a", "--seed", "1", "--extra", '{"seed": 2}'], "--extra: seed is set by --seed too"),
    (["generate", "a", "--steps", "4", "--extra", '{"extra_body": {"num_inference_steps": 8}}'],
     "--extra: num_inference_steps is set by --steps too"),
    (["generate", "a", "--size", "64x64", "--extra", '{"size": "32x32"}'], "--extra: size is set by --size too"),
    (["generate", "a", "--lora", "magenta", "--extra", '{"lora": [{"name": "other"}]}'],
     "--extra: lora is set by --lora too"),
    (["generate", "a", "--extra", '{"prompt": "b"}'], "--extra: prompt is set by PROMPT too"),
    (["generate", "a", "--extra", '{"response_format": "url"}'],
     "--extra: response_format 'url': the command reads b64_json"),
    (["edit", "{tmp}/in.png", "a", "--strength", "0.5", "--extra", '{"strength": 0.6}'],
     "--extra: strength is set by --strength too"),
    (["edit", "{tmp}/in.png", "a", "--extra", '{"image": "x"}'], "--extra: image is set by IMAGE too"),
    (["edit", "{tmp}/in.png", "a", "--mask", "{tmp}/in.png", "--extra", '{"mask": "x"}'],
     "--extra: mask is set by --mask too"),
    (["video", "a", "--seconds", "1", "--extra", '{"seconds": "2"}'], "--extra: seconds is set by --seconds too"),
    (["video", "a", "--input-reference", "{tmp}/in.png", "--extra", '{"extra_body": {"input_reference": "x"}}'],
     "--extra: input_reference is set by --input-reference too"),
])
def test_a_field_given_by_an_argument_and_by_extra_is_refused_before_any_request(tmp_path, capsys, argv, said):
    """``--seed 1 --extra '{"seed": 2}'`` ran with seed 1 (``--strength``, ``--lora`` the
    same; ``--extra``'s ``size`` or ``prompt`` silently won over the argument's): one of the
    two was dropped without a word."""
    output = "v.mp4" if argv[0] == "video" else "o.png"
    _refused_before_any_request(tmp_path, capsys, [*argv, "-o", f"{{tmp}}/{output}"], said)


def test_extra_fields_no_argument_sets_still_reach_the_request(tmp_path, capsys):
    """The check above refuses only fields an argument gave: ``--extra '{"seed": 2}'`` alone
    is sent as is."""
    server = _Answering(400, "application/json",
                        json.dumps({"error": {"message": "no", "type": "invalid_request_error", "code": "x"}}).encode())
    try:
        assert main(["generate", "a", "-o", str(tmp_path / "o.png"), "--url", server.url, "--steps", "3",
                     "--extra", '{"seed": 2}']) == 1
        sent = json.loads(server.bodies[0])
        assert (sent["seed"], sent["num_inference_steps"], sent["prompt"]) == (2, 3, "a")
    finally:
        server.shutdown()


def test_ctrl_c_while_a_video_job_runs_deletes_the_job_and_exits_130(tmp_path, capsys, monkeypatch):
    """Ctrl-C left the job running on the server (and printed a traceback). The progress bar,
    drawn once the first poll answers, is where the Ctrl-C lands here."""
    import tqdm

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tqdm, "tqdm", interrupted)
    job = {"id": "video_1", "object": "video", "status": "queued", "progress": 0, "model": "tiny-wan"}
    server = _Answering(200, "application/json", json.dumps(job).encode())
    try:
        assert main(["video", "a", "-o", str(tmp_path / "a.mp4"), "--url", server.url,
                     "--lora", "a", "--lora", "b:0.5"]) == 130
        assert server.requests == [("POST", "/v1/videos"), ("GET", "/v1/videos/video_1"),
                                   ("DELETE", "/v1/videos/video_1")]
        assert capsys.readouterr().err == "cancelled: video job video_1 deleted on the server\n"
        # a list of objects goes as JSON text in one form field: lora[][name], lora[][scale] cannot say whose
        assert b'name="lora"\r\n\r\n[{"name": "a"}, {"name": "b", "scale": 0.5}]\r\n' in server.bodies[0]

        def gone(*args, **kwargs):  # the server goes away: the DELETE is not answered
            server.shutdown()
            server.server_close()
            raise KeyboardInterrupt

        monkeypatch.setattr(tqdm, "tqdm", gone)
        assert main(["video", "a", "-o", str(tmp_path / "a.mp4"), "--url", server.url]) == 130
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("cancelled: video job video_1 may still run on the server")
    finally:
        server.shutdown()


def test_ctrl_c_while_the_server_creates_the_job_deletes_it_too(tmp_path, capsys, monkeypatch):
    """Ctrl-C after the server created the job but before its answer reached the CLI left the job
    running where nobody knew its id (stop 47's note). The create carries an Idempotency-Key:
    the CLI sends it again, which returns the job the server made (or makes one), and deletes it."""
    from openai.resources.videos import Videos

    create = Videos.create
    calls = []

    def answered_then_interrupted(self, *args, **kwargs):
        job = create(self, *args, **kwargs)  # the server made the job and answered...
        calls.append(job.id)
        if len(calls) == 1:
            raise KeyboardInterrupt  # ...and Ctrl-C came before the CLI saw the answer
        return job

    monkeypatch.setattr(Videos, "create", answered_then_interrupted)
    job = {"id": "video_1", "object": "video", "status": "queued", "progress": 0, "model": "tiny-wan"}
    server = _Answering(200, "application/json", json.dumps(job).encode())
    try:
        assert main(["video", "a", "-o", str(tmp_path / "a.mp4"), "--url", server.url]) == 130
        assert server.requests == [("POST", "/v1/videos"), ("POST", "/v1/videos"), ("DELETE", "/v1/videos/video_1")]
        first, again = server.idempotency_keys
        assert first and first == again  # the same request, so the server answers with the same job
        assert capsys.readouterr().err == "cancelled: video job video_1 deleted on the server\n"
    finally:
        server.shutdown()


def test_sigterm_while_a_video_job_runs_deletes_it_as_ctrl_c_does(tmp_path, capsys, monkeypatch):
    """SIGTERM (a kill, a job runner stopping the CLI) exited 143 with no line and left the job
    running on the server: now it ends as Ctrl-C does (the job deleted, one line, 130), and
    the process's own SIGTERM handler is back afterwards."""
    import signal
    import time

    import tqdm

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here, at once

    monkeypatch.setattr(tqdm, "tqdm", terminated)
    job = {"id": "video_1", "object": "video", "status": "queued", "progress": 0, "model": "tiny-wan"}
    server = _Answering(200, "application/json", json.dumps(job).encode())
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["video", "a", "-o", str(tmp_path / "a.mp4"), "--url", server.url]) == 130
        assert server.requests[-1] == ("DELETE", "/v1/videos/video_1")
        assert capsys.readouterr().err == "cancelled: video job video_1 deleted on the server\n"
        assert signal.getsignal(signal.SIGTERM) == before
    finally:
        server.shutdown()


def test_a_failure_is_one_line_under_python_m_too(tmp_path):
    """Run as ``python -m deployments.cli``, the OpenAI SDK's DeprecationWarning for its videos
    API (shown for __main__'s module there) added two lines before the error."""
    import subprocess
    import sys

    body = json.dumps({"error": {"message": "missing or invalid API key", "type": "invalid_request_error",
                                 "param": None, "code": "invalid_api_key"}}).encode()
    server = _Answering(401, "application/json", body)
    try:
        proc = subprocess.run([sys.executable, "-m", "deployments.cli", "video", "a", "-o", str(tmp_path / "a.mp4"),
                               "--url", server.url], capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error 401 invalid_api_key: missing or invalid API key"), proc.stderr


def test_a_server_gone_while_a_video_job_runs_is_not_called_a_missing_server(tmp_path, capsys, monkeypatch):
    """The server answered the create, then went away: the line said "no ditserve server at
    URL; start one" and never named the job."""
    import time

    job = {"id": "video_1", "object": "video", "status": "queued", "progress": 0, "model": "tiny-wan"}
    server = _Answering(200, "application/json", json.dumps(job).encode())
    sleep = time.sleep

    def gone(seconds):  # the poll's wait: the server stops listening
        server.shutdown()
        server.server_close()
        sleep(0)

    monkeypatch.setattr(time, "sleep", gone)
    assert main(["video", "a", "-o", str(tmp_path / "a.mp4"), "--url", server.url]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"error: the connection to {server.url} was lost while following video job video_1 (ConnectError)"), err


def _failed_video_line(server: _Answering, tmp_path, capsys) -> str:
    """The one line ``ditserve video`` prints against ``server`` (exit 1), the server then stopped."""
    try:
        assert main(["video", "a", "-o", str(tmp_path / "a.mp4"), "--url", server.url]) == 1
    finally:
        server.shutdown()
        server.server_close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_a_video_create_answered_without_a_job_id_is_one_line(tmp_path, capsys):
    """helper-48: a create answered 200 with ``null`` or a job without ``id`` was a traceback
    (``AttributeError`` / the SDK's ``Expected a non-empty value for video_id``)."""
    for body in (b"null", b'{"status": "queued"}', b'{"id": ""}'):
        err = _failed_video_line(_Answering(200, "application/json", body), tmp_path, capsys)
        assert "to the video create holds no job id" in err, (body, err)


def test_an_app_gone_while_a_video_job_runs_names_the_job_not_a_404(tmp_path, capsys, monkeypatch):
    """helper-47: a server stopping while ``ditserve video`` followed its job answered the polls
    with Serve's proxy 404 for a few seconds (no app at the path any more), and the line was
    ``error 404 http_404: the request failed with HTTP status 404``, naming no job. The job's own
    404 (``video_not_found``: deleted meanwhile) stays the server's envelope line."""
    import time

    from deployments.proxy import envelope_for

    job = {"id": "video_1", "object": "video", "status": "queued", "progress": 0, "model": "tiny-wan"}
    gone_job = json.dumps({"error": {"message": "no video job 'video_1' (unknown, deleted, or expired after its "
                                     "retention)", "type": "invalid_request_error", "param": "video_id",
                                     "code": "video_not_found"}}).encode()
    for answer, line in ((envelope_for(404), "stopped serving the app while following video job video_1 (HTTP 404"),
                         (gone_job, "error 404 video_not_found (video_id): no video job 'video_1'")):
        server = _Answering(200, "application/json", json.dumps(job).encode())
        monkeypatch.setattr(time, "sleep", lambda seconds, s=server, a=answer: setattr(
            s, "answer", (404, "application/json", a)))  # the poll's wait: the app goes away
        err = _failed_video_line(server, tmp_path, capsys)
        assert line in err, err


def test_ctrl_c_once_the_video_job_completed_keeps_it(tmp_path, capsys, monkeypatch):
    """Ctrl-C while the finished MP4 downloads deleted the job that had succeeded: now it stays."""
    from deployments import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_write", interrupted)
    job = {"id": "video_1", "object": "video", "status": "completed", "progress": 100, "model": "tiny-wan"}
    server = _Answering(200, "application/json", json.dumps(job).encode())
    try:
        assert main(["video", "a", "-o", str(tmp_path / "a.mp4"), "--url", server.url]) == 130
        assert server.requests == [("POST", "/v1/videos"), ("GET", "/v1/videos/video_1/content")]
        assert capsys.readouterr().err == "interrupted\n"
    finally:
        server.shutdown()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_write_that_fails_names_the_output(capsys):
    server = _Answering(200, "application/json", json.dumps({"created": 1, "data": [{"b64_json": _PNG}]}).encode())
    try:
        assert main(["generate", "a", "-o", "/dev/full", "--url", server.url]) == 1
        assert capsys.readouterr().err == f"error: /dev/full: {os.strerror(errno.ENOSPC)}\n"
    finally:
        server.shutdown()


def test_a_previews_directory_that_cannot_be_written_is_one_line_before_any_request(tmp_path, capsys):
    """A file made and removed there, not ``os.access``: root passes that even where the file
    system refuses (/sys/kernel: the request was sent, then the first preview failed)."""
    server = _Answering(200, "application/json", b"{}")
    try:
        for directory in ("/sys/kernel", "/proc/self"):
            if not Path(directory).is_dir():
                continue
            assert main(["generate", "a", "-o", str(tmp_path / "a.png"), "--url", server.url,
                         "--stream-previews", directory]) == 1
            assert capsys.readouterr().err.startswith(f"error: {directory}: ")
        assert server.posts == 0
    finally:
        server.shutdown()


class _Serving:
    """``ditserve serve ARGS`` in a subprocess, waited for up to its ``serving at URL`` line
    (at most ``timeout`` s)."""

    def __init__(self, *args: str, env: dict, timeout: float = 240):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "deployments.cli", "serve", *args], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        serving = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith("ditserve is serving at "):
                    self.url = line.split()[4]
                    serving.set()

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        if not serving.wait(timeout):
            self.proc.kill()
            raise AssertionError("".join(self.lines)[-4000:])

    def stop(self, timeout: float = 120) -> int:
        import signal

        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return rc


def _serve_env(**extra: str) -> dict:
    """This environment as a shell's (``ray.init`` in the tests set ``RAY_AUTH_MODE``), plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}, **extra}


def _serve_fails(*args: str, env: dict | None = None) -> str:
    """``ditserve serve ARGS`` that must fail at once: its error line (one, the last, exit 1)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "deployments.cli", "serve", *args], env=env or _serve_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error")]  # after Ray's INFO lines
    assert len(ours) == 1 and proc.stderr.endswith(ours[0] + "\n") and "Traceback" not in proc.stderr, \
        proc.stderr[-3000:]
    assert ".cc:" not in proc.stderr, proc.stderr[-3000:]  # Ray's C++ log lines (helper-81: a refused token's)
    return ours[0]


def test_serve_refuses_a_taken_port_and_an_address_nothing_answers_at_in_one_line():
    """Each was a long traceback, and an address nothing listens at was retried for ~14 minutes."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"cannot listen on 127.0.0.1:{port}" in _serve_fails("--port", str(port))
    # a Serve proxy that just stopped leaves its connections in TIME-WAIT: the port is free to the
    # next proxy's bind, and was refused for a minute or two (helper-32's review)
    from ray.serve._private.http_util import set_socket_reuse_port

    from deployments.cli import _port_free

    with socket.socket() as server:
        set_socket_reuse_port(server)  # as Serve's proxy binds
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with pytest.raises(CannotStart):  # listening: taken
            _port_free("127.0.0.1", port)
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's side closes first: TIME-WAIT is on the server's port
        time.sleep(0.1)
        client.close()
    _port_free("127.0.0.1", port)  # TIME-WAIT only
    with socket.socket() as serve_bind:  # and Serve agrees
        set_socket_reuse_port(serve_bind)
        serve_bind.bind(("127.0.0.1", port))
    nowhere = f"127.0.0.1:{free_port('127.0.0.1')}"
    assert f"no Ray cluster answers at {nowhere}" in _serve_fails("--address", nowhere)
    said = _serve_fails("--address", "http://127.0.0.1:8265")  # the dashboard's URL, as job submission takes
    assert "HOST:PORT" in said and "dashboard URL" in said
    assert "HOST:PORT" in _serve_fails(env=_serve_env(RAY_ADDRESS="nowhere"))


@pytest.mark.slow
def test_serve_starts_its_own_cluster_beside_a_running_one(ray_cluster, deploy, tmp_path):
    """A cluster already running on this machine (the tests') is left alone: ``ditserve serve``
    without ``--address`` starts its own, and Ctrl-C (SIGTERM) shuts down only that one. It used
    to join any running cluster, replace its ``ditserve`` application and shut its Serve down.
    (The grace is long so the running batch finishes on a slowed machine too: past it, the
    batch is stopped and answered 503, test_router.)"""
    import yaml
    from ray import serve

    deploy()
    before = serve.status().applications["ditserve"].deployments.keys()
    port = free_port("127.0.0.1")
    config = {"applications": [{"name": "ditserve", "route_prefix": "/", "import_path": "deployments.app:build_app",
                                "args": {"replica": {"graceful_shutdown_timeout_s": 300}}}]}
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    server = _Serving("--config", str(tmp_path / "serve.yaml"), "--host", "0.0.0.0", "--port", str(port),
                      env=_serve_env())
    try:  # Serve listens on every interface; the URL printed is one to open here
        assert server.url == f"http://127.0.0.1:{port}" and not any("joined" in ln for ln in server.lines)
        # where a Python caller of the handle connects (helper-42: "auto" found another cluster)
        wait_until(lambda: any(ln.startswith("its Ray cluster: ") for ln in server.lines), timeout=30)
        [said] = [ln for ln in server.lines if ln.startswith("its Ray cluster: ")]
        address = said.split()[3]
        assert f"ray.init(address='{address}')" in said and address != ray_cluster["gcs_address"]
        assert httpx.get(f"{server.url}/v1/models", timeout=60).status_code == 200
        assert set(serve.status().applications) == {"ditserve"}  # nothing deployed into this cluster
        # Requests in flight at SIGTERM are each answered: the running batch finishes, the queued
        # ones get 503 (Serve's shutdown stopped its proxy first: every connection dropped unanswered)
        router = lambda: httpx.get(f"{server.url}/v1/stats", timeout=30).json()["router"]  # noqa: E731
        post = lambda i, steps=20: pool.submit(  # noqa: E731
            httpx.post, f"{server.url}/v1/images/generations", timeout=360,
            json={"prompt": f"p{i}", "seed": i, "num_inference_steps": steps, "size": "256x256"})
        with ThreadPoolExecutor(6) as pool:
            # one batch running, five requests queued behind it: every request reached the Router
            # before SIGTERM (one still on its way from the Ingress when the Router stopped waited in
            # Serve's handle until the Ingress's grace ended, then 500: stop 48's "not fixed")
            calls = [post(0, steps=40)]  # long enough for the five to queue behind it
            wait_until(lambda: router()["inflight_batches"] == 1 and not router()["unstarted_batches"], timeout=60)
            calls += [post(i) for i in range(1, 6)]
            wait_until(lambda: router()["queued"] == 5, timeout=60)
            # the batch may take the whole grace on a slowed machine (Serve's serve.delete gave up
            # after 60 s: a traceback and exit 1, fixed in stop_app)
            assert server.stop(timeout=360) == 0, "".join(server.lines)[-4000:]
            answers = [call.result() for call in calls]  # raised on a dropped connection
        assert {r.status_code for r in answers} <= {200, 503} and 200 in {r.status_code for r in answers}
        assert all(r.headers.get("retry-after") for r in answers if r.status_code == 503)
    finally:
        if server.proc.poll() is None:
            assert server.stop() == 0, "".join(server.lines)[-4000:]
    assert serve.status().applications["ditserve"].status == "RUNNING"
    assert serve.status().applications["ditserve"].deployments.keys() == before
    assert httpx.get(f"{ray_cluster['url']}/v1/models", timeout=60).status_code == 200


@pytest.mark.slow
def test_serve_joins_the_cluster_given_and_removes_only_its_application(ray_cluster, deploy, tmp_path):
    """``--address`` deploys into that cluster; its Serve keeps its own HTTP options (the URL
    printed is the one it listens on, with a note that ``--port`` is unused) and Ctrl-C deletes
    only the application deployed, not the cluster's others or its Serve. An application of the
    same name there is not replaced (it was, then deleted on Ctrl-C)."""
    import yaml
    from ray import serve

    deploy()
    # the tests' cluster has token authentication: joined without RAY_AUTH_MODE (or with a wrong
    # token), the line says so and what to set, at once (it was a traceback, then one line after
    # ray.init's ~20 s of retries)
    said = _serve_fails("--address", ray_cluster["gcs_address"])
    assert "refuses this process (" in said and "Authentication token is missing or incorrect" in said, said
    assert "set RAY_AUTH_MODE=token" in said
    said = _serve_fails("--address", ray_cluster["gcs_address"], env=_serve_env(RAY_AUTH_MODE="disabled"))
    assert "refuses this process (" in said and "set RAY_AUTH_MODE=token" in said, said  # no token is sent
    said = _serve_fails("--address", ray_cluster["gcs_address"],
                        env=_serve_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-the-clusters-token"))
    assert "refuses this process (" in said and "give this process the cluster's token" in said, said
    auth = _serve_env(RAY_AUTH_MODE="token")
    said = _serve_fails("--address", ray_cluster["gcs_address"], env=auth)  # the default config: 'ditserve'
    assert "an application named 'ditserve' already runs" in said
    assert serve.status().applications["ditserve"].status == "RUNNING"
    # another name at the route prefix 'ditserve' serves: Serve's reason, not its controller's frame (helper-81)
    other = {"applications": [{"name": "other", "route_prefix": "/", "import_path": "deployments.app:build_app"}]}
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(other))
    said = _serve_fails("--address", ray_cluster["gcs_address"], "--config", str(tmp_path / "other.yaml"), env=auth)
    assert "Serve refused application 'other': Prefix / is being used by application \"ditserve\"" in said, said
    assert "ServeController" not in said and "other" not in serve.status().applications
    config = {"http_options": {"request_timeout_s": 300},  # the running Serve keeps its own: a note says so
              "applications": [{"name": "cli-joined", "route_prefix": "/joined",
                                "import_path": "deployments.app:build_app",
                                "args": {"replica": {"ray_actor_options": {"num_cpus": 0}, "torch_threads": 1}},
                                # the file's deployments section applies as with `serve deploy` (it was dropped)
                                "deployments": [{"name": "Router", "user_config": {"max_batch_size": 3}}]}]}
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
    unused = free_port("127.0.0.1")
    server = _Serving("--address", ray_cluster["gcs_address"], "--config", str(tmp_path / "serve.yaml"),
                      "--port", str(unused), env=auth)
    try:
        assert server.url == f"{ray_cluster['url']}/joined", server.lines
        said = "".join(server.lines)
        assert "joined the Ray cluster" in said and f":{unused} is not used" in said, said
        assert "keeps its own options: the file's http_options.request_timeout_s is not applied" in said, said
        assert httpx.get(f"{server.url}/v1/models", timeout=60).status_code == 200
        assert serve.status().applications["cli-joined"].status == "RUNNING"
        assert httpx.get(f"{server.url}/v1/stats", timeout=60).json()["router"]["batching"]["max_batch_size"] == 3
    finally:
        assert server.stop() == 0, "".join(server.lines)[-4000:]
    assert "cli-joined" not in serve.status().applications
    assert serve.status().applications["ditserve"].status == "RUNNING"
    assert httpx.get(f"{ray_cluster['url']}/v1/models", timeout=60).status_code == 200


@pytest.mark.parametrize("command", ["generate", "edit", "video"])
def test_ctrl_c_in_a_client_command_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path, command):
    """Ctrl-C while a client command waits (before a video job exists, or during an image
    request) printed a traceback; now one line and 130, as a shell reports Ctrl-C."""
    from deployments import cli

    def interrupted(_ns):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, f"_cmd_{command}", interrupted)
    args = {"generate": ["generate", "a star", "-o", str(tmp_path / "x.png")],
            "edit": ["edit", str(tmp_path / "in.png"), "a star", "-o", str(tmp_path / "x.png")],
            "video": ["video", "a star", "-o", str(tmp_path / "x.mp4")]}[command]
    assert cli.main(args) == 130
    assert capsys.readouterr().err == "interrupted\n"


def _tiny_cpu_config(mutate) -> dict:
    """``configs/tiny-cpu.yaml`` as a dict, changed by ``mutate(config, app)``."""
    import yaml

    config = yaml.safe_load((Path(__file__).parent.parent / "configs" / "tiny-cpu.yaml").read_text())
    mutate(config, config["applications"][0])
    return config


@pytest.mark.parametrize("mutate, said", [
    (lambda c, a: a["args"]["batching"].update(max_batchsize=4),
     "args.batching.max_batchsize: no such field (did you mean 'max_batch_size'?); the fields there: max_batch_size,"),
    (lambda c, a: a["args"]["batching"].update(max_batch_size=0), "args.batching.max_batch_size: Input should be"),
    (lambda c, a: a.update(deployments=[{"name": "Router", "user_config": {"max_batch_size": 0}}]),
     "Router's user_config: max_batch_size: Input should be"),
    (lambda c, a: a.update(deployments=[{"name": "Ingress", "user_config": {"acceleration": {"cfg_gate_step": 2}}}]),
     "Ingress's user_config: cfg_gate_step: Input should be"),
    (lambda c, a: a.update(deployments=[{"name": "DiTReplica", "num_replica": 2}]),
     "unknown option applications[0].deployments[0].num_replica"),
    (lambda c, a: a.update(deployments=[{"name": "DiTReplica", "ray_actor_options": {"num_cpu": 1}}]),
     "unknown option applications[0].deployments[0].ray_actor_options.num_cpu"),
    (lambda c, a: c.update(http_option={"port": 1}), "unknown option http_option"),
    (lambda c, a: a.update(deployments=[{"name": "Routr", "user_config": {}}]), "no deployment named 'Routr'"),
    (lambda c, a: a.update(deployments=[{"name": "Router"}, {"name": "Router", "user_config": {}}]),
     "error: bad config: deployments: Router has more than one entry"),
    # a second Router answered 404 for the first one's video jobs (helper-20's review)
    (lambda c, a: a.update(deployments=[{"name": "Router", "num_replicas": 2}]),
     "error: bad config: deployments: Router runs as one replica"),
    (lambda c, a: a.update(deployments=[{"name": "Router", "autoscaling_config": {"max_replicas": 3}}]),
     "error: bad config: deployments: Router runs as one replica"),
    (lambda c, a: a.update(deployments=[{"name": "Router", "user_config": {"max_batch_size": True}}]),
     "Router's user_config: max_batch_size: takes a number, not true"),
    (lambda c, a: a.update(deployments=[{"name": "Router", "user_config": {"max_queued_requests": 10**23}}]),
     "Router's user_config: max_queued_requests: must be at most 2147483647"),
    (lambda c, a: a["args"].update(batching={"max_queued_requests": 10**23}),
     "args.batching.max_queued_requests: must be at most 2147483647"),
    (lambda c, a: a["args"].update(batching={"max_wait_ms": float("inf")}),
     "args.batching.max_wait_ms: Input should be a finite number"),
    # an adapter only the Ingress had was never checked: its requests failed 500 lora_load_failed
    (lambda c, a: a.update(deployments=[{"name": "Ingress", "user_config": {"loras": {
        "magenta": {}, "outline": {}, "x": {"path": "/nonexistent.safetensors"}}}}]),
     "error: bad config: deployments: the Ingress's and DiTReplica's adapter registries (user_config.loras, else "
     "model.loras) differ at x: give both the same loras"),
    # default Cache-DiT knobs past limits.default_steps deployed, then refused every request running them (helper-60)
    (lambda c, a: a["args"].update(acceleration={"enable_cache_dit": True,
                                                 "cache_dit_params": {"max_warmup_steps": 50}}),
     "acceleration.cache_dit_params does not fit limits.default_steps: cache_dit_params.max_warmup_steps must be at "
     "most num_inference_steps (16), got 50"),
    (lambda c, a: a.update(deployments=[{"name": "Ingress", "user_config": {"acceleration": {
        "enable_cache_dit": True, "cache_dit_params": {"max_warmup_steps": 50}}}}]),
     "Ingress's user_config: acceleration.cache_dit_params does not fit limits.default_steps"),
    (lambda c, a: c["http_options"].update(port="eighty"), "http_options.port: Input should be a valid integer"),
    (lambda c, a: c["http_options"].update(port=99999), "cannot listen on port 99999: a port is 1-65535"),
    # helper-48: port 0 passed, and serve printed http://127.0.0.1:0 while Serve listened elsewhere
    (lambda c, a: c["http_options"].update(port=0), "cannot listen on port 0: a port is 1-65535 (0, a port the OS "
                                                    "picks, is not one a client can be given)"),
    # helper-48: pydantic's lax mode read port: true as port 1
    (lambda c, a: c["http_options"].update(port=True), "http_options.port: takes a number, not true"),
    (lambda c, a: a.update(deployments=[{"name": "DiTReplica", "num_replicas": True}]),
     "applications.0.deployments.0.num_replicas: takes a number, not true"),
    (lambda c, a: a.update(deployments=[None]), "not a Serve config"),
    (lambda c, a: a.update(deployments=[{"name": "Ingress", "user_config": {"loras": [1]}}]),
     "Ingress's user_config.loras must be a mapping"),
    (lambda c, a: a.update(deployments=[{"name": "DiTReplica", "user_config": {"loras": [1]}}]),
     "DiTReplica's user_config.loras must be a mapping"),
    (lambda c, a: a.update(deployments=[{"name": "Ingress", "user_config": {"loras": {}, "enable_cache_dit": True}}]),
     "Ingress's user_config has enable_cache_dit beside its sections (acceleration, loras): with sections an "
     "acceleration field goes under acceleration"),
    (lambda c, a: a.update(deployments=[{"name": "Ingress", "user_config": {"loras": {}, "bogus": True}}]),
     "Ingress's user_config has no bogus (it takes acceleration, loras)"),
    (lambda c, a: a.update(deployments=[{"name": "DiTReplica", "user_config": {"lorass": {}}}]),
     "DiTReplica's user_config has no lorass"),
    (lambda c, a: a.update(deployments=[{"name": "Ingress", "user_config": {"attention_backend": "fa"}}]),
     "Ingress's user_config: acceleration.attention_backend='fa' cannot run"),
    (lambda c, a: a.update(deployments=[{"name": "DiTReplica",
                                         "autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}]),
     "error: bad config: deployments: DiTReplica's autoscaling_config: "),
    # helper-32's review: each passed --check; scaled to zero, no replica ever came back (requests hung)
    (lambda c, a: a.update(deployments=[{"name": "DiTReplica", "autoscaling_config": {
        "min_replicas": 0, "initial_replicas": 1, "max_replicas": 2}}]),
     "DiTReplica's autoscaling_config.min_replicas must be at least 1, got 0"),
    # a traceback ending in ModuleNotFoundError
    (lambda c, a: a.update(deployments=[{"name": "DiTReplica", "autoscaling_config": {
        "max_replicas": 2, "policy": {"policy_function": "nope.nope:f"}}}]),
     "serve.yaml: applications[0].deployments[0].autoscaling_config.policy.policy_function: cannot import "
     "'nope.nope:f' (No module named 'nope')"),
    # a module missing from a package (helper-82: the field was not named)
    (lambda c, a: a.update(deployments=[{"name": "DiTReplica", "request_router_config": {
        "request_router_class": "deployments.nope:R"}}]),
     "applications[0].deployments[0].request_router_config.request_router_class: cannot import 'deployments.nope:R' "
     "(No module named 'deployments.nope')"),
    # a name its module lacks (helper-81: "not a Serve config ... an entry may be null or of the wrong type")
    (lambda c, a: a.update(deployments=[{"name": "DiTReplica", "autoscaling_config": {
        "max_replicas": 2, "policy": {"policy_function": "deployments.autoscaling:NoSuchPolicy"}}}]),
     "applications[0].deployments[0].autoscaling_config.policy.policy_function: cannot import "
     "'deployments.autoscaling:NoSuchPolicy' (module 'deployments.autoscaling' has no attribute 'NoSuchPolicy')"),
    (lambda c, a: a.update(deployments=[{"name": "DiTReplica", "request_router_config": {
        "request_router_class": "deployments.replica_chooser:NoSuchRouter"}}]),
     "applications[0].deployments[0].request_router_config.request_router_class: cannot import "),
    # a MemoryError (a list of 2**60 bundles)
    (lambda c, a: a["args"].update(parallel={"ulysses_degree": 2**30, "ring_degree": 2**30}),
     "world_size = cfg_degree x ulysses_degree x ring_degree = 1152921504606846976: at most 1024"),
    # Serve refused "Value out of range: 2400000260", naming nothing
    (lambda c, a: (a["args"]["replica"].pop("num_replicas"),
                   a["args"]["replica"].update(autoscaling={"min_replicas": 1, "max_replicas": 300_000_000})),
     "more requests than Serve's max_ongoing_requests holds (2147483647)"),
    # defaults past their limits ran for every request that left the field out
    (lambda c, a: a["args"].update(limits={"default_steps": 150}), "default_steps 150 > max_steps 100"),
    # these were one line only at the replica's start (after --check passed them)
    (lambda c, a: a["args"]["model"].update(family="sdxl"), "args.model.family: unknown model family"),
    (lambda c, a: a["args"]["model"].update(device="tpu"),
     "args.model.device: 'tpu' is not a device ditserve runs on; use cpu, cuda or cuda:N"),
    # the allowed values, not pydantic's regular expression (helper-43)
    (lambda c, a: a["args"]["model"].update(dtype="fp16"), "args.model.dtype: Input should be 'float32', 'bfloat16' "
                                                           "or 'float16'"),
    # an embedded name misspelt passed --check and failed every replica's start (helper-43)
    (lambda c, a: a["args"]["model"].update(name="tiny-flx", path=None),
     "args.model: name 'tiny-flx' is not an embedded model (tiny-flux, "),
    # each passed --check and failed each replica's start (helper-32's review)
    (lambda c, a: a["args"].update(acceleration={"torch_compile": True, "compile_backend": "indcutor"}),
     "args.acceleration.compile_backend: torch 2"),
    (lambda c, a: a.update(deployments=[{"name": "DiTReplica", "autoscaling_config": {"look_back_period_s": 5}}]),
     "DiTReplica's autoscaling_config.look_back_period_s (5.0) must be greater than metrics_interval_s (10.0)"),
    (lambda c, a: a["args"].update(limits={"default_size": "512x512", "max_pixels": 4096}),
     "default_size 512x512 is 262144 pixels > max_pixels 4096"),
    # each passed --check; Serve refused it only as it deployed, or the Ingress never started (helper-64)
    (lambda c, a: a.update(route_prefix="images"), "applications[0].route_prefix: Invalid route_prefix 'images', "
                                                   "must start with a forward slash"),
    (lambda c, a: a.update(route_prefix="/images/"), "may not end with a trailing '/'"),
    (lambda c, a: a.update(runtime_env={"env_vars": {"DITSERVE_API_KEYS": 12345}}),
     "applications[0].runtime_env.env_vars.DITSERVE_API_KEYS: Ray takes strings only, got int 12345; quote it in "
     "the file, as written"),
    (lambda c, a: a.update(deployments=[{"name": "Ingress", "ray_actor_options": {"runtime_env": {
        "env_vars": {"A": True}}}}]), "deployments[0].ray_actor_options.runtime_env.env_vars.A: Ray takes strings"),
    (lambda c, a: a["args"].update(auth={"api_keys_env": ""}), "args.auth.api_keys_env: an environment "
                                                               "variable's name"),
    (lambda c, a: a["args"].update(auth={"batch_api_keys_file": " "}), "a file's path, got an empty one"),
    (lambda c, a: a.update(autoscaling_policy={"policy_function": "deployments.autoscaling:RouterQueuePolicy"}),
     "applications[0].autoscaling_policy: an application-level policy replaces DiTReplica's own"),  # helper-65
    # batching silently off: each request ran alone (helper-64)
    (lambda c, a: a.update(deployments=[{"name": "Router", "max_ongoing_requests": 1}]),
     "deployments: Router's max_ongoing_requests 1 is below 268: the 264 requests the application admits and 4 "
     "stats and health calls"),
])
def test_serve_config_mistakes_are_one_line_before_any_cluster_starts(tmp_path, capsys, monkeypatch, mutate, said):
    """A mistake in ``--config`` (bad ``args``, a bad ``user_config`` or misspelt option in the
    ``deployments`` section, a bad Serve option) is one line naming the field, exit 1, before
    ``ray.init``: bad args printed "1 validation error for AppConfig" after the cluster started, a
    Router ``max_batch_size: 0`` a replica's 30-line traceback, ``num_replica`` was dropped silently."""
    import ray
    import yaml

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a cluster was started"))
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(_tiny_cpu_config(mutate)))
    assert main(["serve", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and said in err, err
    assert main(["serve", "--config", str(path), "--check"]) == 1  # the same, asked for before a serve deploy
    assert capsys.readouterr().err == err


def test_a_fifo_as_output_is_not_opened_before_the_image_comes(tmp_path):
    """helper-49: the write check opened a FIFO for appending, which ended its reader (``cat``
    saw end-of-file) or waited for one, so the real write later blocked for ever."""
    from deployments.cli import writable

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    checked = []
    worker = threading.Thread(target=lambda: checked.append(writable(fifo)), daemon=True)
    worker.start()
    worker.join(10)
    assert checked == [fifo] and not worker.is_alive()


def test_a_key_given_twice_in_a_serve_config_and_a_wrong_host_are_one_line(tmp_path, capsys, monkeypatch):
    """helper-48: ``port: 8000`` then ``port: 9000`` passed (PyYAML keeps the last, unsaid), as
    Serve reads the file; a --host no interface has said "choose another --port"; --port 0 and
    --host '' fell back to the config's."""
    import ray
    import yaml

    from deployments.cli import _port_free

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a cluster was started"))
    text = yaml.safe_dump(_tiny_cpu_config(lambda c, a: None))
    path = tmp_path / "serve.yaml"
    path.write_text(text.replace("http_options:\n", "http_options:\n  port: 9000\n", 1))
    for argv in (["serve", "--config", str(path)], ["serve", "--config", str(path), "--check"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {path} is not valid YAML at line ") and (
            "the key 'port' is given twice") in err, err
    for host in ("999.1.1.1", "10.255.255.254"):  # no such name; no interface here has it
        with pytest.raises(CannotStart, match="; choose another --host$"):
            _port_free(host, free_port("127.0.0.1"))
    assert main(["serve", "--port", "0"]) == 1
    assert "cannot listen on port 0: a port is 1-65535" in capsys.readouterr().err
    assert main(["serve", "--host", ""]) == 1
    assert capsys.readouterr().err.startswith("error: --host '': give the address to listen on")
    path.write_text(text.replace("http_options:\n", "http_options:\n  host: ''\n", 1).replace("  host: 127", "  #", 1))
    for argv in (["serve", "--config", str(path)], ["serve", "--config", str(path), "--check"]):
        assert main(argv) == 1  # helper-49: the file's empty host was blamed on --host, and --check passed it
        assert capsys.readouterr().err.startswith("error: http_options.host '': give the address to listen on")
    # YAML's merge key may override what it merges, also in an anchored mapping merged elsewhere
    # (helper-49: refused, 'log_level' given twice, as SafeLoader had rewritten its keys in place)
    text = yaml.safe_dump(_tiny_cpu_config(lambda c, a: a.update(
        deployments=[{"name": "DiTReplica", "logging_config": "MERGED"}])))
    path.write_text(text.replace("logging_config: MERGED", "logging_config: &debug {<<: &base {encoding: TEXT, "
                                 "log_level: INFO}, log_level: DEBUG}") + "logging_config: {<<: *debug}\n")
    assert main(["serve", "--config", str(path), "--check"]) == 0, capsys.readouterr().err
    capsys.readouterr()


@pytest.mark.parametrize("var, value, said", [
    ("DITSERVE_CACHE_DIT_PARAMS", "[1]", "DITSERVE_CACHE_DIT_PARAMS='[1]' (the acceleration.cache_dit_params default): "
                                         "cache_dit_params: Input should be a valid dictionary"),
    ("DITSERVE_CACHE_DIT_PARAMS", '{"Fn_compute_blocks": 0}', "cache_dit_params.Fn_compute_blocks: Input should be"),
    ("DITSERVE_CFG_GATE_STEP", "7", "DITSERVE_CFG_GATE_STEP='7' (the acceleration.cfg_gate_step default)"),
    ("DITSERVE_CFG_GATE_STEP", "soon", "DITSERVE_CFG_GATE_STEP='soon': could not convert"),
    ("DITSERVE_ATTENTION_BACKEND", "flash", "DITSERVE_ATTENTION_BACKEND='flash' (the acceleration.attention_backend"),
    # a check across fields (helper-36's review: "args: ...", no variable named)
    ("DITSERVE_ATTENTION_BACKEND", "fa", "with DITSERVE_ATTENTION_BACKEND='fa' set in the environment (the file "
                                         "alone passes); args: acceleration.attention_backend='fa'"),
    ("DITSERVE_ENABLE_CACHE_DIT", "maybe", "DITSERVE_ENABLE_CACHE_DIT='maybe': must be true or false"),  # was false
    ("DITSERVE_TORCH_COMPILE", "2", "DITSERVE_TORCH_COMPILE='2': must be true or false"),
])
def test_a_bad_acceleration_variable_is_named(tmp_path, capsys, monkeypatch, var, value, said):
    """A ``DITSERVE_*`` variable's value the config refuses names the variable (helper-32's review:
    ``DITSERVE_CACHE_DIT_PARAMS='[1]'`` said "args.acceleration.cache_dit_params", a field the
    file did not give)."""
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a cluster was started"))
    monkeypatch.setenv(var, value)
    path = Path(__file__).parent.parent / "configs" / "tiny-cpu.yaml"
    assert main(["serve", "--config", str(path), "--check"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err, err


def _two_apps(second_args: dict) -> dict:
    """``configs/tiny-cpu.yaml`` with a second ditserve application, ``second`` at ``/b``."""
    import copy

    def add(config, app):
        other = copy.deepcopy(app)
        other.update(name="second", route_prefix="/b", args=second_args)
        config["applications"].append(other)

    return _tiny_cpu_config(add)


def test_check_checks_every_ditserve_application_and_serve_refuses_several(tmp_path, capsys, monkeypatch):
    """helper-43: ``--check`` checked the file's first ditserve application only (a second one's
    ``max_batch_size: 5000`` passed), and ``ditserve serve`` ran the first and silently left
    the others out."""
    import ray
    import yaml

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a cluster was started"))
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(_two_apps({"batching": {"max_batch_size": 5000}})))
    assert main(["serve", "--config", str(path), "--check"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: application 'second': bad application args: args.batching.max_batch_size") and \
        err.count("\n") == 1, err
    dotted = _two_apps({"batching": {"max_batch_size": 5000}})  # Serve's other import path form (helper-44)
    dotted["applications"][1]["import_path"] = "deployments.app.build_app"
    path.write_text(yaml.safe_dump(dotted))
    assert main(["serve", "--config", str(path), "--check"]) == 1
    assert "application 'second': bad application args" in capsys.readouterr().err
    path.write_text(yaml.safe_dump(_two_apps({"batching": {"max_batch_size": 2}, "limits": {"max_n": 2}})))
    assert main(["serve", "--config", str(path), "--check"]) == 0
    assert "applications 'ditserve', 'second' pass ditserve's checks" in capsys.readouterr().out
    assert main(["serve", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "has 2 applications ('ditserve', 'second'); `ditserve serve` runs one ditserve application" in err, err


def test_serve_refuses_an_application_field_it_would_not_apply(tmp_path, capsys, monkeypatch):
    """helper-46: an application's ``runtime_env`` (where the README says API keys may go) was
    dropped without a word by ``ditserve serve``, which deploys in-process; ``--check`` still
    passes such a file (``serve run`` applies it)."""
    import ray
    import yaml

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a cluster was started"))
    config = _tiny_cpu_config(lambda c, app: app.update(runtime_env={"env_vars": {"DITSERVE_API_KEYS": "k1"}}))
    path = tmp_path / "env.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["serve", "--config", str(path), "--check"]) == 0
    capsys.readouterr()
    assert main(["serve", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == (f"error: {path}: applications[0].runtime_env: `ditserve serve` deploys the application "
                   f"in-process and does not apply this field; deploy the file with `serve run {path}` (or `serve "
                   "deploy`), or leave it out\n"), err


def test_serve_gives_serve_start_the_files_serve_wide_fields_and_refuses_those_it_cannot(tmp_path, capsys,
                                                                                        monkeypatch):
    """helper-81: ``ditserve serve`` started Serve with ``http_options``' host and port only, so
    the file's ``request_timeout_s``, ``keep_alive_timeout_s``, ``proxy_location``,
    ``grpc_options`` and ``target_capacity`` were dropped without a word (``--check`` passed
    them, as it should: ``serve deploy`` applies them). Now those ``serve.start`` takes are
    given to it, and the rest refused naming them; ``--check`` still passes all."""
    import ray
    import yaml

    from deployments.cli import load_serve_config

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a cluster was started"))
    http = {"request_timeout_s": 1.5, "keep_alive_timeout_s": 7}
    given = _tiny_cpu_config(lambda c, app: (c["http_options"].update(http),
                                             c.update(proxy_location="HeadOnly", target_capacity=None,
                                                      logging_config={"log_level": "WARNING"})))
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(given))
    options = load_serve_config(path)["serve_options"]
    assert options["http_options"] == {**given["http_options"], **http}, options
    assert options["proxy_location"] == "HeadOnly" and options["logging_config"]["log_level"] == "WARNING", options
    assert "target_capacity" not in options  # null: not given (helper-82: it was refused)
    for mutate, field in ((lambda c, app: c.update(target_capacity=50), "target_capacity"),
                          # ditserve serves no gRPC; the servicers and the exporter are import paths
                          # that failed only once Serve started (helper-82)
                          (lambda c, app: c.update(grpc_options={"port": 9123}), "grpc_options"),
                          (lambda c, app: c.update(tracing_config={"exporter_import_path": "nope:f"}),
                           "tracing_config"),
                          (lambda c, app: c.update(proxy_location="Disabled"), "proxy_location"),
                          (lambda c, app: c["http_options"].update(ssl_certfile="/x.pem", ssl_keyfile="/x.key"),
                           "http_options.ssl_keyfile, http_options.ssl_certfile")):
        path.write_text(yaml.safe_dump(_tiny_cpu_config(mutate)))
        assert main(["serve", "--config", str(path), "--check"]) == 0
        capsys.readouterr()
        assert main(["serve", "--config", str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}: {field}: `ditserve serve` deploys the application in-process and "
                              f"does not apply {'these fields' if ', ' in field else 'this field'};"), err


def test_check_notes_key_sources_this_machine_cannot_confirm(tmp_path, capsys, monkeypatch):
    """A key variable unset here (and not in the application's runtime_env) or a key file
    missing here passes ``--check`` (the Ingress reads them where it runs) with a note each
    (helper-59: without a word, then the Ingress did not start)."""
    import ray
    import yaml

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a cluster was started"))
    monkeypatch.delenv("DITSERVE_TEST_UNSET_KEYS", raising=False)
    config = _tiny_cpu_config(lambda c, app: app["args"].update(auth={
        "api_keys_env": "DITSERVE_TEST_UNSET_KEYS", "batch_api_keys_file": str(tmp_path / "missing")}))
    path = tmp_path / "auth.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["serve", "--config", str(path), "--check"]) == 0
    notes = capsys.readouterr().err.splitlines()
    assert notes == [
        "note: application 'ditserve': auth.api_keys_env names DITSERVE_TEST_UNSET_KEYS, unset here and not in the "
        "application's runtime_env.env_vars: the Ingress reads it in its Ray node's environment, and does not start "
        "where it holds no key",
        f"note: application 'ditserve': auth.batch_api_keys_file {tmp_path / 'missing'} is not a file here: the "
        "Ingress reads it on its own node, and does not start where it is missing"], notes
    monkeypatch.setenv("DITSERVE_TEST_UNSET_KEYS", "k1")
    (tmp_path / "missing").write_text("k2\n")
    assert main(["serve", "--config", str(path), "--check"]) == 0
    assert capsys.readouterr().err == ""
    # the variable in the application's runtime_env: no note on it (the note came all the same:
    # the runtime_env was not passed to the check), but one on the deployments the section leaves
    # out, which Serve restarts the first time an entry names them (helper-64)
    monkeypatch.delenv("DITSERVE_TEST_UNSET_KEYS")
    config["applications"][0]["runtime_env"] = {"env_vars": {"DITSERVE_TEST_UNSET_KEYS": "k1"}}
    config["applications"][0]["deployments"] = [{"name": "Router", "user_config": {"max_batch_size": 2}}]
    path.write_text(yaml.safe_dump(config))
    assert main(["serve", "--config", str(path), "--check"]) == 0
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 1 and notes[0].startswith(
        "note: application 'ditserve': the application has a runtime_env and its deployments section leaves out "
        "Ingress, DiTReplica: Serve merges the runtime_env"), notes
    config["applications"][0]["deployments"] += [{"name": "Ingress"}, {"name": "DiTReplica"}]
    path.write_text(yaml.safe_dump(config))
    assert main(["serve", "--config", str(path), "--check"]) == 0
    assert capsys.readouterr().err == ""
    # the variable in the Ingress entry's runtime_env, which Serve merges over the application's
    del config["applications"][0]["runtime_env"]
    config["applications"][0]["deployments"][1]["ray_actor_options"] = {
        "runtime_env": {"env_vars": {"DITSERVE_TEST_UNSET_KEYS": "k1"}}}
    path.write_text(yaml.safe_dump(config))
    assert main(["serve", "--config", str(path), "--check"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("mutate, said", [
    (lambda c, a: a["args"]["model"].update(device="cuda"),
     "model.device is 'cuda' but DiTReplica asks Ray for no GPU"),
    (lambda c, a: a["args"]["replica"].update(ray_actor_options={"num_cpus": 1, "num_gpus": 1}),
     "model.device is 'cpu' but DiTReplica asks Ray for 1 GPU(s), which it reserves and never uses"),
    (lambda c, a: (a["args"]["model"].update(device="cuda"),
                   a.update(deployments=[{"name": "DiTReplica", "ray_actor_options": {"num_gpus": 1}}])), None),
    (lambda c, a: (a["args"]["model"].update(device="cuda"), a["args"].update(parallel={"ulysses_degree": 2}),
                   a["args"]["replica"].update(rank_resources={"CPU": 1, "GPU": 1})), None),
])
def test_check_notes_a_device_the_replicas_resources_do_not_match(tmp_path, capsys, monkeypatch, mutate, said):
    """helper-64: ``model.device: cuda`` with no GPU asked of Ray (the replica uses a GPU Ray did
    not reserve, on whatever node it lands) and ``cpu`` with a GPU asked passed without a word."""
    import ray
    import yaml

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a cluster was started"))
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(_tiny_cpu_config(mutate)))
    assert main(["serve", "--config", str(path), "--check"]) == 0
    notes = capsys.readouterr().err.splitlines()
    if said is None:  # the GPU asked by a deployments entry, or per rank
        assert notes == [], notes
    else:
        assert len(notes) == 1 and notes[0].startswith(f"note: application 'ditserve': {said}"), notes


def test_a_bad_variable_does_not_hide_the_files_own_mistakes(tmp_path, capsys, monkeypatch):
    """Both named, each where it comes from (helper-36's review: the file's error was dropped)."""
    import ray
    import yaml

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a cluster was started"))
    monkeypatch.setenv("DITSERVE_CFG_GATE_STEP", "2")
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(_tiny_cpu_config(lambda c, a: a["args"].update(acceleration={"bogus": 1}))))
    assert main(["serve", "--config", str(path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "DITSERVE_CFG_GATE_STEP='2' (the acceleration.cfg_gate_step default)" in err, err
    assert "args.acceleration.bogus: no such field; the fields there: enable_cache_dit," in err, err
    monkeypatch.delenv("DITSERVE_CFG_GATE_STEP")
    assert main(["serve", "--config", str(path), "--check"]) == 1  # without it: pydantic's, as before
    assert "bad application args: args.acceleration.bogus: no such field" in capsys.readouterr().err


@pytest.mark.parametrize("config", sorted(p.name for p in (Path(__file__).parent.parent / "configs").glob("*.yaml")))
def test_serve_check_passes_the_shipped_configs_and_starts_nothing(config, capsys, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a cluster was started"))
    path = Path(__file__).parent.parent / "configs" / config
    assert main(["serve", "--config", str(path), "--check"]) == 0, capsys.readouterr().err
    assert "passes ditserve's checks" in capsys.readouterr().out


def test_a_documented_autoscaling_target_in_a_deployments_entry_is_not_refused(tmp_path):
    """``autoscaling_config.target_queued_per_replica`` (ditserve's, not Serve's schema's) passes the
    unknown-option check, and the app binds with it."""
    import yaml

    from deployments.app import bind_app
    from deployments.cli import load_serve_config

    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(_tiny_cpu_config(lambda c, a: a.update(deployments=[{
        "name": "DiTReplica", "autoscaling_config": {"min_replicas": 1, "max_replicas": 3,
                                                     "target_queued_per_replica": 4}}]))))
    config = load_serve_config(path)
    bind_app(config["args"], config["deployments"])


@pytest.mark.parametrize("text, said", [
    (None, "cannot read the config file"),
    ("name: caf\xe9\n".encode("latin-1"), "is not UTF-8 text"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", "nests too deeply"),
    ("applications:\n  - name: [\n", "is not valid YAML at line 3"),
    ("- just a list\n", "a Serve config file is a mapping"),
    ("applications:\n  - import_path: other.module:app\n", "no application with import_path deployments.app:build_app"),
])
def test_serve_config_files_that_are_not_one_are_one_line(tmp_path, capsys, monkeypatch, text, said):
    """A missing file, bad YAML, a file of another shape or without the app: one line, exit 1
    (each was a traceback)."""
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("a cluster was started"))
    path = tmp_path / "serve.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    assert main(["serve", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and said in err, err


@pytest.mark.slow
def test_serve_names_why_a_replica_failed_to_deploy(tmp_path):
    """A replica whose constructor raises (a sequence-parallel layout the model cannot take):
    one line with the deployment and its exception, exit 1 (a 30-line traceback without it)."""
    import yaml

    def impossible_layout(c, a):
        a["args"]["parallel"] = {"ulysses_degree": 3}  # tiny-flux has 4 heads
        a["args"]["replica"].update(rank_resources={"CPU": 0.1}, max_constructor_retry_count=1)

    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(_tiny_cpu_config(impossible_layout)))
    said = _serve_fails("--config", str(path), "--port", str(free_port("127.0.0.1")))
    assert said.startswith("error: application 'ditserve' failed to deploy: DiTReplica: ValueError: bad parallel "
                           "layout") and "parallel.ulysses_degree=3" in said, said


@pytest.mark.slow
def test_serve_says_what_a_pending_deploy_waits_for_and_stops_on_sigterm(tmp_path):
    """A layout needing more CPUs than the cluster has: Serve's scheduling message is printed
    (`waiting: DiTReplica: ... Resources required ...`; nothing was), and SIGTERM while it waits
    stops the command and its cluster (the handler was installed only once deployed, and
    ray.init's own replaced it before)."""
    import signal
    import subprocess
    import sys

    import yaml

    def too_big(c, a):
        a["args"]["parallel"] = {"ulysses_degree": 2}
        a["args"]["replica"]["rank_resources"] = {"CPU": 64}  # per rank; the local cluster has the machine's

    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(_tiny_cpu_config(too_big)))
    # Serve says a replica waits for resources after 30 s, and the command prints nothing before
    # Serve would: 5 s here (the cluster it starts takes its environment)
    quick = {f"RAY_SERVE_SLOW_STARTUP_WARNING_{name}": "5" for name in ("S", "PERIOD_S")}
    proc = subprocess.Popen([sys.executable, "-m", "deployments.cli", "serve", "--config", str(path), "--port",
                             str(free_port("127.0.0.1"))], env=_serve_env(**quick), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, waiting = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("waiting: DiTReplica: ") and "Resources required" in line:
                waiting.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert waiting.wait(180), "".join(lines)[-4000:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130
        reader.join(timeout=10)
        assert lines[-1] == "interrupted while starting\n" and "Traceback" not in "".join(lines), "".join(lines)[-3000:]
    finally:
        proc.kill()


def test_a_deploy_is_quiet_as_long_as_serve_is(monkeypatch):
    """Status messages are shown once Serve gives its first slow-start message: after the larger
    of its warning time and warning period, each read as Serve reads it (``RAY_SERVE_...`` over
    ``SERVE_...``, 30 s by default)."""
    for name in ("SERVE_SLOW_STARTUP_WARNING_S", "SERVE_SLOW_STARTUP_WARNING_PERIOD_S"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(f"RAY_{name}", raising=False)
    assert deploy_quiet_s() == 30.0
    monkeypatch.setenv("SERVE_SLOW_STARTUP_WARNING_S", "12")
    monkeypatch.setenv("SERVE_SLOW_STARTUP_WARNING_PERIOD_S", "4")
    assert deploy_quiet_s() == 12.0
    monkeypatch.setenv("RAY_SERVE_SLOW_STARTUP_WARNING_S", "3")
    assert deploy_quiet_s() == 4.0


def test_the_video_bar_is_drawn_with_the_job_status(tmp_path, capsys, monkeypatch):
    """The progress bar's first frame names the job's status (it was drawn with an empty label,
    then relabelled)."""
    import tqdm

    made = []

    def recording(*args, **kwargs):
        made.append(kwargs)
        raise KeyboardInterrupt  # the first frame is all this test needs

    monkeypatch.setattr(tqdm, "tqdm", recording)
    job = {"id": "video_1", "object": "video", "status": "queued", "progress": 0, "model": "tiny-wan"}
    server = _Answering(200, "application/json", json.dumps(job).encode())
    try:
        assert main(["video", "a", "-o", str(tmp_path / "a.mp4"), "--url", server.url]) == 130
    finally:
        server.shutdown()
    assert made and made[0]["desc"] == "queued"


@pytest.mark.parametrize("module", ["pydantic", "yaml", "deployments.config"])
def test_ctrl_c_while_the_cli_imports_is_one_line_and_exit_130_too(tmp_path, module):
    """Ctrl-C in the first ~0.2 s of ``ditserve generate`` (Python importing the CLI's
    dependencies, before its handler existed) printed a traceback of the module being imported
    (helper-23's review). The console script's entry point (``deployments.entry``) imports the CLI
    itself: SIGINT delivered exactly while ``module`` loads, through an audit hook, is one line."""
    import subprocess
    import sys

    # a terminal's foreground process has SIGINT's default action; this one inherits the test
    # process's, which is SIG_IGN when the suite runs as a background job (CI run with '&'): as a shell would
    script = ("import os, signal, sys\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "sent = []\n"
              "def hook(event, args):\n"
              f"    if event == 'import' and args[0] == {module!r} and not sent:\n"
              "        sent.append(1); os.kill(os.getpid(), signal.SIGINT)\n"
              "sys.addaudithook(hook)\n"
              "from deployments.entry import main\n"
              f"sys.argv = ['ditserve', 'generate', 'a star', '-o', {str(tmp_path / 'x.png')!r}]\n"
              "sys.exit(main())\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    assert (proc.returncode, proc.stderr) == (130, "interrupted\n"), proc.stderr[-2000:]


def test_the_console_script_is_the_light_entry_point():
    """``ditserve`` (pyproject's console script) starts at ``deployments.entry``, which imports only
    the standard library before the CLI (so the test above covers what a user runs)."""
    import ast
    import tomllib

    root = Path(__file__).parent.parent
    assert tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]["ditserve"] == "deployments.entry:main"
    tree = ast.parse((root / "deployments" / "entry.py").read_text())
    top = {alias.name for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
           for alias in node.names} | {node.module for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert top <= {"__future__", "annotations", "signal", "sys"}, top
