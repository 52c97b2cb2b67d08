"""The CLI as a person uses it: every failure is one line on stderr and a non-zero exit."""

from __future__ import annotations

import httpx
from openai import APITimeoutError

from deployments.cli import failure_line, main
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
    assert main(["generate", "a", "-o", str(tmp_path / "a.png"), "--extra", "{nope", "--url", "http://x"]) == 1
    assert capsys.readouterr().err.startswith("error: --extra is not a JSON object")
    timeout = APITimeoutError(request=httpx.Request("POST", "http://h/v1/images/generations"))
    assert failure_line(timeout, "http://h").startswith("error: http://h did not answer in time")
    assert failure_line(KeyError("x"), "http://h") is None  # a bug, not a failed call: it raises
