"""The ditserve command line: serve (run the app), generate, edit and video (call a running
server), demo (start, generate one image, stop)."""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import errno
import importlib
import io
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import tempfile
import time
import typing
import urllib.parse
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import pydantic
import yaml

from compat.ray_serve import gcs_refusal
from deployments.config import AccelerationConfig, validation_line
from deployments.proxy import install as install_proxy_middleware
from pipeline.contract.text import shown
from parallel.groups import free_port

APP_NAME = "ditserve"
DEMO_PROMPT = "a red circle on a blue background"


def _model_in(annotation) -> type[pydantic.BaseModel] | None:
    """The pydantic model an annotation holds (``X``, ``Optional[X]``, ``List[X]``, ...), if any."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    for inner in typing.get_args(annotation):
        found = _model_in(inner)
        if found is not None:
            return found
    return None


def unknown_keys(value, model: type[pydantic.BaseModel], where: str = "") -> list[str]:
    """The keys of ``value`` (a config file's mapping) ``model`` has no field for, as dotted
    paths, through the nested models and lists of them. Ray Serve's schema ignores them (a
    misspelt ``num_replica`` in a ``deployments`` entry was dropped without a word)."""
    if isinstance(value, list):
        return [key for i, item in enumerate(value) for key in unknown_keys(item, model, f"{where}[{i}]")]
    if not isinstance(value, dict) or model.model_config.get("extra") == "allow":
        return []
    fields = {}
    for name, info in model.model_fields.items():
        fields[name] = fields[info.alias or name] = info
    unknown = []
    for key, item in value.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in fields:
            unknown.append(path)
        elif (inner := _model_in(fields[key].annotation)) is not None:
            unknown.extend(unknown_keys(item, inner, path))
    return unknown


APP_IMPORT_PATH = "deployments.app:build_app"  # the ditserve application of a Serve config file
# An application's fields in a Serve config file that `ditserve serve` applies (the others it refuses)
APPLIED_APP_FIELDS = ("name", "import_path", "route_prefix", "args", "deployments")
# The file's Serve-wide fields `ditserve serve` gives serve.start (http_options' host and port
# as --host/--port leave them); it refuses the others (helper-81: they were dropped unsaid), and
# grpc_options (ditserve serves no gRPC; its servicers and tracing's exporter are import paths
# that only failed once Serve started: helper-82) and tracing_config with them
APPLIED_SERVE_FIELDS = ("http_options", "logging_config", "controller_options")
# http_options fields it refuses: HTTPS, where the URL it prints and its checks are plain HTTP's
UNAPPLIED_HTTP_FIELDS = ("ssl_keyfile", "ssl_certfile", "ssl_keyfile_password", "ssl_ca_certs")


def load_serve_configs(path: str | Path) -> tuple[list[dict], list[str]]:
    """Read a Serve config file, validate it with Ray Serve's own ``ServeDeploySchema`` (and
    refuse the keys that schema would ignore); return each ditserve application's entry
    (``name``, ``args``, ``route_prefix``, ``deployments``: its ``deployments`` section's
    entries, as given, and the file's ``http_options``) and the names of the file's other
    applications. Raises :class:`CannotStart` (one line naming the file and the field) for a
    file that cannot be read, is not YAML, fails the schema, has a key the schema does not know
    or has no ditserve application."""
    from ray.serve.schema import ServeDeploySchema

    try:
        raw = yaml.load(Path(path).read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except OSError as exc:
        raise CannotStart(f"cannot read the config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CannotStart(f"{path} is not UTF-8 text (a YAML config file is)") from None
    except RecursionError:
        raise CannotStart(f"{path} nests too deeply to be a config file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or _first_line(exc)
        raise CannotStart(f"{path} is not valid YAML{at}: {problem}") from None
    if not isinstance(raw, dict):
        raise CannotStart(f"{path}: a Serve config file is a mapping with an 'applications' list")
    try:
        with warnings.catch_warnings():  # refused with the entry's name in bind_app (app.check_entry_look_back)
            warnings.filterwarnings("ignore", message="`look_back_period_s`", category=FutureWarning)
            schema = ServeDeploySchema.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise CannotStart(f"{path}: {validation_line(exc)}") from None
    except (ImportError, AttributeError) as exc:  # Serve imports an autoscaling_config's policy as it reads the file
        apps = raw.get("applications")
        paths = [found for i, app in enumerate(apps if isinstance(apps, list) else ())
                 for found in _import_paths(app.get("deployments") if isinstance(app, dict) else None,
                                            f"applications[{i}].deployments")]
        if isinstance(exc, ImportError) or any(_names(value, exc) for _, value in paths):
            raise CannotStart(f"{path}: {_import_problem(exc, paths)}") from None
        raise CannotStart(f"{path}: not a Serve config (AttributeError: {_first_line(exc)}); an entry may be null or "
                          "of the wrong type") from None
    except (TypeError, ValueError) as exc:  # Serve's own validators, given a null or a list
        raise CannotStart(f"{path}: not a Serve config ({type(exc).__name__}: {_first_line(exc)}); "
                          "an entry may be null or of the wrong type") from None
    flags = _booleans_as_numbers(raw)
    if flags:
        raise CannotStart(f"{path}: {flags[0]}: takes a number, not {str(flags[1]).lower()}")
    # target_queued_per_replica: ditserve's own autoscaling field (bind_app makes it the policy's)
    unknown = [key for key in unknown_keys(raw, ServeDeploySchema)
               if not re.fullmatch(r"applications\[\d+\]\.deployments\[\d+\]\.autoscaling_config\."
                                   r"target_queued_per_replica", key)]
    if unknown:
        raise CannotStart(f"{path}: unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                          "(Ray Serve's config schema has no such field)")
    problem = _deploy_time_problem(schema)
    if problem:
        raise CannotStart(f"{path}: {problem}")
    for i, app in enumerate(schema.applications):
        if _is_ditserve(app.import_path) and app.autoscaling_policy is not None:  # helper-65
            raise CannotStart(f"{path}: applications[{i}].autoscaling_policy: an application-level policy replaces "
                              "DiTReplica's own (RouterQueuePolicy, on the Router's queue) and Serve says it is not "
                              "yet supported; scale DiTReplica with replica.autoscaling or its deployments entry's "
                              "autoscaling_config")
    given = {field: value for field, value in schema.model_dump(exclude_unset=True).items() if value is not None}
    applied = (*APPLIED_SERVE_FIELDS, *(("proxy_location",) if schema.proxy_location != "Disabled" else ()))
    serve_options = {field: value for field, value in given.items() if field in applied}
    not_served = [*(f"http_options.{field}" for field in given.get("http_options", {})
                    if field in UNAPPLIED_HTTP_FIELDS),
                  *(field for field in given if field not in (*applied, "applications"))]
    apps = [{"name": app.name, "args": app.args or {}, "route_prefix": app.route_prefix or "/",
             "deployments": [d.model_dump(exclude_unset=True) for d in app.deployments],
             "http_options": schema.http_options.model_dump(), "runtime_env": app.runtime_env or {},
             "serve_options": serve_options,
             "not_applied": [*not_served, *(f"applications[{i}].{field}" for field in app.model_dump(exclude_unset=True)
                                            if field not in APPLIED_APP_FIELDS)]}
            for i, app in enumerate(schema.applications) if _is_ditserve(app.import_path)]
    if not apps:
        raise CannotStart(f"{path}: no application with import_path {APP_IMPORT_PATH}")
    others = [app.name for app in schema.applications if not _is_ditserve(app.import_path)]
    return apps, others


def _env_vars(runtime_env) -> object:
    """A ``runtime_env``'s ``env_vars`` as written (None: none given, or no runtime_env)."""
    return runtime_env.get("env_vars") if isinstance(runtime_env, dict) else None


def _deploy_time_problem(schema) -> str | None:
    """What Ray's ``ServeDeploySchema`` (2.60) lets pass and Serve refuses only as it deploys
    (helper-64: ``--check`` passed both): a ``route_prefix`` Serve's ``validate_route_prefix``
    refuses (no leading ``/``, a trailing one, a wildcard), and ``runtime_env.env_vars`` that
    are not strings (Ray's ``RuntimeEnv`` takes ``Dict[str, str]``), of an application or of a
    deployment's ``ray_actor_options``. None: neither."""
    from ray.serve._private.utils import validate_route_prefix

    for i, app in enumerate(schema.applications):
        try:
            validate_route_prefix(app.route_prefix)
        except ValueError as exc:
            return f"applications[{i}].route_prefix: {exc}"
        envs = [(f"applications[{i}].runtime_env", app.runtime_env)]
        envs += [(f"applications[{i}].deployments[{j}].ray_actor_options.runtime_env",
                  (d.model_dump(exclude_unset=True).get("ray_actor_options") or {}).get("runtime_env"))
                 for j, d in enumerate(app.deployments)]
        for where, env in envs:
            env_vars = _env_vars(env)
            if env_vars is None:
                continue
            if not isinstance(env_vars, dict):
                return f"{where}.env_vars: a mapping of names to strings, got {type(env_vars).__name__}"
            for name, value in env_vars.items():
                if not isinstance(name, str) or not isinstance(value, str):
                    # not a suggested text: YAML read it already (yes became True, 0x1F 31; helper-65)
                    what = f"the name {name!r}" if not isinstance(name, str) else f"{type(value).__name__} {value!r}"
                    return (f"{where}.env_vars.{name}: Ray takes strings only, got {what}; quote it in the file, "
                            "as written")
    return None


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's ``SafeLoader`` that refuses a key given twice in one mapping as written
    (``SafeLoader`` keeps the last silently: ``port: 8000`` then ``port: 9000`` served on 9000,
    unsaid). Keys a merge (``<<``) brings may be overridden, as YAML's merge key allows."""

    def __init__(self, stream):
        super().__init__(stream)
        self._checked: set[int] = set()  # the mappings checked (ids of their nodes)

    def flatten_mapping(self, node):
        # before SafeLoader rewrites the node's keys in place with the merged ones (also those of
        # an anchored mapping merged elsewhere before its own turn): each mapping once, as written
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                            key_node.start_mark)
                seen.add(key)
        super().flatten_mapping(node)

    def construct_yaml_int(self, node):
        # YAML 1.1 (PyYAML, Serve's reader too) reads 010 as octal 8 and 1:30 as 90: refused
        # with the forms that say what was meant (helper-64: both passed, as 8 and 90); 07 or 00,
        # the same number either way, stand
        text = node.value.replace("_", "")
        if re.fullmatch(r"[-+]?0[0-7]+", text) and int(text, 8) != int(text):
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value} is the octal number {int(text, 8)} in YAML 1.1, as Serve reads this file; "
                f"write {int(text, 8)}, or {int(text)} without the leading 0, or quote it for the text",
                node.start_mark)
        self._refuse_base_60(node, super().construct_yaml_int)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        self._refuse_base_60(node, super().construct_yaml_float)  # 1:30.5 is 90.5 (helper-65)
        return super().construct_yaml_float(node)

    def _refuse_base_60(self, node, construct) -> None:
        if ":" in node.value:
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value} is the base-60 number {construct(node)} in YAML 1.1, as Serve reads this "
                "file; write the number, or quote it for the text", node.start_mark)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _UniqueKeyLoader.construct_yaml_float)


