"""Every Serve config in configs/ is accepted by Ray Serve's schema and by AppConfig."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments.cli import load_serve_config
from deployments.config import AppConfig, BatchingConfig, LimitsConfig

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates(path):
    ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    app = load_serve_config(path)
    AppConfig.model_validate(app["args"])


def test_misspelled_arg_is_caught():
    with pytest.raises(ValidationError, match="max_batch_sise"):
        AppConfig.model_validate({"batching": {"max_batch_sise": 4}})


@pytest.mark.parametrize("max_queued_requests, max_queued_batch_requests, expected", [
    (256, None, 192),  # default: three quarters of the queue for priority 'batch'
    (2, None, 1),      # at least one
    (1, None, 1),
    (64, 10, 10),      # as configured
    (64, 64, 64),      # no room kept for interactive work
])
def test_the_queue_share_of_batch_priority_work(max_queued_requests, max_queued_batch_requests, expected):
    from deployments.config import BatchingConfig, queued_batch_limit

    knobs = BatchingConfig(max_queued_requests=max_queued_requests, max_queued_batch_requests=max_queued_batch_requests)
    assert queued_batch_limit(knobs.max_queued_requests, knobs.max_queued_batch_requests) == expected


def test_batch_priority_work_cannot_have_more_of_the_queue_than_there_is():
    with pytest.raises(ValidationError, match=r"max_queued_batch_requests \(65\) must be <= max_queued_requests \(64\)"):
        AppConfig.model_validate({"batching": {"max_queued_requests": 64, "max_queued_batch_requests": 65}})
    with pytest.raises(ValidationError, match="max_queued_batch_requests"):
        AppConfig.model_validate({"batching": {"max_queued_batch_requests": 0}})


def test_a_deployments_entry_must_name_a_deployment_of_the_app():
    from deployments.app import bind_app

    with pytest.raises(ValueError, match="no deployment named 'Routr'.*DiTReplica, Ingress, Router"):
        bind_app({}, [{"name": "Routr", "user_config": {"max_batch_size": 3}}])
    # Serve takes the last of two entries for one deployment: the first's options were dropped unsaid
    with pytest.raises(ValueError, match="deployments: DiTReplica has more than one entry"):
        bind_app({}, [{"name": "DiTReplica", "num_replicas": 2}, {"name": "Router", "user_config": {}},
                      {"name": "DiTReplica", "ray_actor_options": {"num_cpus": 2}}])
    # helper-45: passed --check, then each replica's start failed without naming the option
    with pytest.raises(ValueError, match=r"^deployments: DiTReplica's placement_group_bundles has 1 bundle\(s\); "
                                         r"world_size=2 \(args.parallel\) needs one per rank; leave it out"):
        bind_app({"parallel": {"ulysses_degree": 2}}, [{"name": "DiTReplica", "placement_group_bundles": [{"CPU": 1}]}])
    bind_app({"parallel": {"ulysses_degree": 2}}, [{"name": "DiTReplica", "placement_group_bundles": [{"CPU": 1}] * 2}])
    bind_app({}, [{"name": "DiTReplica", "placement_group_bundles": [{"CPU": 1}]}])  # one rank: Serve's own option


@pytest.mark.parametrize("args, deployments, most_replicas, initial_replicas", [
    ({}, [], 1, 1),
    ({}, [{"name": "DiTReplica", "num_replicas": 3}], 3, 3),
    ({}, [{"name": "DiTReplica", "autoscaling_config": {"min_replicas": 2, "max_replicas": 5}}], 5, 2),
    ({"replica": {"autoscaling": {"min_replicas": 1, "max_replicas": 4}}}, [{"name": "DiTReplica", "num_replicas": 2}], 2, 2),
    ({"replica": {"autoscaling": {"min_replicas": 2, "max_replicas": 4}}}, [], 4, 2),
    ({}, [{"name": "DiTReplica", "num_replicas": "auto", "autoscaling_config": {"max_replicas": 6}}], 6, 1),
])
def test_a_deployments_entry_replica_count_sizes_admission(args, deployments, most_replicas, initial_replicas):
    """``ditserve serve --config``: a DiTReplica count in the file's ``deployments`` section (a
    number, autoscaling over a fixed count or the other way round, as Serve takes them) sizes the
    admission limit, the Ingress's ``max_ongoing_requests`` and the Router's starting capacity as the
    same count in ``args`` does (they were sized from ``args`` alone; a count and autoscaling together
    were refused)."""
    from deployments.app import bind_app

    ingress = bind_app(args, deployments)._bound_deployment
    router = ingress.init_args[0]._bound_deployment
    limit = 256 + 8 * most_replicas  # max_queued_requests + a batch of max_batch_size per replica (defaults)
    assert (ingress.init_args[1]["admission_limit"], ingress.init_args[1]["most_replicas"]) == (limit, most_replicas)
    # a handle's burst as large as the slots is not refused by Serve's queue bound before the Router
    assert (ingress.max_ongoing_requests, ingress.max_queued_requests) == (limit + 4, limit + 4)
    assert router.init_args[1] == initial_replicas
    kept = bind_app(args, [*deployments, {"name": "Ingress", "max_ongoing_requests": 77}])._bound_deployment
    # the file's own value stands, and sizes the queue at the Ingress's door (a limit raised live: a
    # handle's burst up to it lost the excess over args' limit to Serve's BackPressureError)
    assert (kept.max_ongoing_requests, kept.max_queued_requests) == (77, 77)
    kept = bind_app(args, [*deployments, {"name": "Ingress", "max_queued_requests": 5}])._bound_deployment
    assert (kept.max_ongoing_requests, kept.max_queued_requests) == (limit + 4, 5)


def test_the_routing_deployments_are_health_checked_every_two_seconds_unless_a_file_says_otherwise():
    """The app's sole Router or Ingress dead, every request fails until Serve's next health check
    of it: Serve's default period of 10 s made a killed Router or Ingress a 7.2 / 7.6 s outage
    (kill to the first 200, one run each; 1.9 / 2.4 s with 2 s). A ``deployments`` entry still
    sets its own."""
    from deployments.app import bind_app

    ingress = bind_app({})._bound_deployment
    router = ingress.init_args[0]._bound_deployment
    assert ingress._deployment_config.health_check_period_s == router._deployment_config.health_check_period_s == 2.0
    ingress = bind_app({}, [{"name": "Ingress", "health_check_period_s": 7.0}])._bound_deployment
    assert ingress._deployment_config.health_check_period_s == 7.0


def test_the_shutdown_wait_loop_is_serves_unless_the_replica_section_sets_it():
    """``replica.graceful_shutdown_wait_loop_s`` reaches all three deployments (Serve's 2 s by
    default: every stop of an idle replica waits it out once; the suite's deploys use 0.5 s)."""
    from deployments.app import bind_app

    def loops(args: dict) -> set[float]:
        ingress = bind_app(args)._bound_deployment
        router = ingress.init_args[0]._bound_deployment
        replica = router.init_args[0]._bound_deployment
        return {d._deployment_config.graceful_shutdown_wait_loop_s for d in (ingress, router, replica)}

    assert loops({}) == {2.0}
    assert loops({"replica": {"graceful_shutdown_wait_loop_s": 0.25}}) == {0.25}


@pytest.mark.parametrize("model, limits, said", [
    ("tiny-flux", {"default_size": "60x64"}, "multiples of 8 pixels"),
    ("tiny-qwen-image", {"default_size": "40x48"}, "multiples of 16 pixels"),
    ("tiny-z-image", {"default_size": "1024x64"}, "each side must be at most 512 pixels"),
    ("tiny-wan", {"default_size": "64x56", "max_frames": 9, "default_num_frames": 5}, "multiples of 16 pixels"),
    ("tiny-qwen-image-edit", {"default_size": "4096x16", "max_pixels": 2**21}, "at most 128:1")])
def test_an_embedded_models_default_size_off_its_grid_is_refused_by_the_config(model, limits, said):
    """helper-76: ``default_size: 60x64`` on tiny-flux passed ``--check`` (and started a cluster)
    before each replica refused it. An embedded model's grid is known without loading it
    (``EMBEDDED_SIZE_GRIDS``, checked against each loaded family in test_family_conformance); the
    message is the replica's own. A checkpoint's grid is left to its replica."""
    with pytest.raises(ValidationError, match=rf"limits\.default_size: the default is a value no request may give "
                                              rf"to model '{model}': .*{said}"):
        AppConfig.model_validate({"model": {"name": model}, "limits": limits})
    AppConfig.model_validate({"model": {"name": model, "path": "/no/such/checkpoint"}, "limits": limits})


def test_a_default_no_request_may_give_fails_the_replicas_start():
    """A default off the model's grid ran for every request that left the field out, while a
    request giving it was a 400 (helper-32's review: ``default_size: 60x64`` made 60x64 images):
    the replica refuses to start, naming the limit."""
    from deployments.replica import check_defaults
    from pipeline.runner import BatchRunner

    image = BatchRunner("tiny-flux").facts()
    check_defaults("tiny-flux", {}, image)  # the shipped defaults pass
    with pytest.raises(ValueError, match=r"^limits\.default_size: .*multiples of 8"):
        check_defaults("tiny-flux", {"default_size": "60x64"}, image)
    video = BatchRunner("tiny-wan").facts()
    check_defaults("tiny-wan", {}, video)
    with pytest.raises(ValueError, match=r"^limits\.default_num_frames: "):
        check_defaults("tiny-wan", {"default_num_frames": 8}, video)
    edit = BatchRunner("tiny-qwen-image-edit").facts()  # edits only: checked as an edit (helper-35's review)
    check_defaults("tiny-qwen-image-edit", {"default_size": "32x32", "default_steps": 4}, edit)
    with pytest.raises(ValueError, match=r"^limits\.default_steps: .*between 2 and"):
        check_defaults("tiny-qwen-image-edit", {"default_size": "32x32", "default_steps": 1}, edit)
    # the batching knobs must run the request giving a prompt alone, counted as the Router counts
    # it (a video's frames, a reference edit's input image), and an image model's max_n images
    # (helper-76: max_batch_cost 10 deployed, and every request was a 400)
    knobs = BatchingConfig().model_dump()
    for name, facts, limits, cost in [("tiny-flux", image, {}, 64 * 64), ("tiny-wan", video, {}, 64 * 64 * 9),
                                      ("tiny-qwen-image-edit", edit, {"default_size": "32x32", "default_steps": 4},
                                       32 * 32 * 2)]:
        limits = LimitsConfig.model_validate(limits).model_dump()
        assert _cost_of_defaults(name, limits, facts) == cost
        check_defaults(name, limits, facts, {**knobs, "max_batch_cost": cost})
        with pytest.raises(ValueError, match=rf"^batching\.max_batch_cost {cost - 1} < {cost}, .*\(model '{name}'\)"):
            check_defaults(name, limits, facts, {**knobs, "max_batch_cost": cost - 1})
    with pytest.raises(ValueError, match=r"^limits\.max_n 4 > batching\.max_batch_size 2: "):
        check_defaults("tiny-flux", {}, image, {**knobs, "max_batch_size": 2})
    check_defaults("tiny-flux", {"max_n": 2}, image, {**knobs, "max_batch_size": 2})
    check_defaults("tiny-wan", {}, video, {**knobs, "max_batch_size": 1})  # one video per request: no n


def _cost_of_defaults(name: str, limits: dict, facts) -> float:
    """What the Router's ``request_cost`` counts for the request giving a prompt alone (an edit
    of an image of the default size for a model that only edits)."""
    from deployments.replica import grey_png
    from deployments.router import request_cost
    from pipeline.contract.edits import validate_edit_request
    from pipeline.contract.images import validate_image_request
    from pipeline.contract.videos import validate_video_request
    from pipeline.sampling import resolve, resolve_edit, resolve_video

    serving = facts.limits(name, limits)
    if facts.temporal_factor:
        return request_cost(resolve_video(validate_video_request({"prompt": "p"}, serving), serving))
    if facts.requires_image:
        body = {"prompt": "p", "image": grey_png(serving.default_width, serving.default_height)}
        return request_cost(resolve_edit(validate_edit_request(body, serving), serving))
    return request_cost(resolve(validate_image_request({"prompt": "p"}, serving), serving))


@pytest.mark.parametrize("args, said", [
    ({"batching": {"max_batch_size": 2}}, "limits.max_n 4 > batching.max_batch_size 2: a request's n images run in "
                                          "one batch"),
    ({"batching": {"max_batch_cost": 10}}, "batching.max_batch_cost 10 < 4096, the pixels x frames x n of a request "
                                           "giving a prompt alone"),
    ({"model": {"name": "tiny-wan"}, "batching": {"max_batch_cost": 4096}}, "batching.max_batch_cost 4096 < 36864"),
    ({"model": {"name": "tiny-wan"}, "batching": {"max_batch_cost": 4096}, "limits": {"default_num_frames": 1}},
     None),
    ({"model": {"name": "tiny-wan"}, "batching": {"max_batch_size": 1}}, None),  # one video per request: no n
    ({"model": {"name": "flux", "path": "/models/flux"}, "batching": {"max_batch_size": 1}}, None),  # at its start
    ({"batching": {"max_batch_size": 2}, "limits": {"max_n": 2}}, None),
])
def test_batching_knobs_that_could_not_batch_what_the_limits_admit_are_refused(args, said):
    """helper-76: ``max_batch_cost`` under a request giving a prompt alone, and ``max_n`` past
    ``max_batch_size``, passed ``--check`` and the deploy; the server answered 400 to every request
    (or to every n it advertised past the batch). Checked as far as the config tells the model
    (an embedded one); a checkpoint's where its replica starts (above)."""
    if said is None:
        AppConfig.model_validate(args)
        return
    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate(args)
    assert said in str(info.value), str(info.value)


def test_a_live_max_batch_cost_under_the_default_request_is_refused_and_a_smaller_batch_is_not():
    """A Router ``user_config`` (live, or a file's ``deployments`` entry) is checked against the
    limits too: a ``max_batch_cost`` no default request fits is refused; a ``max_batch_size``
    lowered under ``max_n`` stays an operator's live option (larger n answered 400 naming it)."""
    from deployments.config import batching_update, default_request_cost

    args, limits = BatchingConfig().model_dump(), LimitsConfig().model_dump()
    assert default_request_cost(limits, video=False) == 4096 and default_request_cost(limits, video=True) == 4096 * 9
    assert default_request_cost(limits, video=False, reference=True) == 8192
    with pytest.raises(ValueError, match=r"^batching\.max_batch_cost 4095 < 4096"):
        batching_update(args, {"max_batch_cost": 4095}, limits, video=False)
    with pytest.raises(ValueError, match=r"^batching\.max_batch_cost 8191 < 8192"):
        batching_update(args, {"max_batch_cost": 8191}, limits, video=None, reference=True)
    assert batching_update(args, {"max_batch_cost": 4096}, limits, video=False).max_batch_cost == 4096
    assert batching_update(args, {"max_batch_size": 1}, limits, video=False).max_batch_size == 1
    assert batching_update(args, {"max_batch_cost": 1}).max_batch_cost == 1  # no limits given: not checked


def test_the_embedded_names_a_config_may_give_without_a_path_are_the_registrys():
    """``model.name`` without ``model.path`` must be an embedded model; the config checks it
    against a torch-free list (``pipeline.tiny.names``), which must be the registry's, as must its
    video models (the ``wan`` family's: ``WanFamily`` is the one with a temporal factor)."""
    from pipeline.tiny.names import EMBEDDED_NAMES, EMBEDDED_VIDEO_NAMES
    from pipeline.tiny.registry import EMBEDDED

    assert sorted(EMBEDDED_NAMES) == sorted(EMBEDDED)
    assert sorted(EMBEDDED_VIDEO_NAMES) == sorted(name for name, model in EMBEDDED.items() if model.family == "wan")


@pytest.mark.parametrize("args, said", [
    ({"batchng": {}}, "args.batchng: no such field (did you mean 'batching'?); the fields there: model, limits, "),
    ({"batching": {"max_batch_sise": 3}}, "args.batching.max_batch_sise: no such field (did you mean "
                                          "'max_batch_size'?); the fields there: max_batch_size, "),
    ({"model": {"loras": {"mine": {"pathh": "x"}}}}, "args.model.loras.mine.pathh: no such field (did you mean "
                                                     "'path'?); the fields there: path, default_scale"),
    ({"replica": {"autoscaling": {"zzz": 1}}}, "args.replica.autoscaling.zzz: no such field; the fields there: "
                                               "min_replicas, "),
    # validated by the request's CacheDiTParams (helper-44: still "Extra inputs are not permitted")
    ({"acceleration": {"cache_dit_params": {"secondary": {"Fn_compute_blockz": 1}}}},
     "args.acceleration.cache_dit_params.secondary.Fn_compute_blockz: no such field (did you mean "
     "'Fn_compute_blocks'?); the fields there: Fn_compute_blocks, "),
    ({"model": {"name": "tiny-flx"}}, "args.model: name 'tiny-flx' is not an embedded model (tiny-flux, "),
    ({"model": {"dtype": "fp16"}}, "args.model.dtype: Input should be 'float32', 'bfloat16' or 'float16'"),
    ({"model": {"device": "gpu"}}, "args.model.device: 'gpu' is not a device ditserve runs on; use cpu, cuda or "
                                   "cuda:N"),
    # unbounded before (helper-64): a default no request may give, rows past any batch, threads, and
    # replicas asking the Router for its queue without a pause
    ({"limits": {"default_guidance_scale": 1e308}}, "args.limits.default_guidance_scale: Input should be less than "
                                                    "or equal to 100"),
    ({"limits": {"max_n": 100_000}}, "args.limits.max_n: Input should be less than or equal to 1024"),
    ({"replica": {"torch_threads": 100_000}}, "args.replica.torch_threads: Input should be less than or equal to 1024"),
    ({"replica": {"graceful_shutdown_wait_loop_s": 1e9}},
     "args.replica.graceful_shutdown_wait_loop_s: Input should be less than or equal to 60"),
    ({"replica": {"autoscaling": {"metrics_interval_s": 1e-9, "look_back_period_s": 1}}},
     "args.replica.autoscaling.metrics_interval_s: Input should be greater than or equal to 0.1"),
])
def test_a_config_mistake_names_the_allowed_keys_or_values(args, said):
    """helper-43: a misspelt key said only "Extra inputs are not permitted" (no field named,
    no list), a dtype or device pydantic's regular expression, and an embedded model's name
    misspelt passed every check and failed each replica's start."""
    from deployments.config import validation_line

    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate(args)
    assert said in validation_line(info.value, "args"), validation_line(info.value, "args")


def test_a_router_user_config_key_misspelt_names_the_knobs():
    from deployments.config import BatchingConfig, batching_update, validation_line

    with pytest.raises(ValidationError) as info:
        batching_update(BatchingConfig().model_dump(), {"max_wait_mss": 5})
    assert validation_line(info.value).startswith("max_wait_mss: no such field (did you mean 'max_wait_ms'?); "
                                                  "the fields there: max_batch_size, ")


def test_router_knobs_only_the_start_reads_are_refused_live():
    """helper-64: ``routing_stats_period_s`` and ``affinity: true`` (over ``args``' false) were
    taken live and shown in ``/v1/stats`` as in force, but DiTReplica's request router, built
    at the start, never used them."""
    from deployments.config import BatchingConfig, batching_update

    args = BatchingConfig().model_dump()
    with pytest.raises(ValueError, match="routing_stats_period_s: DiTReplica's request router reads it at the "):
        batching_update(args, {"routing_stats_period_s": 30})
    off = {**args, "affinity": False}
    for value in (True, "true", 1, "yes"):  # read as pydantic reads them (helper-65: "true" passed)
        with pytest.raises(ValueError, match="affinity: args.batching.affinity is false"):
            batching_update(off, {"affinity": value})
    same = batching_update(args, {"routing_stats_period_s": str(args["routing_stats_period_s"])})  # the same value
    assert same.model_dump() == args
    # what the start set, given again, and affinity turned off live, apply
    turned_off = batching_update(args, {"routing_stats_period_s": args["routing_stats_period_s"], "affinity": False})
    assert turned_off.model_dump() == {**args, "affinity": False}
    assert batching_update(off, {"affinity": False}).affinity is False


@pytest.mark.parametrize("value, said", [
    ("010", "010 is the octal number 8 in YAML 1.1, as Serve reads this file; write 8, or 10 without the leading 0, "
            "or quote it for the text"),
    ("1:30", "1:30 is the base-60 number 90 in YAML 1.1, as Serve reads this file; write the number, or quote"),
    ("1:30.5", "1:30.5 is the base-60 number 90.5 in YAML 1.1"),  # helper-65
])
def test_a_number_yaml_reads_another_way_is_refused_with_the_form_to_write(tmp_path, value, said):
    """helper-64: ``max_batch_size: 010`` ran batches of 8 and ``max_wait_ms: 1:30`` waited
    90 ms, without a word; ``0``, ``10`` and a quoted ``"1:30"`` read as written."""
    from deployments.cli import CannotStart, load_serve_configs

    path = tmp_path / "serve.yaml"
    head = "applications:\n  - name: ditserve\n    import_path: deployments.app:build_app\n    args:\n"
    path.write_text(head + f"      batching: {{max_batch_size: {value}}}\n")
    with pytest.raises(CannotStart, match="at line 5, column 34: ") as refused:
        load_serve_configs(path)
    assert said in str(refused.value)
    for fine, read in (("0", 0), ("10", 10), ('"1:30"', "1:30"), ("07", 7), ("00", 0), ("1.5", 1.5)):
        path.write_text(head + f"      batching: {{max_batch_size: {fine}}}\n")
        assert load_serve_configs(path)[0][0]["args"]["batching"]["max_batch_size"] == read


@pytest.mark.parametrize("text, field, written", [
    ("limits: {max_pixels: 1e5}", "args.limits.max_pixels", "100000"),
    ("acceleration: {cache_dit_params: {residual_diff_threshold: 1e-3}}",
     "args.acceleration.cache_dit_params.residual_diff_threshold", "1.0e-3"),
    ("batching: {max_batch_size: 1.6e1}", "args.batching.max_batch_size", "16"),
])
def test_a_number_yaml_reads_as_text_is_told_how_to_write(text, field, written):
    """YAML 1.1 (PyYAML, what Serve reads configs with) takes ``1e5`` for the string "1e5": the
    message said only "unable to parse string as an integer" of a number as written. It now says
    the rule and the form to write, and that form is read as the number."""
    from deployments.config import validation_line

    with pytest.raises(ValidationError) as info:
        AppConfig.model_validate(yaml.safe_load(text))
    said = validation_line(info.value, "args")
    assert said.startswith(f"{field}: ") and said.endswith(
        f"YAML 1.1 reads an exponent as a number only after a dot and with a sign; write {written})"), said
    AppConfig.model_validate(yaml.safe_load(text.replace(text.split(": ")[-1].rstrip("}"), written)))
