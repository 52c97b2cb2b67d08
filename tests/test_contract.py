"""Request validation (every problem in one error, naming the field) and the batch signature."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.contract import ServingLimits, validate_image_request
from pipeline.errors import InvalidRequestError, ModelNotFoundError
from pipeline.sampling import AccelerationDefaults, SamplingParams, resolve
from pipeline.signature import SIGNATURE_TABLE, BatchSignature

LIMITS = ServingLimits(model_name="tiny-flux", spatial_factor=8, default_width=64, default_height=64,
                       default_steps=16, default_guidance_scale=3.5, max_n=4, max_pixels=65536, max_steps=100,
                       max_prompt_chars=100)


def reasons(body: dict) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        validate_image_request(body, LIMITS)
    return info.value


@pytest.mark.parametrize("body, field, words", [
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": "   "}, "prompt", "must not be empty"),
    ({"prompt": "x" * 101}, "prompt", "at most 100"),
    ({"prompt": "a", "n": 0}, "n", "between 1 and 4"),
    ({"prompt": "a", "n": 5}, "n", "between 1 and 4"),
    ({"prompt": "a", "size": "64"}, "size", "WIDTHxHEIGHT"),
    ({"prompt": "a", "size": "axb"}, "size", "WIDTHxHEIGHT"),
    ({"prompt": "a", "size": "60x64"}, "size", "multiples of 8"),
    ({"prompt": "a", "size": "512x512"}, "size", "at most 65536"),
    ({"prompt": "a", "num_inference_steps": 0}, "num_inference_steps", "between 1 and 100"),
    ({"prompt": "a", "num_inference_steps": 101}, "num_inference_steps", "between 1 and 100"),
    ({"prompt": "a", "guidance_scale": -1}, "guidance_scale", ">= 0"),
    ({"prompt": "a", "guidance_scale": float("inf")}, "guidance_scale", "finite"),
    ({"prompt": "a", "true_cfg_scale": float("nan")}, "true_cfg_scale", "finite"),
    ({"prompt": "a", "response_format": "url"}, "response_format", "b64_json"),
    ({"prompt": "a", "enable_cache_dti": True}, "enable_cache_dti", "unknown field"),
    ({"prompt": "a", "cfg_gate_step": 0}, "cfg_gate_step", "(0, 1]"),
    ({"prompt": "a", "cfg_gate_step": 1.5}, "cfg_gate_step", "(0, 1]"),
    ({"prompt": "a", "attention_backend_override": "flash"}, "attention_backend_override", "one of"),
    ({"prompt": "a", "cache_dit_params": {"Fn_compute_block": 1}}, "cache_dit_params", "unknown key"),
    ({"prompt": "a", "cache_dit_params": {"Fn_compute_blocks": "8"}}, "cache_dit_params", "integer"),
    ({"prompt": "a", "cache_dit_params": {"scm_preset": "turbo"}}, "cache_dit_params", "slow"),
    ({"prompt": "a", "cache_dit_params": {"scm_compute_bins": [8]}}, "cache_dit_params", "together"),
    ({"prompt": "a", "cache_dit_params": {"secondary": 3}}, "cache_dit_params", "secondary"),
    ({"prompt": "a", "cache_dit_params": {"secondary": {"scm_preset": "fast"}}}, "cache_dit_params", "secondary"),
    ({"prompt": "a", "seed": -1}, "seed", "greater than or equal"),
    ({"prompt": 3}, "prompt", "string"),
])
def test_each_bad_field_is_named(body, field, words):
    err = reasons(body)
    assert err.param == field
    assert words in err.message
    assert err.status_code == 400


def test_every_problem_is_listed_at_once():
    err = reasons({"prompt": "", "n": 9, "size": "65x64", "typo": 1, "cfg_gate_step": 2,
                   "cache_dit_params": {"bad": 1}})
    for part in ("prompt", "n must be", "size 65x64", "'typo'", "cfg_gate_step", "'bad'"):
        assert part in err.message


def test_unknown_model_is_404():
    with pytest.raises(ModelNotFoundError) as info:
        validate_image_request({"prompt": "a", "model": "flux-pro"}, LIMITS)
    assert info.value.status_code == 404 and info.value.param == "model"


def test_nested_extra_body_is_merged_and_clashes_rejected():
    req = validate_image_request({"prompt": "a", "extra_body": {"seed": 5, "num_inference_steps": 3}}, LIMITS)
    assert (req.seed, req.num_inference_steps) == (5, 3)
    err = reasons({"prompt": "a", "seed": 1, "extra_body": {"seed": 5}})
    assert "repeats" in err.message


def test_resolve_applies_defaults_and_diffusers_cfg_rule():
    p = resolve(validate_image_request({"prompt": "a", "true_cfg_scale": 4.0}, LIMITS), LIMITS)
    assert (p.width, p.height, p.num_inference_steps, p.guidance_scale) == (64, 64, 16, 3.5)
    assert not p.do_true_cfg and p.true_cfg_scale == 1.0  # no negative prompt: no true CFG
    q = resolve(validate_image_request({"prompt": "a", "true_cfg_scale": 4.0, "negative_prompt": ""}, LIMITS), LIMITS)
    assert q.do_true_cfg and q.true_cfg_scale == 4.0
    assert 0 <= p.seed < 2**31


def test_cache_dit_resolution():
    defaults_on = AccelerationDefaults(enable_cache_dit=True)
    base = {"prompt": "a"}
    off = resolve(validate_image_request({**base, "enable_cache_dit": False}, LIMITS), LIMITS, defaults_on)
    assert not off.enable_cache_dit and off.cache_dit_params is None  # False always wins
    follow = resolve(validate_image_request(base, LIMITS), LIMITS, defaults_on)
    assert follow.enable_cache_dit
    a = resolve(validate_image_request({**base, "enable_cache_dit": True, "cache_dit_params": {
        "Fn_compute_blocks": 2, "secondary": {"max_warmup_steps": 1, "Bn_compute_blocks": 0}}}, LIMITS), LIMITS)
    b = resolve(validate_image_request({**base, "enable_cache_dit": True, "cache_dit_params": {
        "secondary": {"Bn_compute_blocks": 0, "max_warmup_steps": 1}, "Fn_compute_blocks": 2}}, LIMITS), LIMITS)
    assert BatchSignature.of(a) == BatchSignature.of(b)  # order-insensitive, nested included
    hash(BatchSignature.of(a))


def test_signature_table_covers_every_field():
    """Adding a SamplingParams field without deciding its signature membership fails here."""
    assert [f.name for f in dataclasses.fields(SamplingParams)] == list(SIGNATURE_TABLE)
    expected_in = {"model", "width", "height", "num_frames", "num_inference_steps", "guidance_scale",
                   "true_cfg_scale", "do_true_cfg", "enable_cache_dit", "cache_dit_params", "cfg_gate_step",
                   "attention_backend"}
    assert {k for k, v in SIGNATURE_TABLE.items() if v} == expected_in


def test_signature_ignores_per_request_fields():
    r = validate_image_request({"prompt": "a", "seed": 1}, LIMITS)
    s = validate_image_request({"prompt": "b", "seed": 2, "negative_prompt": "c", "n": 3}, LIMITS)
    t = validate_image_request({"prompt": "a", "seed": 1, "num_inference_steps": 3}, LIMITS)
    assert BatchSignature.of(resolve(r, LIMITS)) == BatchSignature.of(resolve(s, LIMITS))
    assert BatchSignature.of(resolve(r, LIMITS)) != BatchSignature.of(resolve(t, LIMITS))