def _booleans_as_numbers(raw: dict) -> tuple[str, bool] | None:
    """The first field of Serve's config schema given ``true``/``false`` for a number (pydantic's
    lax mode reads ``port: true`` as port 1), as ``(dotted field, value)``; None when none is."""
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(raw, strict=True)  # its other strict errors (enums from text) are no fault
    except pydantic.ValidationError as exc:
        for error in exc.errors():
            if isinstance(error.get("input"), bool) and error["type"] in ("int_type", "float_type"):
                return ".".join(str(part) for part in _in_file(raw, error["loc"])), error["input"]
    except (AttributeError, TypeError, ValueError, ImportError):  # refused by the lax validation already
        pass
    return None


def _in_file(raw, loc: tuple) -> list:
    """The part of a pydantic error's ``loc`` that is a path in ``raw`` (the rest names a
    union's member, ``constrained-int``, not a field of the file)."""
    path = []
    for part in loc:
        in_list = isinstance(raw, list) and isinstance(part, int) and 0 <= part < len(raw)
        if in_list or isinstance(raw, dict) and part in raw:
            raw = raw[part]
            path.append(part)
        else:
            break
    return path


def _is_ditserve(import_path: str) -> bool:
    """Whether a Serve ``import_path`` names ditserve's application builder, in either of
    the forms Serve takes (``module:attr`` or ``module.attr``)."""
    return import_path.replace(":", ".") == APP_IMPORT_PATH.replace(":", ".")


def load_serve_config(path: str | Path) -> dict:
    """:func:`load_serve_configs` for a file of one application, the ditserve one, which
    ``ditserve serve`` runs. Raises :class:`CannotStart` also for a file of several (only the
    first was run, the others silently left out), and for a field the in-process deploy does not
    apply (an application's ``runtime_env``, ``logging_config``, ...; the file's
    ``target_capacity``, ``proxy_location: Disabled``, ``http_options``' ``ssl_*``,
    ``grpc_options``, ``tracing_config``: silently dropped before). The file's other Serve-wide
    fields are given to ``serve.start`` (``serve_options``)."""
    apps, others = load_serve_configs(path)
    if len(apps) + len(others) > 1:
        names = ", ".join(repr(name) for name in [*(app["name"] for app in apps), *others])
        raise CannotStart(f"{path} has {len(apps) + len(others)} applications ({names}); `ditserve serve` runs "
                          "one ditserve application: keep one in the file, or deploy it whole with `serve deploy` "
                          "(`ditserve serve --check` checks each ditserve application of it)")
    not_applied = apps[0]["not_applied"]
    if not_applied:  # Serve's fields of an application that the in-process deploy has no way to apply
        one = len(not_applied) == 1
        raise CannotStart(f"{path}: {', '.join(not_applied)}: `ditserve serve` deploys the application in-process "
                          f"and does not apply {'this field' if one else 'these fields'}; deploy the file with "
                          f"`serve run {path}` (or `serve deploy`), or leave {'it' if one else 'them'} out")
    return apps[0]


