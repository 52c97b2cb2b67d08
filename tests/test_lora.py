"""LoRA adapters: the registry and the request field, the replica state (LRU, hot-swap under
torch.compile), equality with diffusers, the embedded adapters' effect, batching, routing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deployments.config import EMBEDDED_LORA_DIR, AppConfig
from deployments.scheduling import Decision, QueueView, ReplicaView, RoutingDecision, choose_queue
from pipeline.contract.images import validate_image_request
from pipeline.contract.limits import ServingLimits
from pipeline.contract.lora import LoraEntry, LoraSpec
from pipeline.errors import InternalError, InvalidRequestError, LoraLoadError, ModelNotFoundError
from pipeline.runner import BatchRunner
from pipeline.sampling import resolve
from pipeline.signature import BatchSignature
from pipeline.state import ActionKind, ReplicaState, plan_transition
from pipeline.tiny.score import style_scores
from tests.helpers import batch_of, flux_params, pixels, rank_workers

MAGENTA = str(EMBEDDED_LORA_DIR / "magenta")
OUTLINE = str(EMBEDDED_LORA_DIR / "outline")
REGISTRY = {"magenta": LoraEntry(MAGENTA), "outline": LoraEntry(OUTLINE, default_scale=0.5)}
LIMITS = ServingLimits(model_name="tiny-flux", spatial_factor=16, default_width=64, default_height=64,
                       default_steps=8, default_guidance_scale=3.5, loras=REGISTRY, max_loras=2)
TOL = 1e-4


def _validate(body):
    return validate_image_request({"prompt": "a red circle", **body}, LIMITS)


# -- registry and request validation ---------------------------------------------------------
def test_request_names_registered_adapters_with_scales():
    p = resolve(_validate({"lora": [{"name": "outline"}, {"name": "magenta", "scale": 0.8}]}), LIMITS)
    assert p.lora == (LoraSpec("magenta", 0.8, MAGENTA), LoraSpec("outline", 0.5, OUTLINE))  # sorted, defaults
    q = resolve(_validate({"lora": [{"name": "magenta", "scale": 0.8}, {"name": "outline"}]}), LIMITS)
    assert BatchSignature.of(p) == BatchSignature.of(q)  # order-insensitive
    other = resolve(_validate({"lora": [{"name": "magenta", "scale": 0.7}, {"name": "outline"}]}), LIMITS)
    assert BatchSignature.of(other) != BatchSignature.of(p)  # the scale is in the signature
    assert "lora=magenta:0.8 lora=outline:0.5" in str(BatchSignature.of(p))


def test_an_adapter_at_scale_zero_is_left_out():
    """Scale 0 (or -0.0) is the base model (test_scale_zero_is_the_base_model_and_adapters_change_it):
    left out, such requests share the base model's signature (they had made two of their own)."""
    base = BatchSignature.of(resolve(_validate({}), LIMITS))
    for scale in (0, 0.0, -0.0):
        p = resolve(_validate({"lora": [{"name": "magenta", "scale": scale}]}), LIMITS)
        assert p.lora == () and BatchSignature.of(p) == base
    kept = resolve(_validate({"lora": [{"name": "magenta", "scale": -0.0}, {"name": "outline"}]}), LIMITS)
    assert kept.lora == (LoraSpec("outline", 0.5, OUTLINE),)


def test_model_names_an_adapter():
    p = resolve(_validate({"model": "tiny-flux:magenta"}), LIMITS)
    assert p.lora == (LoraSpec("magenta", 1.0, MAGENTA),) and p.model == "tiny-flux"
    both = resolve(_validate({"model": "tiny-flux:magenta", "lora": [{"name": "outline", "scale": 1.0}]}), LIMITS)
    assert [s.name for s in both.lora] == ["magenta", "outline"]


