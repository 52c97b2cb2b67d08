"""Every registered model family, through every one of its embedded tiny models, satisfies the
``ModelFamily`` interface: each member's shapes on a batch of two, then one real step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.families import REGISTRY, checkpoint_attention_heads, load_family
from pipeline.families.base import Conditioning, ModelFamily
from pipeline.loop import denoise_batch, plan_batch
from pipeline.modes import DualMode, GuidanceMode, InputMode
from pipeline.tiny.names import EMBEDDED_DUAL_MODES, EMBEDDED_SIZE_GRIDS
from pipeline.tiny.registry import EMBEDDED
from pipeline.wire import ImageArray
from tests.helpers import flux_params, video_params

MODELS = sorted(EMBEDDED)
# a 32x32 input image (a gradient), for families that edit (requires_image)
IMAGE = ImageArray(32, 32, 3, bytes((x * 8 + c * 40) % 256 for y in range(32) for x in range(32) for c in range(3)))


def test_every_registered_family_has_a_tiny_model():
    assert set(REGISTRY) == {model.family for model in EMBEDDED.values()}


def test_a_hub_id_is_loaded_from_the_local_hugging_face_cache_or_refused_naming_model_path(tmp_path, monkeypatch):
    """helper-45: ``model.path`` a hub id without ``model.family`` failed every replica's start with
    ``FileNotFoundError: 'black-forest-labs/FLUX.1-dev/model_index.json'`` (only a directory was
    read), a Wan hub id was taken for text-to-video unread, and (helper-46) a hub id with
    ``model.family`` given was downloaded on a node that is online. A hub id now resolves to its
    snapshot in the local cache (the layout huggingface_hub writes), read like a directory; one
    not cached is refused, naming the field; nothing is downloaded."""
    import huggingface_hub.constants

    from pipeline.families import detect_family
    from pipeline.tiny.registry import resolve_checkpoint

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError) as info:
        resolve_checkpoint("flux-dev", "black-forest-labs/FLUX.1-dev")
    assert str(info.value) == ("model.path 'black-forest-labs/FLUX.1-dev' is neither a directory on this node nor a "
                               "hub id in its Hugging Face cache (ditserve downloads nothing: `hf download "
                               "black-forest-labs/FLUX.1-dev --local-dir DIR` on a machine that is online, then give "
                               "DIR)")
    with pytest.raises(FileNotFoundError, match="^model.path 'no such dir/x y' is neither a directory"):
        resolve_checkpoint("flux-dev", "no such dir/x y")  # not a valid hub id either
    with pytest.raises(FileNotFoundError, match="^model.path /models/FLUX.1-dev: no such directory on this node$"):
        resolve_checkpoint("flux-dev", "/models/FLUX.1-dev")  # a volume not mounted
    with pytest.raises(FileNotFoundError, match="is not a diffusers checkpoint \\(no model_index.json\\)"):
        resolve_checkpoint("flux-dev", str(tmp_path))

    repo = tmp_path / "models--black-forest-labs--FLUX.1-dev"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "snapshots" / "0123abcd" / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    checkpoint = resolve_checkpoint("flux-dev", "black-forest-labs/FLUX.1-dev")
    assert checkpoint == repo / "snapshots" / "0123abcd" and detect_family(checkpoint) == "flux"


def _params(family, name: str, seed: int, **fields):
    if family.temporal_factor:
        return video_params(family, f"a red circle {seed}", seed, num_frames=5, size="32x32",
                            num_inference_steps=2, **fields)
    if family.requires_image:  # an edit: the image conditions the text and joins the sequence
        fields = {"input_mode": InputMode.REFERENCE, "num_input_images": 1, "images": (IMAGE,), **fields}
    return flux_params(f"a red circle {seed}", seed, size=(32, 32), steps=2, **fields)


def _inputs(family, p):
    """``prepare_latents``' image inputs of two samples of ``p`` (none for text)."""
    return {"requests": [p, p]} if family.requires_image else {}


@pytest.fixture(scope="module", params=MODELS)
def family(request):
    model = EMBEDDED[request.param]
    return load_family(model.family, model.build(), torch_dtype=torch.float32, device="cpu")