@dataclass(frozen=True)
class Served:
    """Where :func:`start_app` deployed the app: its application ``name`` at ``route_prefix``,
    the ``host``/``port`` Serve listens on, and whether it ``joined`` a Ray cluster that ran
    before (then :func:`stop_app` removes only what it added: the application, and Serve when it
    started Serve there; otherwise it shuts down the Serve instance and cluster it started)."""

    name: str
    route_prefix: str
    host: str
    port: int
    joined: bool
    started_serve: bool = False
    grace_s: float = 20.0  # the longest graceful_shutdown_timeout_s of its deployments (s)

    @property
    def url(self) -> str:
        """The base URL, for a client on this machine when Serve listens on every interface."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}{self.route_prefix.rstrip('/')}"


class CannotStart(RuntimeError):
    """``ditserve serve`` / ``demo`` could not start the app (one line on stderr, exit 1)."""


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (Ray's and Serve's run to many), else its type's name;
    for an error an actor raised, its own (``cause``: helper-81, Serve's "Prefix / is being used by
    application ..." was told as the controller's "ray::ServeController.deploy_applications() (pid=...")."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        exc = cause
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


CONNECT_TIMEOUT_S = 5.0  # a cluster address that accepts no TCP connection in this long is refused


def _sends_token() -> bool:
    """Whether Ray sends this process's token to a cluster: ``RAY_AUTH_MODE=token`` (unset, or
    ``disabled``, it sends none)."""
    return os.environ.get("RAY_AUTH_MODE", "").strip().lower() == "token"


def _gcs_reachable(address: str) -> None:
    """Refuse at once an address that is not ``auto`` or a reachable ``HOST:PORT`` (``ray.init``
    retries an unreachable one for minutes), or whose cluster refuses this process's token
    (``ray.init`` retries that for ~20 s, then says only that it could not connect). Raises
    :class:`CannotStart`."""
    if address == "auto":
        return
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not host or not port.isdigit():
        raise CannotStart(f"--address takes a Ray cluster's GCS address HOST:PORT (e.g. 127.0.0.1:6379) or auto, "
                          f"got {shown(address)}" + (" (a dashboard URL is for job submission)"
                                                     if address.startswith("http") else ""))
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise CannotStart(f"no Ray cluster answers at {address} ({exc.strerror or exc}); start one with "
                          "`ray start --head`, or leave out --address (and $RAY_ADDRESS) to start a local one") from None
    refused = gcs_refusal(address, timeout_s=CONNECT_TIMEOUT_S)  # ray.init would retry it for ~20 s
    if refused:
        hint = (f"set RAY_AUTH_MODE=token ({_TOKEN_FROM})" if not _sends_token()
                else f"give this process the cluster's token ({_TOKEN_FROM})")
        raise CannotStart(f"the Ray cluster at {address} refuses this process ({refused}); {hint}")


_TOKEN_FROM = "Ray reads it from $RAY_AUTH_TOKEN or ~/.ray/auth_token"


def _port_free(host: str, port: int) -> None:
    """Refuse a ``host``/``port`` another program listens on (Serve's proxy would fail with a
    long traceback, or bind beside a server on every interface). Raises :class:`CannotStart`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR, as Serve's proxy sets it (http_util.set_socket_reuse_port, with
        # SO_REUSEPORT): a connection of a server that just stopped, left in TIME-WAIT, does not
        # hold the port for either; a listener still does (without SO_REUSEPORT here, a Serve
        # proxy listening there too: Serve's own bind would join it and share the port)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            probe.listen(1)
        except OSError as exc:  # an unknown name or an address of no interface here: the host is wrong
            fix = "--host" if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL else "--port"
            raise CannotStart(f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another {fix}") from None


def check_port(port: int) -> None:
    """Raise :class:`CannotStart` for a port outside 1-65535 (0, a port the OS picks, would
    leave the URL ``ditserve serve`` prints, and clients are given, unknown)."""
    if not 1 <= port <= 65535:
        raise CannotStart(f"cannot listen on port {port}: a port is 1-65535 (0, a port the OS picks, is not one a "
                          "client can be given)")


def check_host(host: str, where: str) -> None:
    """Raise :class:`CannotStart` for an empty ``host`` (blank), naming ``where`` it came from
    (``--host`` or the config's ``http_options.host``)."""
    if not host.strip():
        raise CannotStart(f"{where} {host!r}: give the address to listen on (0.0.0.0: every interface; 127.0.0.1: "
                          "this machine only)")


@contextlib.contextmanager
def _without_serve_line(start: str):
    """Leave out of Serve's log, for the block, the records whose message starts with
    ``start``: ``serve.run`` after this module's ``serve.start`` says "Connecting to existing
    Serve app ... New http_options/controller_options will not be applied", which read as if
    ``--port`` were ignored (it was applied by that ``serve.start``; the URL printed is read back)."""
    logger = logging.getLogger("ray.serve")

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(start)

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def checked_app(args: dict, deployments: list[dict] | None = None):
    """``bind_app(args, deployments)``, its refusals as :class:`CannotStart` (one line naming
    the field): bad ``args``, a bad or unknown ``deployments`` entry, Serve refusing an option.
    Needs no cluster."""
    from deployments.app import bind_app

    try:
        app = bind_app(args, deployments)
    except pydantic.ValidationError as exc:
        raise CannotStart(f"bad application args: {validation_line(exc, 'args')}") from None
    except (ValueError, TypeError) as exc:  # a deployments entry naming no deployment, Serve refusing an option
        raise CannotStart(f"bad config: {_first_line(exc)}") from None
    except (ImportError, AttributeError) as exc:  # an import path (an autoscaling_config policy) Serve cannot import
        paths = _import_paths(deployments)
        if isinstance(exc, AttributeError) and not any(_names(value, exc) for _, value in paths):
            raise
        raise CannotStart(f"bad config: {_import_problem(exc, paths)}") from None
    default = AccelerationConfig.model_fields["compile_backend"].default
    _check_compile_backend((args.get("acceleration") or {}).get("compile_backend", default))  # args passed
    return app


def _auth_notes(app: dict) -> list[str]:
    """``--check``'s notes on an application's key sources that this machine cannot confirm (the
    Ingress reads them where it runs, and fails its start when one yields no key): a variable
    unset here and not in the application's ``runtime_env.env_vars`` (nor the Ingress entry's), a file missing here
    (helper-59: ``--check`` passed both without a word)."""
    auth = (app.get("args") or {}).get("auth") or {}
    env_vars = dict(_env_vars(app.get("runtime_env")) or {})  # mappings of strings: _deploy_time_problem's
    for entry in app.get("deployments") or ():  # the Ingress entry's, which Serve merges over them (helper-65)
        if entry.get("name") == "Ingress":
            env_vars.update(_env_vars((entry.get("ray_actor_options") or {}).get("runtime_env")) or {})
    notes = []
    for field in ("api_keys", "batch_api_keys"):
        name, path = auth.get(f"{field}_env"), auth.get(f"{field}_file")
        if name is not None and not os.environ.get(name) and not env_vars.get(name):
            notes.append(f"auth.{field}_env names {name}, unset here and not in the application's "
                         "runtime_env.env_vars: the Ingress reads it in its Ray node's environment, and does not "
                         "start where it holds no key")
        if path is not None and not Path(path).is_file():
            notes.append(f"auth.{field}_file {path} is not a file here: the Ingress reads it on its own node, and "
                         "does not start where it is missing")
    return notes


def _device_notes(app: dict) -> list[str]:
    """``--check``'s note on a ``model.device`` the replica's Ray resources do not match
    (helper-64: both passed without a word): ``cuda`` with no GPU asked of Ray, where the
    replica uses a GPU Ray did not reserve for it (Ray 2.60 leaves ``CUDA_VISIBLE_DEVICES``
    alone for an actor asking none) and may be placed on a node without one; ``cpu`` with GPUs
    asked, which it reserves and never uses. The GPUs are DiTReplica's ``num_gpus``, or its
    placement group bundles' ``GPU`` (``replica.rank_resources``), as bound, a ``deployments``
    entry's over ``args``'. ``args`` were checked (:func:`checked_app`)."""
    from deployments.app import deployment_options
    from deployments.config import AppConfig

    config = AppConfig.model_validate(app["args"])
    options = dict(deployment_options(config)["DiTReplica"])
    options.update({key: value for entry in app.get("deployments") or () if entry.get("name") == "DiTReplica"
                    for key, value in entry.items() if key in ("ray_actor_options", "placement_group_bundles")})
    bundles = options.get("placement_group_bundles") or ()
    gpus = (sum(float(b.get("GPU", 0)) for b in bundles) if bundles
            else float((options.get("ray_actor_options") or {}).get("num_gpus") or 0))
    device = config.model.device
    if device.startswith("cuda") and gpus == 0:
        return [f"model.device is {device!r} but DiTReplica asks Ray for no GPU (replica.ray_actor_options.num_gpus, "
                "or replica.rank_resources' GPU with several ranks): Ray may place it on a node without one, and "
                "does not reserve the GPU it uses"]
    if device == "cpu" and gpus > 0:
        return [f"model.device is 'cpu' but DiTReplica asks Ray for {gpus:g} GPU(s), which it reserves and never uses"]
    return []


DEPLOYMENT_NAMES = ("Ingress", "Router", "DiTReplica")  # the deployments deployments.app binds


def _restart_notes(app: dict) -> list[str]:
    """``--check``'s note on an application ``runtime_env`` whose ``deployments`` section leaves
    out some of ditserve's deployments: Serve (2.60) merges the application's ``runtime_env``
    into the ``ray_actor_options`` of the deployments an entry names only, so the first entry
    naming one later (a ``user_config`` change, which the README says applies live) changes its
    actor options, and Serve restarts it; a bad ``user_config`` then fails the restarted replicas
    and the application, where a live update would have been refused with the old settings kept
    (helper-64)."""
    if not app.get("runtime_env"):
        return []
    named = {entry.get("name") for entry in app.get("deployments") or ()}
    missing = [name for name in DEPLOYMENT_NAMES if name not in named]
    if not missing:
        return []
    return [f"the application has a runtime_env and its deployments section leaves out {', '.join(missing)}: Serve "
            "merges the runtime_env into the actor options of the deployments an entry names, so an entry added "
            "later (a live user_config change) restarts that deployment; list each of "
            f"{', '.join(DEPLOYMENT_NAMES)} (with just its name) from the first deploy"]


def _check_compile_backend(backend: str) -> None:
    """Raise :class:`CannotStart` for an ``acceleration.compile_backend`` this torch's
    ``torch.compile`` does not have (each replica's start failed on it, after the cluster started).
    Only the name is checked: a registered backend whose package is missing (``tvm``,
    ``openxla``) fails at the replicas' start, on their machines. Imports torch only for a
    backend other than the default ``inductor``."""
    if backend == "inductor":
        return
    import torch
    from torch._dynamo import list_backends, lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        lookup_backend(backend)
    except InvalidBackend:
        known = [name for name in list_backends(exclude_tags=()) if "TESTING" not in name]
        raise CannotStart(f"bad application args: args.acceleration.compile_backend: torch {torch.__version__}'s "
                          f"torch.compile has no backend {backend!r}; it has {', '.join(known)}") from None


# The import paths a deployments entry may give, which Serve imports as it reads the file
_IMPORT_PATH_FIELDS = (("autoscaling_config", "policy", "policy_function"),
                       ("request_router_config", "request_router_class"))


def _import_paths(deployments: object, prefix: str = "deployments") -> list[tuple[str, str]]:
    """(field, import path) of each import path ``deployments`` (a ``deployments`` section, as
    written) gives, the field named under ``prefix``."""
    found = []
    for j, entry in enumerate(deployments if isinstance(deployments, list) else ()):
        for keys in _IMPORT_PATH_FIELDS:
            value = entry
            for key in keys:
                value = value.get(key) if isinstance(value, dict) else None
            if isinstance(value, str):
                found.append((f"{prefix}[{j}].{'.'.join(keys)}", value))
    return found


def _names(import_path: str, exc: ImportError | AttributeError) -> bool:
    """Whether ``exc`` (no such module, or no such name in one: its ``name``) is about
    ``import_path`` (``module:attr`` or ``module.attr``): the module or a package above it, or
    the attribute, one of its dotted parts (helper-82: ``deployments.nope:f`` was missed)."""
    missing = exc.name or ""
    module, _, attr = import_path.partition(":")
    if isinstance(exc, AttributeError):
        return bool(missing) and missing in re.split(r"[.:]", import_path)
    return bool(missing) and (module == missing or module.startswith(missing + ".")
                              or (not attr and import_path.startswith(missing + ".")))


def _import_problem(exc: ImportError | AttributeError, paths: list[tuple[str, str]]) -> str:
    """An import path of the config that does not import (no such module, or no such name in
    it: ``exc``), in words naming its field among ``paths`` (:func:`_import_paths`; helper-81: a
    name missing from its module was "not a Serve config ... null or of the wrong type")."""
    for field, value in paths:
        if _names(value, exc):
            return f"{field}: cannot import {value!r} ({_first_line(exc)})"
    what = exc.name if isinstance(exc, ImportError) and exc.name else "a name"
    return (f"cannot import {what} ({_first_line(exc)}), named by an import path in the config "
            "(an autoscaling_config policy's policy_function?)")


DELETE_MARGIN_S = 60.0  # waited beyond the replicas' grace for an application's deletion


def shutdown_grace_s(args: dict, deployments: list[dict] | None = None) -> float:
    """The longest ``graceful_shutdown_timeout_s`` (s) the app's deployments run with: as
    :func:`deployments.app.deployment_options` sets them (the Ingress outlasts DiTReplica and the
    Router), or as a ``deployments`` entry gives one. ``args`` were checked (:func:`checked_app`)."""
    from deployments.app import deployment_options
    from deployments.config import AppConfig

    graces = {name: options.get("graceful_shutdown_timeout_s", 20.0)  # 20 s: Serve's default
              for name, options in deployment_options(AppConfig.model_validate(args)).items()}
    graces.update({entry["name"]: float(entry["graceful_shutdown_timeout_s"]) for entry in deployments or ()
                   if entry.get("graceful_shutdown_timeout_s") is not None})
    return max(graces.values())


def start_app(args: dict, *, host: str, port: int, name: str = APP_NAME, route_prefix: str = "/",
              num_cpus: int | None = None, address: str | None = "local",
              deployments: list[dict] | None = None, on_wait=None, serve_options: dict | None = None) -> Served:
    """Deploy the app (``bind_app(args, deployments)``: ``deployments``, a config file's
    per-deployment options) as application ``name`` at ``route_prefix``. ``serve_options``: a
    config file's Serve-wide fields for ``serve.start`` (``http_options``, ``proxy_location``,
    ``logging_config``, ``controller_options``), ``http_options``' host and port replaced by
    ``host`` and ``port``.

    ``address`` is ``ray.init``'s: ``"local"`` (default) starts a new local cluster with
    ``num_cpus`` CPUs, whatever else runs on this machine; ``"auto"`` or ``HOST:PORT`` joins that
    running cluster (as does a process where Ray is initialised already). In a cluster whose Serve
    already runs, Serve keeps its HTTP options: ``Served`` holds the ones it listens on
    (``host``/``port`` are then ignored). Raises :class:`CannotStart` (one line) when the port is
    taken, no cluster answers at ``address`` or it refuses this process (token authentication),
    an application named ``name`` runs there already (it is not replaced), Serve refuses the
    application (a route prefix in use), ``args`` or ``deployments`` are bad (checked before any
    cluster starts) or the application fails to deploy (a replica's constructor raised: the
    exception's line). ``on_wait(line)``, if given, is called with each new status message Serve
    gives a deployment still starting after :func:`deploy_quiet_s` seconds (replicas waiting for
    resources the cluster lacks: the deploy waits for them, as Serve does)."""
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    from compat.ray_serve import http_options, serve_running

    check_port(port)  # also where Serve runs already (its own port stands): a mistake all the same
    app = checked_app(args, deployments)  # before any cluster starts: a mistake is one line at once
    joined = ray.is_initialized() or address != "local"
    if not ray.is_initialized():
        if address == "local":
            _port_free(host, port)
        else:
            _gcs_reachable(address)
        install_proxy_middleware()  # a cluster started here: its proxy answers its own errors in OpenAI's envelope
        try:
            handler = signal.getsignal(signal.SIGTERM)
            try:
                ray.init(address=address, num_cpus=num_cpus if address == "local" else None, log_to_driver=False)
            except SystemExit as exc:  # ray.init's own SIGTERM handler (sys.exit(15)) while it starts
                if exc.code != signal.SIGTERM or not callable(handler):
                    raise
                signal.signal(signal.SIGTERM, handler)
                ray.shutdown()  # what it had started
                raise KeyboardInterrupt from None
            if callable(handler) and threading.current_thread() is threading.main_thread():
                # ray.init puts its own SIGTERM handlers (Python's exits, then the core worker's
                # logs and dies) over the caller's (`ditserve serve`'s, which stops and cleans
                # up): the caller's is put back
                signal.signal(signal.SIGTERM, handler)
        except Exception as exc:  # noqa: BLE001 - Ray's many connection errors become one line
            said = _first_line(exc)
            if not _sends_token():  # Ray sends no token to an explicit address unless asked
                said += (f"; if the cluster uses token authentication (Ray's default), set RAY_AUTH_MODE=token "
                         f"({_TOKEN_FROM})")
            raise CannotStart(f"could not join the Ray cluster at {address}: {said}") from None
    started_serve = joined and not serve_running()
    served = None
    try:
        if joined and name in serve.status().applications:
            raise CannotStart(f"an application named {name!r} already runs in the Ray cluster at "
                              f"{ray.get_runtime_context().gcs_address}; `ditserve serve` does not replace it: name "
                              "yours otherwise in --config (applications[].name), or delete that one first")
        try:
            options = serve_options or {}
            serve.start(**{**options, "http_options": {**options.get("http_options", {}), "host": host, "port": port}})
        except Exception as exc:  # noqa: BLE001 - the proxy's bind, raised through its actor
            if "Failed to bind" not in str(exc):
                raise
            # free when checked before the cluster started, taken since (another process)
            raise CannotStart(f"cannot listen on {host}:{port} (Serve's HTTP proxy could not bind it: taken since "
                              "it was checked); choose another --port") from None
        listening = http_options()  # the running Serve's, when it ran before with others
        served = Served(name, route_prefix, listening["host"], listening["port"], joined, started_serve,
                        shutdown_grace_s(args, deployments))
        watch = _DeployWatch(name, on_wait) if on_wait is not None else None
        try:
            with _without_serve_line("Connecting to existing Serve app"):
                serve.run(app, name=name, route_prefix=route_prefix, blocking=False)
        except (RayServeException, ValueError) as exc:  # a route prefix in use, ...
            said = _first_line(exc)
            raise CannotStart(f"Serve refused application {name!r}: {said}") from None
        except RuntimeError as exc:  # DEPLOY_FAILED: a replica's constructor or user_config raised
            raise CannotStart(f"application {name!r} failed to deploy: {_why_failed(name, exc)}") from None
        finally:
            if watch is not None:
                watch.stop()
        return served
    except BaseException:
        stop_app(served or Served(name, route_prefix, host, port, joined, started_serve), deployed=served is not None,
                 drain=False)
        raise


def _serve_options_not_applied(serve_options: dict) -> list[str]:
    """The fields of a config file's ``serve_options`` (:func:`load_serve_configs`) other than
    ``http_options``' host and port, which a Serve already running keeps its own of."""
    http = [f"http_options.{field}" for field in serve_options.get("http_options", {}) if field not in ("host", "port")]
    return [*http, *(field for field in serve_options if field != "http_options")]


def deploy_quiet_s() -> float:
    """Seconds a deploy runs before its status messages are shown: when Serve gives its first
    slow-start message (a replica waiting for resources or still initialising), the larger of
    its ``RAY_SERVE_SLOW_STARTUP_WARNING_S`` and ``RAY_SERVE_SLOW_STARTUP_WARNING_PERIOD_S``
    (each else ``SERVE_...``; 30 s by default: ``ray.serve._private.deployment_state``), read
    from this process's environment, which a cluster started here passes to Serve's controller.
    Raises ``ValueError`` for a value that is not a number."""

    def serve_s(name: str) -> float:
        return float(os.environ.get(f"RAY_{name}", os.environ.get(name, 30)))

    return max(serve_s("SERVE_SLOW_STARTUP_WARNING_S"), serve_s("SERVE_SLOW_STARTUP_WARNING_PERIOD_S"))


class _DeployWatch:
    """While ``serve.run`` waits for application ``name``, a thread reads ``serve.status()``
    every few seconds once :func:`deploy_quiet_s` have passed and calls ``on_wait`` with each
    new message of a deployment not yet healthy (e.g. Serve's "has 1 replicas that have taken
    more than 30s to be scheduled ... Resources required for each replica: ..."): a deploy
    waiting for resources printed nothing."""

    def __init__(self, name: str, on_wait):
        self.name, self.on_wait = name, on_wait
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, name="ditserve-deploy-watch", daemon=True)
        self.thread.start()

    def run(self) -> None:
        from ray import serve

        said = set()
        if self.done.wait(deploy_quiet_s()):
            return
        while not self.done.is_set():
            try:
                app = serve.status().applications.get(self.name)
            except Exception:  # noqa: BLE001 - the controller is starting or stopping: read again
                app = None
            for deployment, status in (app.deployments.items() if app is not None else ()):
                message = " ".join((status.message or "").split())
                if message and status.status != "HEALTHY" and (deployment, message) not in said:
                    said.add((deployment, message))
                    self.on_wait(f"{deployment}: {message}")
            self.done.wait(5.0)

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=10)