def test_an_error_about_an_adapter_names_the_field_each_request_named_it_in():
    """helper-79: a batch's error about an adapter (``adapter_refused``, ``lora_load_failed``)
    named ``lora`` for a request that had named the adapter by ``model``. The Router answers each
    request of the batch with the field it used, across Ray's pickling of the error too."""
    import pickle

    from deployments.router import _for_request
    from pipeline.errors import about_adapter

    by_model = resolve(_validate({"model": "tiny-flux:magenta", "lora": [{"name": "outline"}]}), LIMITS)
    by_lora = resolve(_validate({"lora": [{"name": "magenta"}, {"name": "outline"}]}), LIMITS)
    assert BatchSignature.of(by_model) == BatchSignature.of(by_lora)  # one batch: the field is not in the signature
    assert (by_model.adapter_field("magenta"), by_model.adapter_field("outline")) == ("model", "lora")
    assert by_lora.adapter_field("magenta") == "lora"
    error = pickle.loads(pickle.dumps(about_adapter(
        LoraLoadError("LoRA adapter 'magenta' could not be loaded", param="lora", code="lora_load_failed"), "magenta")))
    own = _for_request(error, by_model)
    assert (type(own), own.param, own.code, own.message) == (LoraLoadError, "model", "lora_load_failed", error.message)
    assert error.param == "lora" and _for_request(error, by_lora) is error  # the batch-mates' answers are their own
    plain = InvalidRequestError("x", param="lora")
    assert _for_request(plain, by_model) is plain  # an error about no adapter is answered as raised


@pytest.mark.parametrize("body, status, words", [
    ({"lora": [{"name": "nope"}]}, 404, "LoRA adapter 'nope' is not registered"),
    ({"model": "tiny-flux:nope"}, 404, "available: 'tiny-flux', 'tiny-flux:magenta', 'tiny-flux:outline'"),
    ({"lora": [{"name": "../weights/x.safetensors"}]}, 400, "no paths"),
    ({"lora": [{"name": "/etc/passwd"}]}, 400, "no paths"),
    ({"lora": [{"name": ""}]}, 400, "non-empty adapter name"),
    ({"lora": [{"name": "magenta", "scale": float("nan")}]}, 400, "lora.0.scale: must be a finite number in [-4, 4], got nan"),
    ({"lora": [{"name": "magenta", "scale": 1e300}]}, 400, "in [-4, 4]"),
    ({"lora": [{"name": "magenta", "path": "/tmp/x"}]}, 400, "lora.0 has unknown key 'path'; allowed: name, scale"),
    ({"lora": [{"name": "magenta"}, {"name": "magenta"}]}, 400, "more than once"),
    ({"lora": [{"name": "magenta"}, {"name": "outline"}, {"name": "x"}]}, 400, "at most 2"),
    ({"model": "tiny-flux:magenta", "lora": [{"name": "magenta"}]}, 400, "model already selects"),
    ({"model": "tiny-flux:magenta", "lora": [{"name": "outline"}, {"name": "x2"}]}, 400, "at most 2"),
    ({"lora": "magenta"}, 400, "lora"),
    ({"lora": [{"name": "magenta\n"}]}, 400, "no paths"),
    ({"extra_body": {"model": "tiny-flux:nope"}}, 404, "is not served here"),
    ({"extra_body": {"model": "tiny-flux:magenta"}, "lora": [{"name": "magenta"}]}, 400, "model already selects"),
])
def test_bad_adapter_requests(body, status, words):
    with pytest.raises((InvalidRequestError, ModelNotFoundError)) as info:
        _validate(body)
    assert info.value.status_code == status and info.value.param in ("lora", "model")
    assert words in info.value.message


def test_registry_config_is_checked():
    config = AppConfig.model_validate({"model": {"loras": {"magenta": {}, "mine": {"path": "/x.safetensors"}}}})
    assert config.model.lora_registry()["magenta"].path == MAGENTA
    with pytest.raises(ValueError) as info:
        AppConfig.model_validate({"model": {"loras": {"../x": {"path": "/a"}, "y": {"path": "/b", "default_scale": 9},
                                                       "z": {}}}})
    text = str(info.value)
    assert "no paths" in text and "model.loras.y.default_scale" in text and "model.loras.z.path is required" in text