def test_members_and_shapes_on_a_batch_of_two(family, request):
    assert isinstance(family, ModelFamily)  # every member of the Protocol is present
    assert family.family in REGISTRY and family.pipeline_classes
    assert isinstance(family.dual_mode, DualMode) and isinstance(family.guidance_style, GuidanceMode)
    assert family.guidance_style != GuidanceMode.NONE
    # what a config is checked against before any replica loads the model (deployments.config)
    assert family.dual_mode == EMBEDDED_DUAL_MODES.get(request.node.callspec.params["family"], DualMode.SINGLE)
    assert EMBEDDED_SIZE_GRIDS[request.node.callspec.params["family"]] == (
        family.spatial_factor, family.max_side, family.max_aspect_ratio)
    names = list(family.transformers)
    assert names == (["transformer"] if family.dual_mode == DualMode.SINGLE else ["transformer", "transformer_2"])
    assert all(isinstance(m, torch.nn.Module) for m in family.transformers.values())
    assert family.spatial_factor > 0 and family.temporal_factor >= 0 and family.num_blocks > 0
    assert family.num_attention_heads > 0 and family.max_sequence_length > 0
    # the startup layout check reads the heads before any rank loads: a family whose config
    # keeps them under another key would skip that check silently
    path = EMBEDDED[request.node.callspec.params["family"]].build()
    assert checkpoint_attention_heads(path) == family.num_attention_heads
    assert (family.boundary_ratio is not None) == (family.dual_mode == DualMode.BOUNDARY)

    p = _params(family, "", 1)
    lengths = family.sequence_lengths(p.width, p.height, p.num_frames)
    assert lengths["text tokens"] == family.max_sequence_length and lengths["image tokens"] > 0

    cond = family.encode_prompts(["a red circle", "a much longer prompt about a blue square at night"],
                                 [p.images, p.images])
    assert isinstance(cond, Conditioning)
    again = cond.select(torch.tensor([1, 0, 0]))  # rows repeat per sample
    # a leading B on every batched tensor, or one entry per sample (Z-Image's per-prompt lengths)
    leading = {t.shape[0] for t in vars(again).values() if isinstance(t, torch.Tensor) and t.dim() >= 2
               and t.shape[0] != family.max_sequence_length}
    leading |= {len(v) for v in vars(again).values() if isinstance(v, list)}
    assert leading == {3}

    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    latents, positions = family.prepare_latents(generators, [1, 1], p, **_inputs(family, p))
    assert latents.shape[0] == 2 and latents.is_floating_point()
    if family.temporal_factor:  # (B, C, latent frames, h, w)
        latent_frames = (p.num_frames - 1) // family.temporal_factor + 1
        assert latents.dim() == 5 and latents.shape[2] == latent_frames
        f = family.spatial_factor
        assert lengths["image tokens"] == latent_frames * (p.height // f) * (p.width // f)
    elif latents.dim() == 4:  # unpacked (B, C, h, w): the transformer patchifies (Z-Image)
        assert latents.shape[2] * latents.shape[3] % lengths["image tokens"] == 0
        assert latents.shape[2] // (p.height // family.spatial_factor) == latents.shape[3] // (
            p.width // family.spatial_factor)
    else:  # packed (B, S, 4·C)
        assert latents.shape[1] == lengths["image tokens"]
        # the family's own position inputs: ids with one row per token (FLUX.1 (S, 3), FLUX.2
        # (B, S, 4)) or a movable object (Qwen-Image's latent grid)
        if isinstance(positions, torch.Tensor):
            assert positions.shape[-2] == latents.shape[1]
        else:
            assert positions is None or hasattr(positions, "to")

    scheduler, timesteps = family.scheduler_and_timesteps(p.num_inference_steps, p)
    assert len(timesteps) == p.num_inference_steps and hasattr(scheduler, "step")
    guidance = family.guidance(p.embedded_guidance_scale, 2)
    assert guidance is None or guidance.shape == (2,)
    for name in names:
        out = family.predict(latents, timesteps[0], family.encode_prompts(["a", "b"], [p.images, p.images]),
                             guidance, positions, model=name)
        assert out.shape == latents.shape

    pixels = family.decode(latents, p)
    frames = (p.num_frames,) if family.temporal_factor else ()
    assert pixels.shape == (2, *frames, p.height, p.width, 3) and pixels.dtype == np.float32
    assert 0.0 <= pixels.min() and pixels.max() <= 1.0


def test_one_guided_step_through_our_loop(family):
    fields = {} if family.temporal_factor else {"negative": "blurry", "true_cfg_scale": 2.0}
    if family.temporal_factor:
        fields = {"guidance_scale": 3.0}
    p = _params(family, "", 3, **fields)
    p = p.__class__(**{**p.__dict__, "num_inference_steps": 1})
    assert p.guided
    schedule = plan_batch(family, p)
    assert len(schedule.plan) == 1 and schedule.run_steps == {schedule.plan[0].model: [0], **(
        {schedule.plan[0].guide: [0]} if schedule.plan[0].guide else {})}
    out = denoise_batch(family, [p], schedule)
    assert out.steps == 1 and sum(out.calls.values()) == 2  # the conditional and the guiding forward
    frames = (p.num_frames,) if family.temporal_factor else ()
    assert out.images[0].shape == (1, *frames, p.height, p.width, 3)


@pytest.mark.parametrize("model", MODELS)
def test_predict_returns_its_prediction_dtype_in_bfloat16(model):
    """CFG parallelism moves predictions in ``prediction_dtype`` (parallel.cfg): Z-Image's
    ``predict`` upcasts to float32, as ZImagePipeline does, and went through bf16 there while one
    rank guided in float32 (helper-72). Each family in bf16 declares what it returns."""
    from pipeline.families.z_image import ZImageFamily

    spec = EMBEDDED[model]
    family = load_family(spec.family, spec.build(), torch_dtype=torch.bfloat16, device="cpu")
    seen = []
    predict = family.predict

    def recording(*args, **kwargs):
        out = predict(*args, **kwargs)
        seen.append(out.dtype)
        return out

    family.predict = recording
    p = _params(family, "", 3)
    p = p.__class__(**{**p.__dict__, "num_inference_steps": 1})
    denoise_batch(family, [p], plan_batch(family, p))
    assert seen and set(seen) == {family.prediction_dtype}
    assert family.prediction_dtype == (torch.float32 if isinstance(family, ZImageFamily) else torch.bfloat16)


def test_denoiser_ranks_load_no_encoders_and_decode_slices_the_same(family, request):
    """Sequence-parallel ranks other than 0 load the transformers alone (``components=
    "denoiser"``): fewer bytes, the same geometry. VAE slicing decodes the same pixels."""
    path = EMBEDDED[request.node.callspec.params["family"]].build()
    denoiser = load_family(family.family, path, torch_dtype=torch.float32, device="cpu", components="denoiser")
    assert getattr(denoiser.pipe, "vae", None) is None and getattr(denoiser.pipe, "text_encoder", None) is None
    assert 0 < denoiser.parameter_bytes() < family.parameter_bytes()
    assert (denoiser.spatial_factor, denoiser.temporal_factor) == (family.spatial_factor, family.temporal_factor)
    assert list(denoiser.transformers) == list(family.transformers)
    with pytest.raises(ValueError, match="components must be one of all, denoiser"):
        load_family(family.family, path, torch_dtype=torch.float32, device="cpu", components="text")

    sliced = load_family(family.family, path, torch_dtype=torch.float32, device="cpu", vae_slicing=True)
    assert sliced.pipe.vae.use_slicing and not family.pipe.vae.use_slicing  # else the comparison below is vacuous
    p = _params(family, "", 1)
    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    latents, _ = family.prepare_latents(generators, [1, 1], p, **_inputs(family, p))
    assert np.abs(sliced.decode(latents, p) - family.decode(latents, p)).max() <= 1e-5
    if family.requires_image:
        return  # image inputs need the VAE: rank 0 prepares them and broadcasts (BatchRunner._shared_latents)
    # a rank without the VAE shapes and draws the same initial latents as rank 0
    again = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    assert torch.equal(denoiser.prepare_latents(again, [1, 1], p)[0], latents)