_RAISED = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?(?:[A-Z]\w*(?:Error|Exception|Broken))(?:\(.*\))?: (.+)$")
_BARE = re.compile(r"(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)")  # raised without a message
_VALIDATION = re.compile(r"^(?:pydantic[\w.]*\.)?ValidationError: \d+ validation errors? for ")


def deploy_failure(message: str) -> str:
    """One line for Serve's ``DEPLOY_FAILED`` message (``serve.run``'s ``RuntimeError``: a
    count of failed starts, then a replica's whole traceback): the last exception line of the
    traceback (``ValueError: ...``), else the message's first line."""
    lines = [line.strip() for line in message.splitlines()]
    raised = [i for i, line in enumerate(lines) if _RAISED.match(line) or _BARE.fullmatch(line)]
    if raised:
        i = raised[-1]
        if _VALIDATION.match(lines[i]) and i + 2 < len(lines):  # pydantic: the count, then field and message
            return f"{lines[i]}: {lines[i + 1]}: {lines[i + 2]}"
        return lines[i]
    return _first_line(RuntimeError(message))


def _why_failed(name: str, exc: RuntimeError) -> str:
    """Why application ``name`` failed to deploy, in one line: the first failed deployment's
    status message (a replica's traceback) as :func:`deploy_failure` reads it, naming the
    deployment; else ``serve.run``'s error ("Failed to update the deployments [...]")."""
    from ray import serve

    try:
        app = serve.status().applications.get(name)
    except Exception:  # noqa: BLE001 - the controller went: say what serve.run said
        app = None
    for deployment, status in (app.deployments.items() if app is not None else ()):
        if status.status != "HEALTHY" and status.message:
            return f"{deployment}: {deploy_failure(status.message)}"
    return deploy_failure(str(exc))


def stop_app(served: Served, deployed: bool = True, drain: bool = True) -> None:
    """Undo :func:`start_app`: in a cluster it joined, delete its application (``deployed``)
    and, when it started Serve there and no other application runs, Serve; in one it started,
    delete the application (``drain``), then shut the cluster down. Deleting first answers
    every HTTP request in flight (the running batch finishes, queued requests get 503
    ``unavailable``): ``serve.shutdown()`` alone stops Serve's proxies first, which dropped
    their connections unanswered. The cluster's end stops Serve with it: ``serve.shutdown()``
    there only added the raylet's "Task ServeController.graceful_shutdown failed ... killed by
    `ray.kill`" line to every ``ditserve demo``. A deploy that never finished has nothing to
    drain (``drain=False``), and Serve's controller waited its whole 30 s timeout for a replica
    still being scheduled ("Controller failed to shut down within 30.0s"): that cluster is
    shut down at once."""
    import ray
    from ray import serve

    from compat.ray_serve import delete_app

    if not served.joined:
        if drain and served.name in serve.status().applications:
            delete_app(served.name, served.grace_s + DELETE_MARGIN_S)
    else:
        if deployed and served.name in serve.status().applications:
            delete_app(served.name, served.grace_s + DELETE_MARGIN_S)
        if served.started_serve and not serve.status().applications:
            serve.shutdown()
    ray.shutdown()


CLIENT_TIMEOUT_S = 600.0  # how long a client command waits for each answer (--timeout)


def _client_and_body(base_url: str, seed: int | None, steps: int | None, extra: dict | None,
                     api_key: str | None = None, timeout_s: float = CLIENT_TIMEOUT_S):
    """An OpenAI client for the server at ``base_url`` (``api_key``: the server's key when it
    has auth on; default ``$DITSERVE_API_KEY``; ``timeout_s``: the wait for each answer, s) and
    the ditserve fields for ``extra_body``."""
    from openai import OpenAI

    api_key = api_key or os.environ.get("DITSERVE_API_KEY") or "unused"
    client = OpenAI(base_url=f"{base_url}/v1", api_key=api_key, timeout=timeout_s, max_retries=0)
    body = dict(extra or {})
    nested = body.get("extra_body")
    if isinstance(nested, dict) and not set(nested) & set(body):  # a clash stays: the server names it
        body.pop("extra_body")
        body.update(nested)
    if seed is not None:
        body["seed"] = seed
    if steps is not None:
        body["num_inference_steps"] = steps
    return client, body


# file suffix -> OpenAI's output_format (anything else is written as PNG)
SUFFIX_FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".webp": "webp"}


PREVIEWS = 3  # partial_images asked for by --stream-previews (OpenAI's most)


class UsageError(ValueError):
    """A command line the CLI refuses before any request (exit code 2, as argparse's)."""


class BadAnswer(RuntimeError):
    """The server's answer is not what OpenAI's API promises: no image in a response, or a
    stream that ended without its ``completed`` event."""