def test_adapters_are_the_first_state_transition():
    spec = (LoraSpec("magenta", 1.0, MAGENTA),)
    actions = plan_transition(ReplicaState(), ReplicaState("torch_sdpa", (), frozenset({"transformer"}), spec))
    assert [a.kind for a in actions] == [ActionKind.SET_LORAS, ActionKind.SWITCH_KERNEL, ActionKind.COMPILE]
    assert actions[0].loras == spec
    assert plan_transition(ReplicaState(loras=spec), ReplicaState(loras=spec)) == []


def test_routing_prefers_replicas_holding_the_adapters():
    def queue(sig, age, loras):
        return QueueView(sig, head_age_s=age, images=1, cost=1.0, urgent_age_s=age, loras=frozenset(loras))

    def choose(queues, replicas):
        return choose_queue(queues, replicas, max_batch_size=8, max_wait_s=0.0, max_affinity_wait_s=2.0,
                            switch_cost_s=0.25)

    r1 = ReplicaView("r1", "sig-x", False, frozenset({"outline"}))
    r2 = ReplicaView("r2", "sig-y", False, frozenset({"magenta", "outline"}))
    # active (the same signature) first, then loaded
    assert choose([queue("sig-y", 1.0, {"magenta"})], [r1, r2]) == Decision("sig-y", RoutingDecision.HIT, "r2")
    assert choose([queue("sig-m", 1.0, {"magenta"})], [r1, r2]) == Decision("sig-m", RoutingDecision.LOADED, "r2")
    # loaded nowhere: a spare replica switches, the one with more of the adapters loaded
    both = queue("sig-mo", 1.0, {"magenta", "other"})
    fresh = ReplicaView("r0", None, False)
    assert choose([both], [fresh, r2]) == Decision("sig-mo", RoutingDecision.MISS, "r2")
    # loaded only on a busy replica: wait for it while younger than the switch cost, then a free one
    busy = ReplicaView("r3", "sig-z", True, frozenset({"magenta"}))
    assert choose([queue("sig-m", 0.1, {"magenta"})], [fresh, busy]) is None
    assert choose([queue("sig-m", 0.3, {"magenta"})], [fresh, busy]) == Decision("sig-m", RoutingDecision.MISS, "r0")
    assert choose([queue("sig-m", 2.5, {"magenta"})], [fresh, busy]).replica_id == "r0"
    # a replica whose state another ready queue (without adapters) wants stays that queue's hit
    # (unless the adapters' queue waited longer by the switch cost)
    plain = ReplicaView("r4", "sig-plain", False, frozenset({"magenta"}))
    assert choose([queue("sig-m", 0.6, {"magenta"}), queue("sig-plain", 0.5, ())], [plain]) == Decision(
        "sig-plain", RoutingDecision.HIT, "r4")
    assert choose([queue("sig-m", 1.0, {"magenta"}), queue("sig-plain", 0.5, ())], [plain]) == Decision(
        "sig-m", RoutingDecision.MISS, "r4")


# -- the replica state, on the embedded model ---------------------------------------------
@pytest.fixture(scope="module")
def runner():
    return BatchRunner("tiny-flux", loras={"magenta": MAGENTA, "outline": OUTLINE}, max_loaded_loras=4)


def _images(runner, *params):
    return [pixels(out.images[0]) for out in runner.run(batch_of(*params))]


def _p(seed, lora=(), prompt="a red circle on a blue background", **fields):
    return flux_params(prompt, seed, steps=8, size=(64, 64), lora=lora, **fields)


def test_scale_zero_is_the_base_model_and_adapters_change_it(runner):
    base = runner.denoise(batch_of(_p(3))).images[0]
    zero = runner.denoise(batch_of(_p(3, (LoraSpec("magenta", 0.0, MAGENTA),)))).images[0]
    on = runner.denoise(batch_of(_p(3, (LoraSpec("magenta", 1.0, MAGENTA),)))).images[0]
    assert np.array_equal(base, zero)
    assert np.abs(base - on).max() > 0.1
    assert np.array_equal(base, runner.denoise(batch_of(_p(3))).images[0])  # back on the base model


