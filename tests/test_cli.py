"""The CLI as a person uses it: every failure is one line on stderr and a non-zero exit."""

from __future__ import annotations

import httpx
import pytest
from openai import APIConnectionError, APITimeoutError

from deployments.cli import _transport_modules, failure_line, main
from parallel.groups import free_port


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
    for extra, said in (("{nope", "not JSON"), ("[1]", "must be a JSON object"), ('"x"', "must be a JSON object")):
        with pytest.raises(SystemExit) as exited:  # argparse's usage error: usage line, then the error
            main(["generate", "a", "-o", str(tmp_path / "a.png"), "--extra", extra, "--url", "http://x"])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and f"argument --extra: {said}" in err and "Traceback" not in err, err
    timeout = APITimeoutError(request=httpx.Request("POST", "http://h/v1/images/generations"))
    assert failure_line(timeout, "http://h").startswith("error: http://h did not answer in time")
    assert failure_line(KeyError("x"), "http://h") is None  # a bug, not a failed call: it raises


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