def _write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path``; an ``OSError`` (a full disk, ...) names ``path``."""
    try:
        path.write_bytes(data)
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise type(exc)(exc.errno, exc.strerror or str(exc), str(path)) from exc


def _decoded(b64_json, base_url: str, what: str) -> bytes:
    """``b64_json`` decoded: a non-empty base64 string of an image file Pillow reads (its
    header: written as it came). Raises :class:`BadAnswer` naming ``what``."""
    from PIL import Image

    try:
        if isinstance(b64_json, str) and b64_json:
            data = base64.b64decode(b64_json, validate=True)
            with Image.open(io.BytesIO(data)):
                return data
    except (OSError, SyntaxError, ValueError):  # binascii.Error, UnidentifiedImageError, a bad header
        pass
    raise BadAnswer(f"the answer from {base_url} holds no image in {what} (b64_json is {shown(b64_json)})")


def _first_image(response, base_url: str) -> bytes:
    """The decoded ``data[0].b64_json`` of an images response. Raises :class:`BadAnswer`."""
    data = getattr(response, "data", None)
    if not isinstance(data, list) or not data:
        raise BadAnswer(f"the answer from {base_url} holds no image (data is {shown(data)})")
    return _decoded(getattr(data[0], "b64_json", None), base_url, "data[0]")


_PREVIEW_NAME = re.compile(r"partial-\d{1,2}\.(?:png|jpg|jpeg|webp)", re.IGNORECASE)  # .JPG from -o x.JPG once


def _streamed(events, base_url: str, output: Path, previews: Path, on_event=None) -> dict:
    """Consume an image stream (``image_generation.*`` or ``image_edit.*`` events): each
    preview written to ``previews`` as ``partial-<index>.<suffix>`` (``output``'s, in lower
    case), the final image to ``output``; return the ``ditserve`` metadata. Raises
    :class:`BadAnswer` if the stream ends without its ``completed`` event. Once the stream
    answers, an earlier run's previews in ``previews`` (``partial-<index>.<png|jpg|jpeg|webp>``,
    in any case) are removed, so the directory holds this request's only (a run with fewer
    previews left the others beside them)."""
    fresh = False
    for event in events:
        if not fresh:
            fresh = True
            for old in previews.glob("partial-*"):
                if _PREVIEW_NAME.fullmatch(old.name) and old.is_file():
                    old.unlink(missing_ok=True)
        if on_event is not None:
            on_event(event)
        kind = str(getattr(event, "type", "")).rpartition(".")[2]
        if kind == "partial_image":
            index = getattr(event, "partial_image_index", None)
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 100:
                raise BadAnswer(f"the stream from {base_url} sent a preview without a valid partial_image_index "
                                f"({shown(index)})")
            _write(previews / f"partial-{index}{output.suffix.lower() or '.png'}",
                   _decoded(getattr(event, "b64_json", None), base_url, f"preview {index}"))
        elif kind == "completed":
            _write(output, _decoded(getattr(event, "b64_json", None), base_url, "the completed event"))
            return (event.model_extra or {}).get("ditserve", {})
    raise BadAnswer(f"the stream from {base_url} ended without its image (no completed event)")


def writable(output: Path) -> Path:
    """``output``, once its directory exists and it can be written: checked before the request,
    so that a generation is not spent on a file that cannot be written. Raises ``OSError``
    (``IsADirectoryError``, ``PermissionError``, ``NotADirectoryError``, ...) naming the path."""
    _made_dir(output.parent)
    if output.is_dir():
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(output))
    try:
        if output.is_file():  # opened for appending, nothing written: what the OS allows, also for root
            with open(output, "ab"):
                pass
        elif output.exists():  # a FIFO, a device: opening one would wait for, or end, its reader
            if not os.access(output, os.W_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(output))
        else:
            _try_a_file_in(output.parent)
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, str(output)) from exc
    return output


def writable_dir(directory: Path) -> Path:
    """``directory``, created if missing, once files can be written in it (checked before the
    request). Raises ``OSError`` naming it."""
    _made_dir(directory)
    try:
        _try_a_file_in(directory)
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, str(directory)) from exc
    return directory


def _try_a_file_in(directory: Path) -> None:
    """Make and remove a file in ``directory`` (what the OS allows, also for root, whom
    ``os.access`` allows everything). Raises ``OSError``."""
    with tempfile.TemporaryFile(dir=directory):
        pass


def _made_dir(directory: Path) -> None:
    """``mkdir -p directory``. Raises ``NotADirectoryError`` naming the file that stands where
    it or a directory above it should be (``mkdir`` says "File exists" or names the directory it
    could not make), ``FileNotFoundError`` naming a dangling symbolic link there, else ``OSError``."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        blocking = next((p for p in (directory, *directory.parents) if p.is_symlink() or p.exists()), None)
        if blocking is None or blocking.is_dir():
            raise
        if not blocking.exists():  # a link to nothing
            raise FileNotFoundError(errno.ENOENT, "a symbolic link to nothing", str(blocking)) from exc
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(blocking)) from None


def _image_kwargs(output: Path, size: str | None, body: dict) -> dict:
    """The SDK arguments an image call takes from the CLI: ``size`` and the ``output_format`` of
    ``output``'s suffix (PNG unless .jpg/.jpeg/.webp; another suffix is a :class:`UsageError`);
    checks ``output`` can be written and that
    ``body`` (the ``extra_body``) leaves ``stream`` to the command. Raises ``OSError``,
    :class:`UsageError`."""
    nested = body.get("extra_body")
    if body.get("stream") is not None or (isinstance(nested, dict) and nested.get("stream") is not None):
        # the SDK reads the answer as the call's stream argument says
        raise UsageError("--extra: stream is set by the command (--stream-previews DIR streams); leave it out")
    body.pop("stream", None)
    kwargs = {"size": size} if size else {}
    if output.suffix and output.suffix.lower() not in SUFFIX_FORMATS:  # PNG bytes in a .gif was no answer
        raise UsageError(f"-o {output}: the suffix names the image format; use one of "
                         f"{', '.join(SUFFIX_FORMATS)} (or none, for PNG)")
    output_format = SUFFIX_FORMATS.get(output.suffix.lower(), "png")
    for name, given in _extra_fields(body, "output_format", "n"):
        if name == "output_format" and given != output_format:  # PNG bytes in a .webp
            raise UsageError(f"--extra: output_format {shown(given)} disagrees with -o {output}, whose suffix names "
                             f"the format ({output_format}); leave it out")
        if name == "n" and given != 1:  # the images past the first were made and dropped
            raise UsageError(f"--extra: n {shown(given)}: the command writes one image (-o); run it once per "
                             "image (--seed), or call the API for several")
    if output_format != "png":
        kwargs["output_format"] = output_format
    writable(output)
    return kwargs


def _extra_fields(body: dict, *names: str):
    """``(name, value)`` of each of ``names`` that ``body`` (the ``extra_body``) gives, itself or
    in a nested ``extra_body``."""
    nested = body.get("extra_body")
    for source in (body, nested if isinstance(nested, dict) else {}):
        for name in names:
            if name in source:
                yield name, source[name]


def _form_fields(body: dict) -> dict:
    """``body`` as the ``extra_body`` of a multipart request (``images.edit``, ``videos.create``):
    lists and objects as JSON text, one field each, which the server reads as JSON. The SDK's
    bracket names send a list of objects grouped by field (``lora[][name]``, then
    ``lora[][scale]``), which cannot say whose scale it is when items differ (``--lora a
    --lora b:0.5``)."""
    return {key: json.dumps(value) if isinstance(value, (list, dict)) else value for key, value in body.items()}


def previews_asked(extra: dict | None) -> int:
    """The ``partial_images`` a ``--stream-previews`` request asks for: ``extra``'s, itself or
    in a nested ``extra_body`` (``null`` or absent: :data:`PREVIEWS`)."""
    extra = extra or {}
    asked, nested = extra.get("partial_images"), extra.get("extra_body")
    if asked is None and isinstance(nested, dict):
        asked = nested.get("partial_images")
    return PREVIEWS if asked is None else asked


def generate_image(base_url: str, prompt: str, output: Path, *, size: str | None = None,
                   seed: int | None = None, steps: int | None = None, extra: dict | None = None,
                   api_key: str | None = None, previews: Path | None = None, on_event=None,
                   timeout_s: float = CLIENT_TIMEOUT_S) -> dict:
    """POST one image request with the OpenAI client, write the image to ``output`` (its
    suffix picks ``output_format``: .png, .jpg/.jpeg, .webp); return the metadata. With
    ``previews`` (a directory) the request is streamed (``stream``, ``partial_images`` 3 unless
    ``extra`` gives it): each
    preview is written there as ``partial-<index>.<suffix>`` and ``on_event(event)`` sees every
    streamed event as it arrives. ``timeout_s``: the wait for the answer (and each event), s."""
    client, body = _client_and_body(base_url, seed, steps, extra, api_key, timeout_s)
    kwargs = _image_kwargs(output, size, body)
    if previews is None:
        response = client.images.generate(prompt=prompt, response_format="b64_json", extra_body=body, **kwargs)
        _write(output, _first_image(response, base_url))
        return (response.model_extra or {}).get("ditserve", {})
    writable_dir(previews)
    body["partial_images"] = previews_asked(body)  # --extra may ask for fewer
    return _streamed(client.images.generate(prompt=prompt, stream=True, extra_body=body, **kwargs),
                     base_url, output, previews, on_event)


def edit_image(base_url: str, image: Path, prompt: str, output: Path, *, mask: Path | None = None,
               strength: float | None = None, size: str | None = None, seed: int | None = None,
               steps: int | None = None, extra: dict | None = None, api_key: str | None = None,
               previews: Path | None = None, on_event=None, timeout_s: float = CLIENT_TIMEOUT_S) -> dict:
    """POST one edit (OpenAI's ``images.edit``: ``image`` and optional ``mask`` uploaded as
    files) with the OpenAI client, write the image to ``output`` (its suffix picks
    ``output_format``); return the metadata. ``strength`` in (0, 1]: how much of the run
    re-noises the image (image-to-image, inpainting). ``previews``, ``on_event``, ``timeout_s``:
    as :func:`generate_image`'s (``image_edit.*`` events)."""
    client, body = _client_and_body(base_url, seed, steps, extra, api_key, timeout_s)
    if strength is not None:
        body["strength"] = strength
    kwargs = _image_kwargs(output, size, body)
    if mask is not None:
        kwargs["mask"] = (mask.name, mask.read_bytes())
    upload = (image.name, image.read_bytes())
    if previews is None:
        response = client.images.edit(image=upload, prompt=prompt, response_format="b64_json",
                                      extra_body=_form_fields(body), **kwargs)
        _write(output, _first_image(response, base_url))
        return (response.model_extra or {}).get("ditserve", {})
    writable_dir(previews)
    body["partial_images"] = previews_asked(body)
    return _streamed(client.images.edit(image=upload, prompt=prompt, stream=True, extra_body=_form_fields(body),
                                        **kwargs), base_url, output, previews, on_event)


