"""Property-based fuzzing of the HTTP API from its published request schemas (hypothesis).

Bodies come from each route's request schema in ``/openapi.json`` (``hypothesis-jsonschema``),
from those bodies with one field replaced by arbitrary JSON, from arbitrary JSON values, and
from raw bytes with random media types; ``/v1/videos`` is also sent as the form OpenAI's SDK
uses, and ``/v1/images/edits`` as the multipart form ``images.edit`` sends, with uploads drawn
from valid, corrupt, truncated, oversized ("bombs"), odd-mode and random files. Every answer is checked: a status below 500, OpenAI's error envelope on every error, and
an answer within 5 s. Printed per route: cases by status, and the three failure counts.
Goals: 0 x 5xx (a 504 for the request's own ``timeout_s`` is its promised answer, not a
server error), 0 non-envelope error bodies, 0 answers slower than 5 s.

    .venv/bin/python bench/fuzz.py [--cases 2000]

``tests/test_fuzz.py`` runs the same fuzzing, bounded, as part of the suite.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlencode

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SLOW_S = 5.0
# Small limits keep the cases that pass validation cheap to generate (a few steps of 32x32).
IMAGE_ARGS = {"model": {"loras": {"magenta": {}, "outline": {}}},  # the embedded adapters: lora fields reach them
              "limits": {"default_size": "32x32", "default_steps": 2, "max_steps": 3, "max_pixels": 64 * 64, "max_n": 2},
              "replica": {"torch_threads": 1}, "batching": {"max_wait_ms": 5}}
EDIT_ARGS = IMAGE_ARGS
VIDEO_ARGS = {"model": {"name": "tiny-wan"},
              "limits": {"default_size": "32x32", "default_steps": 2, "max_steps": 3, "max_pixels": 64 * 64,
                         "default_num_frames": 5, "max_frames": 9},
              "replica": {"torch_threads": 1}, "batching": {"max_wait_ms": 5}}


def _own_deadline(r: httpx.Response) -> bool:
    """A 504 for the request's own ``timeout_s`` (e.g. 5e-324 s) is the answer the contract
    promises, not a server error."""
    try:
        error = r.json()["error"]
    except Exception:  # noqa: BLE001 - not an envelope: counted as such below
        return False
    return r.status_code == 504 and error.get("code") == "timeout" and error.get("param") == "timeout_s"


def _upload_pool() -> list[bytes]:
    """Files an edit may carry: valid PNG / JPEG / WebP, an alpha mask, an alpha-less mask, odd
    modes (CMYK, 16-bit grey, palette), truncated and corrupt data, a 1-bit image bomb."""
    import io

    import numpy as np
    from PIL import Image

    def save(image, fmt="PNG") -> bytes:
        buf = io.BytesIO()
        image.save(buf, format=fmt)
        return buf.getvalue()

    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    mask = Image.new("RGBA", (32, 32), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (16, 0, 32, 32))
    png = save(noise)
    return [png, save(noise, "JPEG"), save(noise, "WEBP"), save(mask), save(Image.new("RGB", (32, 32))),
            save(Image.new("CMYK", (32, 32)), "JPEG"), save(Image.fromarray(np.zeros((32, 32), np.uint16))),
            save(Image.new("P", (48, 32))), png[: len(png) // 2], png[:60], save(Image.new("1", (12000, 12000))),
            save(noise.resize((64, 16)))]


def _strategies(schema: dict, form: bool, uploads: bool = False):
    from hypothesis import strategies as st
    from hypothesis_jsonschema import from_schema

    scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=2**62, max_value=2**80)
               | st.floats() | st.text(max_size=40) | st.sampled_from(["64x64", "\ud800", "</s>", "1e308", "NaN"]))
    json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                               | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=12)
    valid = from_schema(schema)
    fields = sorted(schema.get("properties", {}))
    mutated = st.tuples(valid, st.sampled_from(fields), json_values).map(lambda t: {**t[0], t[1]: t[2]})
    bodies = st.one_of(valid, valid, mutated, mutated, json_values)
    raw = st.tuples(st.binary(max_size=200), st.sampled_from(["application/json", "text/plain", "", "multipart/form-data",
                                                               "application/x-www-form-urlencoded"]))
    kinds = ["json", "json", "json", "raw"] + (["form"] if form else [])
    if uploads:
        files = st.sampled_from(_upload_pool()) | st.binary(max_size=300)
        upload = st.tuples(bodies, st.lists(files, min_size=0, max_size=2), st.none() | files)
        kinds = ["json", "raw", "upload", "upload", "upload", "upload"]
        return st.sampled_from(kinds).flatmap(lambda k: raw.map(lambda r: ("raw", r)) if k == "raw"
                                              else upload.map(lambda u: ("upload", u)) if k == "upload"
                                              else bodies.map(lambda b, k=k: (k, b)))
    return st.sampled_from(kinds).flatmap(lambda k: raw.map(lambda r: ("raw", r)) if k == "raw"
                                          else bodies.map(lambda b, k=k: (k, b)))


def _form_fields(body) -> list[tuple[str, str]]:
    """A body as form fields in the bracket notation OpenAI's SDK writes."""
    if not isinstance(body, dict):
        return [("prompt", json.dumps(body))]
    out = []

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}[{k}]", v)
        elif isinstance(value, list):
            for v in value:
                walk(f"{prefix}[]", v)
        else:
            out.append((prefix, value if isinstance(value, str) else json.dumps(value)))

    for key, value in body.items():
        walk(str(key), value)
    return out