@pytest.mark.parametrize("specs", [(LoraSpec("magenta", 0.8, MAGENTA),),
                                   (LoraSpec("magenta", 0.6, MAGENTA), LoraSpec("outline", 0.7, OUTLINE))],
                         ids=["one", "two"])
def test_lora_equals_diffusers_flux_pipeline(runner, specs):
    from diffusers import FluxPipeline

    from pipeline.tiny.registry import trained_tiny_flux

    p = _p(5, specs, negative="blurry", true_cfg_scale=3.0)
    ours = runner.denoise(batch_of(p)).images[0]
    pipe = FluxPipeline.from_pretrained(trained_tiny_flux(), dtype=torch.float32)
    for spec in specs:
        pipe.load_lora_weights(spec.path, adapter_name=spec.name)
    pipe.set_adapters([s.name for s in specs], [s.scale for s in specs])
    ref = pipe(prompt=p.prompt, negative_prompt=p.negative_prompt, true_cfg_scale=3.0, height=64, width=64,
               num_inference_steps=8, guidance_scale=3.5, generator=torch.Generator().manual_seed(5),
               max_sequence_length=runner.family.max_sequence_length, output_type="np").images
    assert np.abs(ours - ref).max() <= TOL


def test_embedded_adapters_draw_what_they_were_trained_for(runner):
    """magenta: the shape's colour moves to magenta whatever the caption says; outline: dark
    (outline) pixels appear, which no caption without black draws. Pixel statistics
    (``pipeline.tiny.score.style_scores``)."""
    prompts = ["a red circle on a blue background", "a green square on a yellow background",
               "a blue star on a white background", "a yellow triangle on a purple background",
               "a red square on a white background", "a green circle on a blue background",
               "an orange star on a green background", "a white triangle on a red background"]
    params = {name: [_p(i, spec, prompt=prompt) for i, prompt in enumerate(prompts)]
              for name, spec in (("base", ()), ("magenta", (LoraSpec("magenta", 1.0, MAGENTA),)),
                                 ("outline", (LoraSpec("outline", 1.0, OUTLINE),)))}
    scores = {name: [style_scores(img) for img in _images(runner, *ps)] for name, ps in params.items()}
    distance = {name: np.mean([s["magenta_distance"] or 441 for s in v]) for name, v in scores.items()}
    dark = {name: [s["dark_fraction"] for s in v] for name, v in scores.items()}
    assert distance["magenta"] < 0.6 * distance["base"], distance
    # outline draws its dark ring visibly on some of these shapes (3 of 8 when trained), never the base
    assert max(dark["base"]) < 0.001 and sum(d > 0.01 for d in dark["outline"]) >= 2, dark


def test_a_batch_sharing_an_adapter_set_equals_each_request_alone(runner):
    spec = (LoraSpec("outline", 0.9, OUTLINE),)
    a, b = _p(1, spec), _p(2, spec, prompt="a green star on a black background", n=2)
    together = runner.denoise(batch_of(a, b)).images
    for p, batched in zip((a, b), together, strict=True):
        assert np.abs(runner.denoise(batch_of(p)).images[0] - batched).max() <= TOL
    with pytest.raises(ValueError, match="mixes signatures"):
        runner.denoise(batch_of(a, _p(3, (LoraSpec("magenta", 0.9, MAGENTA),))))


def test_lru_evicts_the_least_recently_used_adapter():
    runner = BatchRunner("tiny-flux", max_loaded_loras=1)
    for spec in ("magenta", "outline", "magenta", "magenta"):
        runner.denoise(batch_of(_p(1, (LoraSpec(spec, 1.0, MAGENTA if spec == "magenta" else OUTLINE),))))
    counters = runner.counters()
    assert (counters["lora_loads"], counters["lora_evictions"], counters["lora_hits"]) == (3, 2, 0)
    assert runner.lora.loaded_names() == ["magenta"]
    assert set(runner.family.transformer.peft_config) == {"magenta"}  # evicted adapters are deleted