def generate_video(base_url: str, prompt: str, output: Path, *, size: str | None = None,
                   seconds: str | None = None, seed: int | None = None, steps: int | None = None,
                   extra: dict | None = None, poll_s: float = 0.2, on_progress=None, api_key: str | None = None,
                   input_reference: Path | None = None, timeout_s: float = CLIENT_TIMEOUT_S) -> dict:
    """Create a video job with the OpenAI client, poll it to the end, write the MP4 to ``output``;
    return the final job. ``input_reference``: an image file that becomes the first frame
    (image-to-video models). ``timeout_s``: the wait for each answer (s); the job is followed
    as long as it runs. Raises :class:`VideoJobFailed` if the job fails, and on Ctrl-C
    while the job runs deletes it (best effort, :data:`CANCEL_TIMEOUT_S`) and raises
    :class:`VideoJobCancelled` (once it completed, a plain ``KeyboardInterrupt``: the job stays).
    Raises :class:`UsageError` for an ``output`` suffix other than .mp4 (the job's content is MP4)."""
    if output.suffix and output.suffix.lower() != ".mp4":  # MP4 bytes in a .gif
        raise UsageError(f"-o {output}: a video is written as MP4; use the suffix .mp4 (or none)")
    writable(output)
    client, body = _client_and_body(base_url, seed, steps, extra, api_key, timeout_s)
    kwargs = {k: v for k, v in (("size", size), ("seconds", seconds)) if v}
    if input_reference is not None:
        kwargs["input_reference"] = (input_reference.name, input_reference.read_bytes())
    # the server keeps the job a key made: sent again, the create answers with it (no second job)
    key = f"ditserve-cli-{uuid.uuid4().hex}"

    def create(on):
        return on.videos.create(prompt=prompt, extra_body=_form_fields(body), extra_headers={"Idempotency-Key": key},
                                **kwargs)

    try:
        job = create(client)
    except KeyboardInterrupt:
        # the server may have made the job before its answer came: the same create finds it
        # (or makes it), then it is deleted, so nothing runs that nobody follows
        raise _cancelled_create(client, create) from None
    if not isinstance(getattr(job, "id", None), str) or not job.id:
        raise BadAnswer(f"the answer from {base_url} to the video create holds no job id "
                        f"(id is {shown(getattr(job, 'id', None))})")
    with _following(job.id):
        try:
            while job.status not in ("completed", "failed"):
                time.sleep(poll_s)
                job = client.videos.retrieve(job.id)
                if on_progress is not None:
                    on_progress(job)
        except KeyboardInterrupt:
            raise VideoJobCancelled(job.id, _deleted(client, job.id)) from None
        if job.status == "failed":
            raise VideoJobFailed(job.id, getattr(job.error, "code", None), getattr(job.error, "message", None))
        # completed: Ctrl-C from here on keeps the job (its MP4 can be downloaded again)
        content = client.videos.download_content(job.id).read()
    _write(output, content)
    return job.model_dump()


@contextlib.contextmanager
def _following(video_id: str):
    """Raise :class:`VideoJobLost` for a connection that fails while job ``video_id`` (created:
    the server answered) is followed, not "no server", and for a 404 that is not the job's own
    ``video_not_found`` (Serve's proxy once the app is gone: for a few seconds while a server
    stops, before its port closes); a timeout stays a timeout."""
    from openai import APIConnectionError, APITimeoutError, NotFoundError

    try:
        yield
    except APITimeoutError:
        raise
    except APIConnectionError as exc:
        raise VideoJobLost(video_id, exc.__cause__ or exc) from exc
    except NotFoundError as exc:
        if getattr(exc, "code", None) == "video_not_found":  # the server says the job is gone: its line
            raise
        raise VideoJobLost(video_id, exc) from exc


CANCEL_TIMEOUT_S = 5.0  # how long Ctrl-C waits for the server to delete the job


def _cancelled_create(client, create) -> KeyboardInterrupt:
    """Ctrl-C during a video job's create: send ``create`` (its Idempotency-Key) again within
    :data:`CANCEL_TIMEOUT_S` and delete the job it answers with. :class:`VideoJobCancelled` for
    that job, or a plain ``KeyboardInterrupt`` when the server did not answer."""
    try:
        job = create(client.with_options(timeout=CANCEL_TIMEOUT_S, max_retries=0))
    except (Exception, KeyboardInterrupt):
        return KeyboardInterrupt()
    return VideoJobCancelled(job.id, _deleted(client, job.id))


def _deleted(client, video_id: str) -> bool:
    """``DELETE /v1/videos/{video_id}``: whether the server deleted the job (within
    :data:`CANCEL_TIMEOUT_S`; a second Ctrl-C gives up)."""
    try:
        client.with_options(timeout=CANCEL_TIMEOUT_S, max_retries=0).videos.delete(video_id)
        return True
    except (Exception, KeyboardInterrupt):
        return False


class VideoJobCancelled(KeyboardInterrupt):
    """Ctrl-C while a video job ran: its id, and whether the server deleted it."""

    def __init__(self, video_id: str, deleted: bool):
        super().__init__(video_id)
        self.video_id, self.deleted = video_id, deleted


class VideoJobLost(RuntimeError):
    """The connection to the server failed, or its app's route answered 404, while following
    video job ``video_id`` (it was created: the server answered before)."""

    def __init__(self, video_id: str, cause: BaseException):
        super().__init__(video_id, type(cause).__name__)
        self.video_id, self.cause = video_id, cause

    def __reduce__(self):  # pickled with its fields (Exception's default re-calls __init__ with its args)
        return type(self), (self.video_id, self.cause)


class VideoJobFailed(RuntimeError):
    """A video job ended ``failed``: its id and the job's ``error`` (``code``, ``message``)."""

    def __init__(self, video_id: str, code: str | None, message: str | None):
        super().__init__(f"video {video_id} failed: {message or 'no reason given'}")
        self.video_id, self.code, self.message = video_id, code, message

    def __reduce__(self):  # pickled with its fields (Exception's default re-calls __init__ with the message)
        return type(self), (self.video_id, self.code, self.message)


def _cmd_serve(ns) -> int:
    previous = signal.getsignal(signal.SIGTERM)
    try:
        return _serve_until_stopped(ns)
    finally:  # the process's own handler again (main() may be called in a longer-lived process)
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def _listen_address(ns, http_options: dict) -> tuple[str, int]:
    """The host and port ``ditserve serve`` listens on: ``--host``/``--port`` where given, else
    the config's ``http_options``. Raises :class:`CannotStart` for an empty host (naming where it
    came from) or a port outside 1-65535."""
    host = http_options["host"] if ns.host is None else ns.host
    port = http_options["port"] if ns.port is None else ns.port
    check_host(host, "http_options.host" if ns.host is None else "--host")
    check_port(port)
    return host, port


def _serve_until_stopped(ns) -> int:
    """``ditserve serve``: start the app, wait for Ctrl-C or SIGTERM (also while it starts), stop it."""
    stop = threading.Event()

    def on_sigterm(*_) -> None:
        if served is None:  # still starting: stop that (start_app undoes what it did), as Ctrl-C does
            raise KeyboardInterrupt
        stop.set()

    served = None
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        default = {"name": APP_NAME, "args": {}, "route_prefix": "/", "http_options": {"host": "127.0.0.1",
                                                                                      "port": 8000}}
        if ns.check:  # the file's checks, no cluster: before a `serve deploy` of it, which runs none of them
            apps, _ = load_serve_configs(ns.config) if ns.config else ([default], [])
            _listen_address(ns, apps[0]["http_options"])
            for app in apps:
                try:
                    checked_app(app["args"], app.get("deployments"))
                except CannotStart as exc:
                    raise CannotStart(f"application {app['name']!r}: {exc}" if len(apps) > 1 else str(exc)) from None
            for app in apps:
                for note in _auth_notes(app) + _restart_notes(app) + _device_notes(app):
                    print(f"note: application {app['name']!r}: {note}", file=sys.stderr, flush=True)
            names = ", ".join(repr(app["name"]) for app in apps)
            print(f"{ns.config or 'the default config'}: application{'s' if len(apps) > 1 else ''} {names} "
                  f"pass{'' if len(apps) > 1 else 'es'} ditserve's checks (args, deployments entries, user_configs, "
                  "port number; whether the port is free is known only where it is served)", flush=True)
            return 0
        config = load_serve_config(ns.config) if ns.config else default
        host, port = _listen_address(ns, config["http_options"])
        address = ns.address or os.environ.get("RAY_ADDRESS") or "local"
        served = start_app(config["args"], host=host, port=port, name=config["name"],
                           route_prefix=config["route_prefix"], address=address, deployments=config.get("deployments"),
                           serve_options=config.get("serve_options"),
                           on_wait=lambda line: print(f"waiting: {line}", file=sys.stderr, flush=True))
    except CannotStart as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted while starting", file=sys.stderr, flush=True)
        return 130
    if served.joined:
        import ray

        print(f"joined the Ray cluster at {ray.get_runtime_context().gcs_address}: application {served.name!r} "
              "deployed there (Ctrl-C deletes it and leaves the cluster's other applications running)", flush=True)
        if (served.host, served.port) != (host, port):
            print(f"note: Serve already runs in that cluster and keeps its HTTP options ({served.host}:{served.port}): "
                  f"{host}:{port} is not used", flush=True)
        kept = _serve_options_not_applied(config.get("serve_options") or {}) if not served.started_serve else []
        if kept:  # serve.start keeps a running Serve's options (helper-82: the file's were dropped unsaid)
            print(f"note: Serve already runs in that cluster and keeps its own options: the file's "
                  f"{', '.join(kept)} {'is' if len(kept) == 1 else 'are'} not applied", flush=True)
    url = served.url
    print(f"ditserve is serving at {url}  (POST {url}/v1/images/generations, /v1/images/edits or /v1/videos; "
          "Ctrl-C stops)",
          flush=True)
    if not served.joined:  # where another Ray job finds the app's handle ("auto" may find another cluster)
        import ray

        print(f"its Ray cluster: {ray.get_runtime_context().gcs_address} (a Python caller of its handle: "
              f"ray.init(address={ray.get_runtime_context().gcs_address!r}), with RAY_AUTH_MODE=token)", flush=True)
    try:
        while not stop.wait(1.0):  # a timeout: the wait returns to Python, where the signal handler runs
            pass
    except KeyboardInterrupt:
        pass
    print("shutting down", flush=True)
    stop_app(served)
    return 0


def _transport_modules() -> list:
    """The HTTP libraries whose errors the OpenAI SDK raises (wrapped in ``APIConnectionError``
    when a request fails, unwrapped when a stream's read fails): ``httpx``, and ``httpx2`` (the
    SDK's transport from openai 3)."""
    modules = []
    for name in ("httpx", "httpx2"):
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            pass
    return modules