def fuzz_route(base_url: str, route: str, cases: int, *, form: bool = False, headers: dict | None = None,
               seed: int = 0, uploads: bool = False) -> dict:
    """Send ``cases`` generated requests to ``route``; returns counts by status and the failures:
    ``5xx``, ``non_envelope`` (an error whose body is not OpenAI's envelope), ``slow`` (> 5 s).
    ``uploads``: the route takes multipart uploads (``image`` / ``image[]`` and ``mask``)."""
    from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings

    schema = httpx.get(f"{base_url}/openapi.json", headers=headers, timeout=60).json()[
        "paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
    statuses, failures, examples = Counter(), Counter(), {}
    client = httpx.Client(base_url=base_url, headers=headers, timeout=60)

    @hypothesis_seed(seed)
    @settings(max_examples=cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(_strategies(schema, form, uploads))
    def one(case) -> None:
        kind, payload = case
        started = time.monotonic()
        try:
            if kind == "json":
                r = client.post(route, content=json.dumps(payload, allow_nan=True).encode("utf-8", "surrogatepass"),
                                headers={"content-type": "application/json"})
            elif kind == "upload":  # multipart as images.edit sends it: fields, image (image[] for several), mask
                body, images, mask = payload
                fields = [(k, v.encode("utf-8", "surrogatepass")) for k, v in _form_fields(body)
                          if k.split("[")[0] not in ("image", "mask")]
                files = [("image" if len(images) == 1 else "image[]", ("in.png", data, "image/png")) for data in images]
                if mask is not None:
                    files.append(("mask", ("mask.png", mask, "image/png")))
                r = client.post(route, files=[*[(k, (None, v)) for k, v in fields], *files] or None,
                                data=None if fields or files else {"prompt": "x"})
            elif kind == "form":  # url-encoded by hand: lone surrogates must reach the server as bytes
                data = urlencode(_form_fields(payload), encoding="utf-8", errors="surrogatepass").encode()
                r = client.post(route, content=data, headers={"content-type": "application/x-www-form-urlencoded"})
            else:
                data, media = payload
                r = client.post(route, content=data, headers={"content-type": media} if media else {})
        except httpx.HTTPError as exc:
            statuses[type(exc).__name__] += 1
            failures["no_answer"] += 1
            return
        took = time.monotonic() - started
        statuses[r.status_code] += 1
        if r.status_code >= 500 and not _own_deadline(r):
            failures["5xx"] += 1
            examples.setdefault("5xx", (case, r.text[:300]))
        if r.status_code >= 400:
            try:
                error = r.json()["error"]
                ok = set(error) == {"message", "type", "param", "code"}
            except Exception:  # noqa: BLE001 - not JSON, or no envelope
                ok = False
            if not ok:
                failures["non_envelope"] += 1
                examples.setdefault("non_envelope", (case, r.text[:300]))
        if took > SLOW_S:
            failures["slow"] += 1

    one()
    client.close()
    return {"statuses": dict(sorted(statuses.items(), key=str)), "failures": dict(failures), "examples": examples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=2000, help="generated requests per route (and per encoding)")
    ns = ap.parse_args()

    from ray import serve

    from bench import local_serve
    from deployments.app import build_app

    met = True
    with local_serve(8) as port:
        serve.run(build_app(IMAGE_ARGS), name="images", route_prefix="/img")
        serve.run(build_app(VIDEO_ARGS), name="videos", route_prefix="/vid")
        runs = [("POST /v1/images/generations (JSON)", f"http://127.0.0.1:{port}/img", "/v1/images/generations", False),
                ("POST /v1/images/edits (multipart uploads)", f"http://127.0.0.1:{port}/img", "/v1/images/edits",
                 False),
                ("POST /v1/videos (JSON and forms)", f"http://127.0.0.1:{port}/vid", "/v1/videos", True)]
        for name, base, route, form in runs:
            started = time.monotonic()
            result = fuzz_route(base, route, ns.cases, form=form, uploads=route.endswith("/edits"))
            ok = not result["failures"]
            met &= ok
            sent = sum(result["statuses"].values())  # what hypothesis generated (it may stop short of --cases)
            print(f"{name}: {sent} cases in {time.monotonic() - started:.0f} s; by status {result['statuses']}; "
                  f"5xx {result['failures'].get('5xx', 0)}, non-envelope {result['failures'].get('non_envelope', 0)}, "
                  f"no answer {result['failures'].get('no_answer', 0)}, slower than {SLOW_S:g} s "
                  f"{result['failures'].get('slow', 0)}  {'MET' if ok else 'MISSED'}")
            for what, (case, text) in result["examples"].items():
                print(f"  first {what}: {str(case)[:200]} -> {text}")
    print(f"goal: 0 x 5xx, 0 non-envelope bodies, 0 answers > {SLOW_S:g} s: {'MET' if met else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