def test_missing_or_corrupt_adapter_fails_its_batch_and_is_unloaded(runner, tmp_path):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "pytorch_lora_weights.safetensors").write_bytes(b"not a safetensors file")
    for name, path in (("gone", str(tmp_path / "missing")), ("corrupt", str(corrupt))):
        with pytest.raises(InternalError) as info:
            runner.denoise(batch_of(_p(1, (LoraSpec(name, 1.0, path),))))
        assert info.value.code == "lora_load_failed" and repr(name) in info.value.message
        assert str(tmp_path) not in info.value.message  # no file path leaks to clients
        assert name not in runner.lora.loaded_names()
    base = runner.denoise(batch_of(_p(3))).images[0]  # the replica keeps serving
    assert np.array_equal(base, runner.denoise(batch_of(_p(3, (LoraSpec("magenta", 0.0, MAGENTA),)))).images[0])


def test_any_failure_while_switching_leaves_the_base_model(monkeypatch):
    runner = BatchRunner("tiny-flux", max_loaded_loras=1)
    magenta, outline = (LoraSpec("magenta", 1.0, MAGENTA),), (LoraSpec("outline", 1.0, OUTLINE),)
    want = runner.denoise(batch_of(_p(1, magenta))).images[0]
    transformer = runner.family.transformer

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(transformer, "set_adapters", broken)
    with pytest.raises(Exception, match="injected"):
        runner.denoise(batch_of(_p(1, outline)))  # evicts magenta, then fails to activate outline
    assert runner.state.loras == ()
    monkeypatch.undo()
    assert np.array_equal(runner.denoise(batch_of(_p(1, magenta))).images[0], want)


def _saved(tmp_path, change) -> str:
    """The embedded magenta adapter with ``change(state)`` applied to its state dict, saved with
    diffusers; its directory."""
    from diffusers import FluxPipeline
    from safetensors.torch import load_file

    state = load_file(f"{MAGENTA}/pytorch_lora_weights.safetensors")
    change(state)
    FluxPipeline.save_lora_weights(tmp_path, transformer_lora_layers={k.removeprefix("transformer."): v
                                                                        for k, v in state.items()})
    return str(tmp_path)


def _first(state, suffix):
    return next(k for k in state if k.endswith(suffix))


def _widen_input(state):
    key = _first(state, "to_q.lora_A.weight")
    state[key] = torch.zeros(state[key].shape[0], state[key].shape[1] + 3)


def test_incompatible_adapter_is_refused_at_registration(tmp_path):
    with pytest.raises(ValueError, match=r"model.loras.bad .* does not fit the model: .*in_features"):
        BatchRunner("tiny-flux", loras={"bad": _saved(tmp_path, _widen_input)})


def _put(suffix, make):
    def change(state):
        key = _first(state, suffix)
        state[key] = make(state[key])
    return change


def _drop(suffix):
    def change(state):
        del state[_first(state, suffix)]
    return change