# what OpenSSL says when a TLS handshake gets a plain-HTTP answer (ditserve's port speaks HTTP):
# not a certificate's failure, which a TLS ingress in front of ditserve may well have
_PLAIN_HTTP_ANSWERS = ("WRONG_VERSION_NUMBER", "wrong version number", "record layer failure",
                       "packet length too long", "HTTP_REQUEST")


def failure_line(exc: BaseException, url: str, timeout_s: float = CLIENT_TIMEOUT_S) -> str | None:
    """The one line ``ditserve generate`` / ``edit`` / ``video`` print for a failed call (None:
    not a failure of the call, let it raise): no server at ``url`` (and how to start one), a
    connection lost before the answer was complete, a timeout, the server's error envelope
    (status, code, field, message), a failed video job, or a file that cannot be read or
    written."""
    from openai import APIConnectionError, APIError, APIStatusError, APITimeoutError

    transports = _transport_modules()
    if isinstance(exc, VideoJobLost) and isinstance(exc.cause, APIStatusError):  # its app's route is gone
        return (f"error: {url} stopped serving the app while following video job {exc.video_id} (HTTP "
                f"{exc.cause.status_code}: no application at its path); is the server still running?")
    if isinstance(exc, VideoJobLost):
        return (f"error: the connection to {url} was lost while following video job {exc.video_id} "
                f"({type(exc.cause).__name__}); is the server still running?")
    if isinstance(exc, (APITimeoutError, *(m.TimeoutException for m in transports))):
        return (f"error: {url} did not answer within {timeout_s:g} s (--timeout); is the server overloaded, or "
                "the request longer than that?")
    if isinstance(exc, APIConnectionError) and isinstance(exc.__cause__, tuple(m.ConnectError for m in transports)):
        if url.startswith("https:") and any(mark in str(exc.__cause__) for mark in _PLAIN_HTTP_ANSWERS):
            return (f"error: {url} does not speak TLS ({_first_line(exc.__cause__)}); a ditserve server answers "
                    f"plain HTTP: --url http://{url.removeprefix('https://')}")
        if url.startswith("https:") and "[SSL" in str(exc.__cause__):  # a certificate, a TLS version, ...
            return (f"error: the TLS handshake with {url} failed ({_first_line(exc.__cause__)}); check the "
                    "certificate of the TLS endpoint in front of the server")
        return (f"error: no ditserve server at {url}; start one with `ditserve serve` "
                f"(or `ditserve serve --config configs/tiny-cpu.yaml`), or pass --url")
    if isinstance(exc, (APIConnectionError, *(m.TransportError for m in transports))):  # a stream's read: unwrapped
        cause = exc.__cause__ if isinstance(exc, APIConnectionError) and exc.__cause__ else exc
        return (f"error: the connection to {url} was lost before the answer was complete "
                f"({type(cause).__name__}); is the server still running?")
    if isinstance(exc, APIStatusError):
        try:
            error = exc.response.json()["error"]
            line = _error_line(exc.status_code, error.get("code"), error.get("param"), error.get("message"))
        except (ValueError, KeyError, TypeError, AttributeError):  # not ditserve's envelope (a proxy's page, ...)
            line = _error_line(exc.status_code, None, None, exc.response.text)
        retry_after = " ".join(exc.response.headers.get("retry-after", "").split())[:40]
        if retry_after:  # seconds, or an HTTP date (RFC 9110 10.2.3): as given
            line += f" (Retry-After: {retry_after}{' s' if retry_after.isdigit() else ''})"
        if exc.status_code == 401:
            line += " (the CLI sends --api-key, default $DITSERVE_API_KEY)"
        return line
    if isinstance(exc, APIError):  # an error event of a stream, or an answer the SDK could not read
        if isinstance(exc.body, dict):
            return _error_line(None, exc.body.get("code"), exc.body.get("param"), exc.message)
        return _error_line(None, None, None, exc.body if isinstance(exc.body, str) and exc.body else exc.message)
    if isinstance(exc, VideoJobFailed):
        return _error_line(None, exc.code, None, str(exc))
    if isinstance(exc, (BadAnswer, UsageError)):
        return f"error: {exc}"
    if isinstance(exc, json.JSONDecodeError):  # the SDK parses every answer and streamed event
        return f"error: the answer from {url} is not valid JSON ({exc.msg} at character {exc.pos})"
    if isinstance(exc, OSError):  # --image, -o, --stream-previews, ...
        return f"error: {exc.filename}: {exc.strerror or exc}" if exc.filename is not None else f"error: {exc}"
    return None


def _error_line(status: int | None, code: str | None, param: str | None, message) -> str:
    """``error [STATUS] [CODE] [(PARAM)]: MESSAGE`` on one line (at most 500 characters of it)."""
    def folded(text) -> str:
        return " ".join(str(text).split())[:500]

    head = " ".join(["error", *(folded(part) for part in (status, code) if part)])
    where = f" ({folded(param)})" if param else ""
    return f"{head}{where}: {folded(message) or '(the answer gave no message)'}"


def _run_client(call, url: str, timeout_s: float = CLIENT_TIMEOUT_S):
    """``call()``, with any failure printed as one line on stderr: (result, exit code: 2 for
    a refused command line, 1 for a failed call). ``timeout_s``: the client's wait, as the
    timeout's line says it."""
    try:
        return call(), 0
    except Exception as exc:
        line = failure_line(exc, url, timeout_s)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return None, 2 if isinstance(exc, UsageError) else 1


def lora_arg(value: str) -> dict:
    """``--lora NAME[:SCALE]`` → one entry of the request's ``lora`` list."""
    name, _, scale = value.rpartition(":") if ":" in value else (value, "", "")
    number = _number(scale) if scale else None
    if number is not None and not math.isfinite(number):  # nan/inf: JSON has no such number
        raise argparse.ArgumentTypeError(f"--lora takes NAME or NAME:SCALE (a finite number), got {value!r}")
    return {"name": name, **({"scale": number} if scale else {})}


def server_url(value: str) -> str:
    """``--url``: the server's base URL, ``http(s)://HOST[:PORT][/PREFIX]`` (its Serve route
    prefix, if not ``/``), returned without a trailing ``/`` and without a trailing ``/v1`` (as
    OpenAI clients write a base URL): the commands add ``/v1/...`` themselves. Raises
    ``argparse.ArgumentTypeError`` for anything else (no scheme, another scheme, no host, a
    port that is not a number, a query or fragment)."""
    parts = urllib.parse.urlsplit(value.strip())
    try:
        port_ok = parts.port is None or 0 < parts.port
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"takes the server's URL http(s)://HOST:PORT[/PREFIX] "
                                         f"(e.g. http://127.0.0.1:8000), got {value[:80]!r}")
    path = parts.path.rstrip("/")
    path = path[:-len("/v1")] if path.endswith("/v1") else path
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _number(text: str) -> float:
    """``text`` as a float; NaN for text that is no number (refused with the argument's own words)."""
    try:
        return float(text)
    except ValueError:
        return math.nan


MAX_CLIENT_TIMEOUT_S = 7 * 24 * 3600.0  # --timeout's bound (a socket's timeout overflows near 1e10 s)


def positive_seconds(value: str) -> float:
    """``--timeout``: a number of seconds in (0, :data:`MAX_CLIENT_TIMEOUT_S`]."""
    seconds = _number(value)
    if not 0 < seconds <= MAX_CLIENT_TIMEOUT_S:  # nan too
        raise argparse.ArgumentTypeError(f"takes seconds, a number > 0 and at most {MAX_CLIENT_TIMEOUT_S:g} "
                                         f"(7 days), got {value[:80]!r}")
    return seconds


def _client_options(p: argparse.ArgumentParser) -> None:
    """The options every client command has: the server's API key and the client's wait."""
    p.add_argument("--api-key", help="the server's API key when it has auth on (default: $DITSERVE_API_KEY)")
    p.add_argument("--timeout", type=positive_seconds, default=CLIENT_TIMEOUT_S, metavar="SECONDS",
                   help="how long to wait for each answer of the server (default: %(default)g); a video job is "
                        "followed as long as it runs")


def json_object_arg(value: str) -> dict:
    """``--extra``: a JSON object of request fields (anything else is a usage error, ``NaN`` and
    ``Infinity`` too: Python's ``json`` reads them, JSON has no such numbers)."""
    def no_constant(name: str):
        raise argparse.ArgumentTypeError(f"not JSON ({name} is no JSON number; give a finite number): {value[:80]!r}")

    def finite(text: str) -> float:  # 1e400 reads as inf
        number = float(text)
        if not math.isfinite(number):
            raise argparse.ArgumentTypeError(f"{text} is out of a float's range (give a finite number): "
                                             f"{value[:80]!r}")
        return number

    try:
        body = json.loads(value, parse_constant=no_constant, parse_float=finite)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg} at character {exc.pos}): {value[:80]!r}") from None
    if not isinstance(body, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"guidance_scale\": 4}}', "
                                         f"got {type(body).__name__} {value[:80]!r}")
    return body


# request field -> (the parsed arguments' attribute, the argument as a person types it) of the
# client commands' arguments that set a request field themselves
FIELD_ARGUMENTS = {"prompt": ("prompt", "PROMPT"), "image": ("image", "IMAGE"), "mask": ("mask", "--mask"),
                   "seed": ("seed", "--seed"), "num_inference_steps": ("steps", "--steps"), "size": ("size", "--size"),
                   "strength": ("strength", "--strength"), "seconds": ("seconds", "--seconds"),
                   "input_reference": ("input_reference", "--input-reference"), "lora": ("lora", "--lora")}


def _request_extra(ns) -> dict | None:
    """A client command's ``--extra`` with its ``--lora`` adapters added. Raises
    :class:`UsageError` for a field ``--extra`` gives (itself or in a nested ``extra_body``)
    that an argument given to the command sets too (one of the two was silently dropped), and
    for an image command's ``response_format`` (it reads ``b64_json``)."""
    extra = ns.extra or {}
    given = {field: argument for field, (attr, argument) in FIELD_ARGUMENTS.items()
             if getattr(ns, attr, None) is not None}
    set_by_command = ("response_format",) if ns.command in ("generate", "edit") else ()
    if ns.command in ("generate", "edit") and not ns.stream_previews:
        set_by_command += ("partial_images",)
    for name, value in _extra_fields(extra, *given, *set_by_command):
        if name == "partial_images":
            if value:  # 0 asks for none: what an unstreamed request gets anyway
                raise UsageError(f"--extra: partial_images {shown(value)}: previews come with a streamed request; "
                                 "add --stream-previews DIR")
            continue
        if name == "response_format":
            if value != "b64_json":  # what the command sends anyway
                raise UsageError(f"--extra: response_format {shown(value)}: the command reads b64_json (it writes "
                                 "the image's bytes); leave it out")
            continue
        raise UsageError(f"--extra: {name} is set by {given[name]} too; give it once")
    if ns.lora:
        return {**extra, "lora": ns.lora}
    return ns.extra


