"""Call ditserve from another Ray job through a Ray Serve handle (no HTTP).

Start the app on a Ray cluster first, for example on one machine::

    .venv/bin/ray start --head --num-cpus 8
    .venv/bin/serve run configs/tiny-cpu.yaml --non-blocking     # or: serve deploy configs/tiny-cpu.yaml

then, from any process of the same Python environment that can reach the cluster::

    .venv/bin/python examples/handle_client.py --address auto -o out.png
    .venv/bin/python examples/handle_client.py --address 10.0.0.5:6379 --count 4 --prompt "a green star"

With an explicit address, a cluster that uses Ray's token authentication also needs
``RAY_AUTH_MODE=token`` and its token (``~/.ray/auth_token`` or ``RAY_AUTH_TOKEN``) in the
environment; ``--address auto`` on the cluster's machine finds both.

It connects with ``ray.init(address=...)``, waits until the application is RUNNING, takes the application's handle with
``serve.get_app_handle("ditserve")`` and sends ``--count`` requests at once (``.remote()``
returns immediately; ``.result(timeout_s=...)`` waits, and cancels the call past ``--timeout-s``),
writes each request's PNG, then sends an invalid
request to show the typed error the handle raises (``pipeline.errors.InvalidRequestError``,
with the same ``status_code`` / ``param`` / ``message`` the HTTP API returns).

The request dict has the fields of ``POST /v1/images/generations`` (README, "Request fields");
the result is an ``ImageGenerationResponse``: ``data[i].b64_json`` (PNG) and the ``ditserve``
metadata block. Errors: ``InvalidRequestError`` (400), ``ModelNotFoundError`` (404),
``OverloadedError`` (429), ``RequestTimeoutError`` (504), ``ServiceUnavailableError`` (503),
``InternalError`` (500), all subclasses of ``pipeline.errors.DitServeError``; a burst of more
calls at once than the Ingress's ``max_queued_requests`` (the admission limit + 4) gets Serve's
own ``ray.serve.exceptions.BackPressureError`` for the excess.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from pathlib import Path

import ray
from ray import serve
from ray.serve.exceptions import BackPressureError

from pipeline.errors import DitServeError, InvalidRequestError


def output_paths(out: Path, count: int) -> list[Path]:
    """``out`` itself for one request, else ``out`` with ``-0``, ``-1``, ... before the suffix."""
    return [out] if count == 1 else [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(count)]


def wait_until_running(app: str, timeout_s: float) -> None:
    """Block until Serve reports application ``app`` RUNNING (``serve run --non-blocking``
    returns while it still deploys). Raises ``RuntimeError`` if its deployment failed and
    ``TimeoutError`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(app)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"application {app!r} failed to deploy: {status.message}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"application {app!r} not RUNNING after {timeout_s:.0f} s "
                               f"({status.status if status else 'not deployed'})")
        time.sleep(1)


def error_name(exc: DitServeError) -> str:
    """The ditserve class name: Ray re-raises a remote error as a subclass of it that keeps the
    original in ``cause``, so ``except InvalidRequestError`` works and the fields are there."""
    return type(getattr(exc, "cause", None) or exc).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="auto", help="Ray cluster address for ray.init (default: auto)")
    parser.add_argument("--app", default="ditserve", help="Serve application name (default: ditserve)")
    parser.add_argument("--prompt", default="a red circle on a blue background")
    parser.add_argument("--count", type=int, default=1, help="requests sent at once (default: 1)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the first request; the others count up")
    parser.add_argument("--steps", type=int, default=8, help="num_inference_steps")
    parser.add_argument("--size", default="64x64", help="WIDTHxHEIGHT in pixels")
    parser.add_argument("-o", "--output", type=Path, default=Path("out.png"))
    parser.add_argument("--wait-s", type=float, default=600, help="how long to wait for the app to be RUNNING")
    parser.add_argument("--timeout-s", type=float, default=300,
                        help="how long to wait for each answer (default: 300); then the call is cancelled")
    args = parser.parse_args(argv)

    args.output.parent.mkdir(parents=True, exist_ok=True)  # before the requests, as ditserve generate does
    ray.init(address=args.address, log_to_driver=False)
    wait_until_running(args.app, args.wait_s)
    handle = serve.get_app_handle(args.app)

    requests = [{"prompt": args.prompt, "seed": args.seed + i, "num_inference_steps": args.steps, "size": args.size}
                for i in range(args.count)]
    responses = [handle.generate.remote(body) for body in requests]  # all in flight at once
    for path, response in zip(output_paths(args.output, args.count), responses):
        try:
            result = response.result(timeout_s=args.timeout_s)
        except DitServeError as exc:  # e.g. OverloadedError when the router's queue is full; first: the
            print(f"{error_name(exc)} ({exc.status_code}): {exc.message}")  # server's 504 is a TimeoutError too
            continue
        except TimeoutError:  # a call sent while the app is deleted may never be answered (README)
            response.cancel()  # the server drops the request (queued) or its rows (running)
            print(f"no answer within {args.timeout_s:g} s: cancelled")
            continue
        except BackPressureError as exc:  # more calls at once than the Ingress's max_queued_requests
            print(f"BackPressureError (retry later): {exc}")
            continue
        path.write_bytes(base64.b64decode(result.data[0].b64_json))
        meta = result.ditserve
        print(f"image written to {path} (request {meta.request_id}, batch of {meta.batch_size}, "
              f"replica {meta.replica}, {meta.timings_ms['total']:.0f} ms)")

    # An invalid request raises a typed error on the caller's side; the server keeps serving.
    try:
        handle.generate.remote({"prompt": "", "num_inference_steps": 0}).result(timeout_s=args.timeout_s)
    except InvalidRequestError as exc:
        print(f"invalid request -> {error_name(exc)} ({exc.status_code}, param={exc.param}): {exc.message}")
        print(json.dumps(exc.to_envelope()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