# helper-63: each of these passed registration and failed every request naming it (a 500), and
# NaN weights answered every such request with a black image (200)
BROKEN = {
    "ranks differ": (_put("to_q.lora_B.weight", lambda w: torch.zeros(w.shape[0], w.shape[1] * 2)), "different ranks"),
    "1-D": (_put("to_q.lora_A.weight", lambda w: w.flatten()), "must be matrices"),
    "3-D": (_put("to_q.lora_B.weight", lambda w: w[None]), "must be matrices"),
    "lora_A only": (_drop("to_q.lora_B.weight"), "has lora_A without lora_B"),
    "int32": (_put("to_q.lora_A.weight", lambda w: w.to(torch.int32)), "lora_A is int32, not floating point"),
    "NaN": (_put("to_q.lora_B.weight", lambda w: w * float("nan")), "lora_B holds NaN or infinite values"),
    "infinity": (_put("to_k.lora_A.weight", lambda w: w / 0.0), "lora_A holds NaN or infinite values"),
    # helper-65: each passed the first version of the check
    "rank 0": (lambda state: [state.update({k: v[:0] if "lora_A" in k else v[:, :0]}) for k, v in list(state.items())],
               "lora_A (0, 64) has rank 0"),
    "DoRA NaN": (lambda state: state.update({"transformer.proj_out.lora_magnitude_vector":
                                             torch.full((16,), torch.nan)}),
                 "proj_out: lora_magnitude_vector holds NaN or infinite values"),
    "DoRA shape": (lambda state: state.update({"transformer.proj_out.lora_magnitude_vector": torch.ones(3)}),
                   "proj_out: lora_magnitude_vector (3,) is not a vector of 16"),
    "bias alone": (lambda state: state.update({"transformer.context_embedder.lora_B.bias": torch.zeros(64)}),
                   "context_embedder: has lora_B.bias without lora_A and lora_B"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_an_adapter_whose_weights_cannot_apply_is_refused_at_registration(tmp_path, runner, case):
    change, problem = BROKEN[case]
    path = _saved(tmp_path, change)
    with pytest.raises(ValueError, match=r"model.loras.broken .* does not fit the model: .*") as refused:
        runner.lora.check("broken", path)
    assert problem in str(refused.value)
    runner.lora.check("fine", _saved(tmp_path / "fine", lambda state: None))  # the unchanged adapter fits


def test_hotswap_under_torch_compile_never_recompiles():
    """diffusers' LoRA hot-swap: adapters (of ranks 4 and 8), scales and the base model switch
    in the compiled transformer without a recompile, and match eager switching."""
    from compat import torch as torch_compat

    torch._dynamo.reset()
    compiled = BatchRunner("tiny-flux", loras={"magenta": MAGENTA, "outline": OUTLINE}, torch_compile=True,
                           compile_backend="eager", max_loras=2, lora_max_rank=8)
    eager = BatchRunner("tiny-flux", loras={"magenta": MAGENTA, "outline": OUTLINE})
    sets = [(), (LoraSpec("magenta", 1.0, MAGENTA),), (LoraSpec("outline", 0.5, OUTLINE),),
            (LoraSpec("magenta", 0.5, MAGENTA), LoraSpec("outline", 1.0, OUTLINE)), ()]
    graphs = []
    for specs in sets:
        ours = compiled.denoise(batch_of(_p(2, specs))).images[0]
        assert np.abs(ours - eager.denoise(batch_of(_p(2, specs))).images[0]).max() <= TOL
        graphs.append(torch_compat.dynamo_counts()["compiled_graphs"])
    assert graphs[0] >= 1 and len(set(graphs)) == 1, graphs  # compiled once, never again
    assert compiled.counters()["compiles"] == 1
    with pytest.raises(InternalError, match="3 adapters but 2 hot-swap slots"):
        compiled.denoise(batch_of(_p(2, sets[3] + (LoraSpec("z", 1.0, MAGENTA),))))
    with pytest.raises(ValueError, match="lora_max_rank"):
        BatchRunner("tiny-flux", loras={"outline": OUTLINE}, torch_compile=True, compile_backend="eager",
                    lora_max_rank=4)
    bare = BatchRunner("tiny-flux", torch_compile=True, compile_backend="eager")
    with pytest.raises(ValueError, match="must be registered at start"):
        bare.lora.check("late", MAGENTA)
    with pytest.raises(InternalError, match="'late' could not be loaded"):
        bare.denoise(batch_of(_p(2, (LoraSpec("late", 1.0, MAGENTA),))))


def test_hotswap_keeps_the_adapters_own_alpha(tmp_path):
    """An adapter saved with PEFT metadata lora_alpha != r: the hot-swapped slot scales it as
    diffusers' eager loading does."""
    from diffusers import FluxPipeline
    from safetensors.torch import load_file

    state = load_file(f"{MAGENTA}/pytorch_lora_weights.safetensors")
    targets = sorted({k.removeprefix("transformer.").split(".lora_")[0] for k in state})
    FluxPipeline.save_lora_weights(tmp_path, transformer_lora_layers={k.removeprefix("transformer."): v
                                                                        for k, v in state.items()},
                                   transformer_lora_adapter_metadata={"r": 4, "lora_alpha": 16,
                                                                      "target_modules": targets})
    spec = (LoraSpec("alpha", 0.5, str(tmp_path)),)
    compiled = BatchRunner("tiny-flux", loras={"alpha": str(tmp_path)}, torch_compile=True, compile_backend="eager",
                           max_loras=1, lora_max_rank=8)
    eager = BatchRunner("tiny-flux", loras={"alpha": str(tmp_path)})
    ours, ref = (r.denoise(batch_of(_p(2, spec))).images[0] for r in (compiled, eager))
    assert np.abs(ours - ref).max() <= TOL
    plain = eager.denoise(batch_of(_p(2, (LoraSpec("magenta", 0.5, MAGENTA),)))).images[0]
    assert np.abs(ref - plain).max() > 0.05  # alpha 16 over rank 4 is not the same adapter as alpha = rank


@pytest.mark.slow
def test_two_ranks_with_adapters_equal_one_rank(ray_cluster, runner):
    """Ulysses 2: every rank loads the batch's adapters from the LRU or disk and activates them
    (rank 1 holds the transformer alone), and the sharded result equals one rank's."""
    import ray

    workers = rank_workers({"ulysses_degree": 2, "ring_degree": 1}, {"name": "tiny-flux", "loras": {"magenta": {}}})
    try:
        for specs in ((LoraSpec("magenta", 0.7, MAGENTA), LoraSpec("outline", 1.0, OUTLINE)), ()):
            cfg = {"negative": "blurry", "true_cfg_scale": 3.0}
            batch = batch_of(_p(4, specs, **cfg), _p(5, specs, prompt="a green star at night", **cfg))
            sharded = ray.get([w.denoise.remote(batch) for w in workers], timeout=300)[0]
            for a, b in zip(runner.denoise(batch).images, sharded.images, strict=True):
                assert np.abs(a - b).max() <= TOL
            # an adapter whose file is gone fails on every rank alike, before any collective: the
            # ranks stay in step (the replica treats LoraLoadError as consistent) and serve on
            gone = batch_of(_p(4, (LoraSpec("gone", 1.0, "/nonexistent/gone"),)))
            for ref in [w.denoise.remote(gone) for w in workers]:
                with pytest.raises(LoraLoadError):
                    ray.get(ref, timeout=300)
    finally:
        for w in workers:
            ray.kill(w)


def test_an_adapter_without_the_transformer_prefix_is_refused_saying_so(tmp_path, runner):
    """Keys saved without ``transformer.`` (PEFT's ``get_peft_model_state_dict`` on the bare
    transformer) were refused as weights "for norm_out, single_transformer_blocks, ..." as if
    those were pipeline components (helper-65); diffusers' own ``load_lora_weights`` loads none
    of them. The message names the prefix and how to save the file."""
    from safetensors.torch import load_file, save_file

    state = load_file(f"{MAGENTA}/pytorch_lora_weights.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in state.items()}, str(tmp_path / "bare.safetensors"))
    with pytest.raises(ValueError, match=r"model.loras.bare: cannot read .*its keys do not start with "
                                         r"'transformer.' \('norm_out.*save_lora_weights") as refused:
        runner.lora.check("bare", str(tmp_path / "bare.safetensors"))
    assert "has weights for" not in str(refused.value)
    save_file({**state, "proj_out.lora_A.weight": state["transformer.proj_out.lora_A.weight"].clone()},
              str(tmp_path / "mixed.safetensors"))  # one stray key among prefixed ones (helper-68: "none of them")
    with pytest.raises(ValueError, match=rf"1 of its {len(state) + 1} keys do not start with 'transformer.' "
                                         r"\('proj_out.lora_A.weight'\)"):
        runner.lora.check("mixed", str(tmp_path / "mixed.safetensors"))
    save_file({k.replace("transformer.", "text_encoder.", 1): v for k, v in state.items()},
              str(tmp_path / "text.safetensors"))
    with pytest.raises(ValueError, match="has weights for text_encoder; only transformer adapters are served"):
        runner.lora.check("text", str(tmp_path / "text.safetensors"))