def _with_preview_bar(ns, call):
    """``call(on_event)`` with a progress bar over the streamed images, the previews and the final
    one ("images: 4/4" for 3 previews; helper-78: it was labelled "previews"), drawn once the first
    arrives, closed before the result or a failure line is printed: its result and exit code."""
    from tqdm import tqdm

    bars = []

    def show(event) -> None:
        if not bars:
            asked = previews_asked(ns.extra)  # what the server accepted (ditserve's: 0..3)
            total = asked + 1 if isinstance(asked, int) and 0 <= asked <= 100 else None  # None: no total
            bars.append(tqdm(total=total, file=sys.stderr, dynamic_ncols=True, unit="image", desc="images",
                             bar_format="{desc}: {n}" + ("/{total}|{bar}|" if total else "") + " {elapsed}"))
        bars[0].update(1)

    def run():
        try:
            result = call(show)
            for bar in bars:  # done: fewer previews than asked come when there are fewer steps
                bar.total = bar.n
            return result
        finally:
            for bar in bars:
                bar.close()

    return _run_client(run, ns.url, ns.timeout)


def _cmd_generate(ns) -> int:
    meta, rc = _with_preview_bar(ns, lambda show: generate_image(
        ns.url, ns.prompt, Path(ns.output), size=ns.size, seed=ns.seed, steps=ns.steps,
        extra=_request_extra(ns), api_key=ns.api_key, timeout_s=ns.timeout,
        previews=Path(ns.stream_previews) if ns.stream_previews else None, on_event=show))
    return _written(ns.output, meta, rc)


def _cmd_edit(ns) -> int:
    meta, rc = _with_preview_bar(ns, lambda show: edit_image(
        ns.url, Path(ns.image), ns.prompt, Path(ns.output), mask=Path(ns.mask) if ns.mask else None,
        strength=ns.strength, size=ns.size, seed=ns.seed, steps=ns.steps, extra=_request_extra(ns),
        api_key=ns.api_key, timeout_s=ns.timeout, previews=Path(ns.stream_previews) if ns.stream_previews else None,
        on_event=show))
    return _written(ns.output, meta, rc)


def _written(output: str, result, rc: int) -> int:
    """A client command's end: its exit code, and on success the file written and its metadata."""
    if rc:
        return rc
    print(f"wrote {output}")
    print(json.dumps(result, indent=2))
    return 0


def _cmd_video(ns) -> int:
    from tqdm import tqdm

    bars = []  # the progress bar, drawn once the job exists (a refused request prints only its error)

    def show(job) -> None:  # the job's status and progress (percent) as the server reports them
        if not bars:  # drawn with its first label (created empty, its first frame had none)
            bars.append(tqdm(total=100, file=sys.stderr, dynamic_ncols=True, desc=str(job.status),
                             bar_format="{desc:>11}: {percentage:3.0f}%|{bar}| {elapsed}"))
        bars[0].set_description_str(str(job.status), refresh=False)  # drawn with its progress: no "completed: 99%"
        bars[0].update(max(0, int(job.progress or 0) - bars[0].n))

    def run() -> dict:
        try:
            return generate_video(ns.url, ns.prompt, Path(ns.output), size=ns.size, seconds=ns.seconds, seed=ns.seed,
                                  steps=ns.steps, extra=_request_extra(ns), api_key=ns.api_key,
                                  on_progress=show, timeout_s=ns.timeout,
                                  input_reference=Path(ns.input_reference) if ns.input_reference else None)
        finally:
            for bar in bars:
                bar.close()

    try:
        job, rc = _run_client(run, ns.url, ns.timeout)
    except VideoJobCancelled as exc:
        print(f"cancelled: video job {exc.video_id} " + ("deleted on the server" if exc.deleted else
              f"may still run on the server (DELETE {ns.url}/v1/videos/{exc.video_id} failed)"),
              file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports Ctrl-C
    return _written(ns.output, job, rc)


def _cmd_demo(ns) -> int:
    port = free_port("127.0.0.1")
    print("starting Ray Serve with the embedded tiny-flux model ...", flush=True)
    try:
        served = start_app({}, host="127.0.0.1", port=port, num_cpus=4)  # its own local cluster, always
    except CannotStart as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        meta = generate_image(served.url, ns.prompt, Path(ns.output), size=ns.size, seed=ns.seed)
    finally:
        stop_app(served)
    output = Path(ns.output).resolve()
    print(f"prompt: {ns.prompt!r}")
    print(f"metadata: {json.dumps(meta)}")
    print(f"image written to {output}")
    return 0


CLIENT_COMMANDS = ("generate", "edit", "video")  # the commands that call a running server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ditserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the app until Ctrl-C (on a new local Ray cluster unless --address "
                                     "or $RAY_ADDRESS names a running one)")
    p.add_argument("--config", help="a Serve config file (e.g. configs/tiny-cpu.yaml); default: tiny-flux")
    p.add_argument("--address", help="a running Ray cluster to deploy into: HOST:PORT, or auto for the one on "
                                     "this machine (default: $RAY_ADDRESS, else a new local cluster)")
    p.add_argument("--host", help="the address Serve's HTTP proxy listens on (default: the config file's "
                                  "http_options.host, as Ray Serve reads it; without --config 127.0.0.1)")
    p.add_argument("--port", type=int, help="its port (default: the config file's http_options.port; "
                                            "without --config 8000)")
    p.add_argument("--check", action="store_true", help="check the config file (args, deployments entries and "
                   "their user_configs) and exit, starting nothing: before a `serve deploy` of it")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("generate", help="request one image from a running server and save it")
    p.add_argument("prompt")
    p.add_argument("-o", "--output", required=True, help="image file to write (.png, .jpg or .webp: its format)")
    p.add_argument("--url", type=server_url, default="http://127.0.0.1:8000",
                   help="the server (its route prefix too, if not /; default: %(default)s)")
    p.add_argument("--size", help="WIDTHxHEIGHT in pixels")
    p.add_argument("--seed", type=int)
    p.add_argument("--steps", type=int, help="num_inference_steps")
    p.add_argument("--extra", type=json_object_arg, help="JSON object of extra request fields, e.g. '{\"guidance_scale\": 4}'")
    p.add_argument("--lora", action="append", type=lora_arg, metavar="NAME[:SCALE]",
                   help="a registered LoRA adapter to apply (repeatable), e.g. --lora magenta:0.8")
    p.add_argument("--stream-previews", metavar="DIR",
                   help="stream the request and save its previews in DIR (3 partial images; "
                        "--extra '{\"partial_images\": N}' for N in 0..3)")
    _client_options(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("edit", help="edit one image on a running server (image-to-image, or inpainting with --mask)")
    p.add_argument("image", help="the input image (PNG, JPEG or WebP)")
    p.add_argument("prompt")
    p.add_argument("-o", "--output", required=True, help="image file to write (.png, .jpg or .webp: its format)")
    p.add_argument("--mask", help="a PNG the image's size whose transparent pixels (alpha 0) mark what to repaint")
    p.add_argument("--strength", type=float, help="in (0, 1]: the share of the steps that re-noise the image")
    p.add_argument("--url", type=server_url, default="http://127.0.0.1:8000",
                   help="the server (its route prefix too, if not /; default: %(default)s)")
    p.add_argument("--size", help="WIDTHxHEIGHT in pixels (default: the image's size)")
    p.add_argument("--seed", type=int)
    p.add_argument("--steps", type=int, help="num_inference_steps")
    p.add_argument("--extra", type=json_object_arg, help="JSON object of extra request fields, e.g. '{\"guidance_scale\": 4}'")
    p.add_argument("--lora", action="append", type=lora_arg, metavar="NAME[:SCALE]",
                   help="apply a registered LoRA adapter (repeatable)")
    p.add_argument("--stream-previews", metavar="DIR",
                   help="stream the edit and save its previews in DIR (3 partial images; "
                        "--extra '{\"partial_images\": N}' for N in 0..3)")
    _client_options(p)
    p.set_defaults(func=_cmd_edit)

    p = sub.add_parser("video", help="create one video job on a running server, wait for it, save the MP4")
    p.add_argument("prompt")
    p.add_argument("-o", "--output", required=True, help="MP4 file to write")
    p.add_argument("--url", type=server_url, default="http://127.0.0.1:8000",
                   help="the server (its route prefix too, if not /; default: %(default)s)")
    p.add_argument("--size", help="WIDTHxHEIGHT in pixels")
    p.add_argument("--seconds", help="length in whole seconds (or give num_frames in --extra)")
    p.add_argument("--seed", type=int)
    p.add_argument("--steps", type=int, help="num_inference_steps")
    p.add_argument("--extra", type=json_object_arg, help="JSON object of extra request fields, e.g. '{\"num_frames\": 17}'")
    p.add_argument("--input-reference", metavar="IMAGE", help="an image that becomes the first frame (image-to-video)")
    p.add_argument("--lora", action="append", type=lora_arg, metavar="NAME[:SCALE]",
                   help="a registered LoRA adapter to apply (repeatable)")
    _client_options(p)
    p.set_defaults(func=_cmd_video)

    p = sub.add_parser("demo", help="start the app on tiny-flux, generate one image over HTTP, shut down")
    p.add_argument("-o", "--output", default="out/demo.png")
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--size", default="64x64")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_demo)

    ns = parser.parse_args(argv)
    if ns.command not in CLIENT_COMMANDS:
        return ns.func(ns)
    with warnings.catch_warnings(), _sigterm_interrupts():
        # the SDK's DeprecationWarnings (its videos API's) were lines of their own under python -m
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return ns.func(ns)
        except KeyboardInterrupt:
            # one line, as for every other way a client command ends early (a video job already
            # created was deleted by _cmd_video; an image request stops when its connection closes)
            print("interrupted", file=sys.stderr, flush=True)
            return 130  # 128 + SIGINT, as a shell reports Ctrl-C


@contextlib.contextmanager
def _sigterm_interrupts():
    """While a client command runs, SIGTERM (``kill``, a job runner's stop) ends it as Ctrl-C
    does (a running video job is deleted on the server; it kept running), exit 130. Only in
    the main thread (where Python runs signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(*_) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
