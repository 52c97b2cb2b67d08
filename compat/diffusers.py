"""diffusers' private APIs that ditserve uses, in one place (tested range: ``TESTED``).

- context parallelism: a transformer's ``_cp_plan``, ``ContextParallelConfig`` (a private
  module) and the split/gather hooks that read the plan;
- attention dispatch: the per-processor ``_attention_backend`` slot, the backend registry and
  its requirement check;
- pipeline helpers our loop calls to reproduce the pipelines exactly (FLUX's latent packing and
  position ids, Wan's T5 prompt encoding) and the transformers' q/k/v projection helpers the
  sequence-parallel processors reuse.
"""

from __future__ import annotations

from compat import CompatError, Reliance, missing

DISTRIBUTION = "diffusers"
TESTED = ">=0.42,<0.43"

RELIES_ON = (
    Reliance("diffusers.models._modeling_parallel", "ContextParallelConfig", "sequence-parallel layout"),
    Reliance("diffusers.hooks.context_parallel", "apply_context_parallel", "split/gather hooks"),
    Reliance("diffusers.hooks.context_parallel", "remove_context_parallel", "split/gather hooks"),
    Reliance("diffusers", "FluxTransformer2DModel._cp_plan", "FLUX's context-parallel plan"),
    Reliance("diffusers", "WanTransformer3DModel._cp_plan", "Wan's context-parallel plan"),
    Reliance("diffusers", "Flux2Transformer2DModel._cp_plan", "FLUX.2's context-parallel plan"),
    Reliance("diffusers", "QwenImageTransformer2DModel._cp_plan", "Qwen-Image's context-parallel plan"),
    Reliance("diffusers.models.transformers.transformer_qwenimage",
             "QwenDoubleStreamAttnProcessor2_0._attention_backend", "per-layer kernel slot"),
    Reliance("diffusers.models.transformers.transformer_qwenimage", "apply_rotary_emb_qwen", "SP Qwen-Image attention"),
    Reliance("diffusers.models.attention_dispatch", "AttentionBackendName", "kernel names"),
    Reliance("diffusers.models.attention_dispatch", "_AttentionBackendRegistry._backends", "registered kernels"),
    Reliance("diffusers.models.attention_dispatch", "_check_attention_backend_requirements", "kernel requirements"),
    Reliance("diffusers.models.transformers.transformer_flux", "FluxAttnProcessor._attention_backend",
             "per-layer kernel slot"),
    Reliance("diffusers.models.transformers.transformer_wan", "WanAttnProcessor._attention_backend",
             "per-layer kernel slot"),
    Reliance("diffusers.models.transformers.transformer_flux", "_get_qkv_projections", "SP FLUX attention"),
    Reliance("diffusers.models.transformers.transformer_wan", "_get_qkv_projections", "SP Wan attention"),
    Reliance("diffusers.models.transformers.transformer_flux2", "_get_qkv_projections", "SP FLUX.2 attention"),
    Reliance("diffusers.models.transformers.transformer_flux2", "Flux2AttnProcessor._attention_backend",
             "per-layer kernel slot"),
    Reliance("diffusers", "FluxPipeline._pack_latents", "FLUX latent packing"),
    Reliance("diffusers", "FluxPipeline._unpack_latents", "FLUX latent unpacking"),
    Reliance("diffusers", "FluxPipeline._prepare_latent_image_ids", "FLUX position ids"),
    Reliance("diffusers", "WanPipeline._get_t5_prompt_embeds", "Wan prompt encoding"),
    Reliance("diffusers", "QwenImageEditPipeline._encode_vae_image", "Qwen-Image-Edit reference latents"),
    Reliance("diffusers", "QwenImageEditPipeline._pack_latents", "Qwen-Image latent packing"),
    Reliance("diffusers", "ZImageTransformer2DModel._build_unified_sequence", "SP Z-Image (the split point)"),
    Reliance("diffusers.models.transformers.transformer_z_image", "ZSingleStreamAttnProcessor._attention_backend",
             "per-layer kernel slot"),
    # parallel/vae.py: diffusers' tiled_decode with its tiles spread over the ranks
    Reliance("diffusers", "AutoencoderKLWan.clear_cache", "parallel tiled decode (Wan's feature cache)"),
    Reliance("diffusers", "AutoencoderKLWan.blend_v", "parallel tiled decode"),
    Reliance("diffusers", "AutoencoderKLWan.blend_h", "parallel tiled decode"),
    Reliance("diffusers.models.autoencoders.autoencoder_kl_wan", "unpatchify", "parallel tiled decode (Wan 2.2)"),
    Reliance("diffusers", "AutoencoderKL.blend_v", "parallel tiled decode"),
    Reliance("diffusers", "AutoencoderKL.blend_h", "parallel tiled decode"),
    Reliance("diffusers", "AutoencoderKLFlux2.blend_v", "parallel tiled decode"),
    Reliance("diffusers", "AutoencoderKLFlux2.blend_h", "parallel tiled decode"),
)


def check() -> list[str]:
    """What the installed diffusers lacks of :data:`RELIES_ON` (empty: nothing)."""
    return missing(DISTRIBUTION, TESTED, RELIES_ON)


def _fail(what: str, exc: Exception) -> CompatError:
    return CompatError(f"diffusers no longer provides {what} ({type(exc).__name__}: {exc}); ditserve is tested "
                       f"with diffusers{TESTED}")


# -- context parallelism ---------------------------------------------------------------------
def cp_plan(transformer) -> dict:
    """The transformer's ``_cp_plan``: which inputs diffusers' hooks split and which output they
    gather. Raises ``ValueError`` when the transformer has none."""
    plan = getattr(transformer, "_cp_plan", None)
    if plan is None:
        raise ValueError(f"{type(transformer).__name__} has no _cp_plan: diffusers cannot split its sequence")
    return plan


def context_parallel_config(ring_degree: int, ulysses_degree: int):
    """diffusers' ``ContextParallelConfig`` (the layout its split/gather hooks read). Raises
    :class:`CompatError` when diffusers no longer has it."""
    try:
        from diffusers.models._modeling_parallel import ContextParallelConfig
    except ImportError as exc:
        raise _fail("diffusers.models._modeling_parallel.ContextParallelConfig", exc) from None
    return ContextParallelConfig(ring_degree=ring_degree, ulysses_degree=ulysses_degree)


def apply_context_parallel(transformer, config) -> None:
    """Install the split/gather hooks of ``transformer``'s ``_cp_plan`` for ``config``. Raises
    ``ValueError`` when it has no ``_cp_plan`` (:func:`cp_plan`)."""
    from diffusers.hooks.context_parallel import apply_context_parallel as apply

    apply(transformer, config, cp_plan(transformer))


def remove_context_parallel(transformer) -> None:
    """Remove the split/gather hooks :func:`apply_context_parallel` installed."""
    from diffusers.hooks.context_parallel import remove_context_parallel as remove

    remove(transformer, cp_plan(transformer))


# -- attention dispatch ------------------------------------------------------------------------
def attention_backend(value: str):
    """diffusers' ``AttentionBackendName`` member of ``value`` (``"flash"``, ``"native"``, ...).
    Raises ``ValueError`` for a value diffusers does not name."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return AttentionBackendName(value)


def backend_problem(value: str) -> str | None:
    """Why diffusers cannot run backend ``value`` here (its own requirement check and registry:
    a missing package, a version below diffusers' minimum), or None. Raises ``ValueError`` for
    a value that is no ``AttentionBackendName`` and :class:`CompatError` when the registry is gone."""
    try:
        from diffusers.models.attention_dispatch import (_AttentionBackendRegistry,
                                                         _check_attention_backend_requirements)
    except ImportError as exc:
        raise _fail("the attention backend registry", exc) from None
    backend = attention_backend(value)
    try:
        _check_attention_backend_requirements(backend)
    except (RuntimeError, ImportError) as exc:
        return str(exc)
    if backend not in _AttentionBackendRegistry._backends:
        return f"diffusers has no kernel registered for {value}"
    return None


def has_backend_slot(processor) -> bool:
    """Whether an attention processor takes a per-layer dispatcher backend."""
    return hasattr(processor, "_attention_backend")


def processor_backend(processor):
    """The backend a processor dispatches to, as diffusers' ``dispatch_attention_fn`` takes it
    (an ``AttentionBackendName`` or None: diffusers' default)."""
    return processor._attention_backend


def get_processor_backend(processor) -> str | None:
    """The backend value a processor dispatches to (None: diffusers' default)."""
    backend = processor._attention_backend
    return getattr(backend, "value", backend)


def set_processor_backend(processor, backend) -> None:
    """Make one processor dispatch to ``backend`` (an ``AttentionBackendName`` or None)."""
    processor._attention_backend = backend


# -- pipeline and transformer helpers ----------------------------------------------------------
def flux_pack_latents(latents, batch_size: int, channels: int, height: int, width: int):
    """(B, C, h, w) → packed (B, (h/2)·(w/2), 4·C), as ``FluxPipeline``."""
    from diffusers import FluxPipeline

    return FluxPipeline._pack_latents(latents, batch_size, channels, height, width)


def flux_unpack_latents(latents, height: int, width: int, vae_scale_factor: int):
    """Packed (B, S, 4·C) → (B, C, h, w) for an image of ``height`` × ``width`` pixels."""
    from diffusers import FluxPipeline

    return FluxPipeline._unpack_latents(latents, height, width, vae_scale_factor)


def flux_latent_image_ids(batch_size: int, height: int, width: int, device, dtype):
    """FLUX's image position ids: (height·width, 3) for a packed latent grid of ``height`` × ``width``."""
    from diffusers import FluxPipeline

    return FluxPipeline._prepare_latent_image_ids(batch_size, height, width, device, dtype)


def qwen_edit_reference_latents(pipe, pixels):
    """One image's reference latents, as ``QwenImageEditPipeline.prepare_latents`` makes them:
    pixels (1, 3, 1, H, W) in [-1, 1] → the VAE's mode normalised with the latents mean / std,
    packed 2×2: (1, (h/2)·(w/2), 4·z)."""
    z = pipe._encode_vae_image(pixels, None)  # sample_mode="argmax": no random draw
    return pipe._pack_latents(z, 1, z.shape[1], z.shape[3], z.shape[4])


def wan_prompt_embeds(pipe, prompts: list[str], max_sequence_length: int, device):
    """UMT5 states (B, ``max_sequence_length``, text_dim) in the text encoder's dtype, zeroed past
    each prompt, on ``device``, as ``WanPipeline`` encodes them."""
    return pipe._get_t5_prompt_embeds(prompt=prompts, num_videos_per_prompt=1,
                                      max_sequence_length=max_sequence_length, device=device)


def flux_qkv_projections(attn, hidden_states, encoder_hidden_states=None):
    """FLUX attention's (q, k, v, encoder q, encoder k, encoder v) projections."""
    from diffusers.models.transformers.transformer_flux import _get_qkv_projections

    return _get_qkv_projections(attn, hidden_states, encoder_hidden_states)


def flux2_qkv_projections(attn, hidden_states, encoder_hidden_states=None):
    """FLUX.2 double-stream attention's (q, k, v, encoder q, encoder k, encoder v) projections."""
    from diffusers.models.transformers.transformer_flux2 import _get_qkv_projections

    return _get_qkv_projections(attn, hidden_states, encoder_hidden_states)


def wan_qkv_projections(attn, hidden_states, encoder_hidden_states=None):
    """Wan attention's (q, k, v) projections."""
    from diffusers.models.transformers.transformer_wan import _get_qkv_projections

    return _get_qkv_projections(attn, hidden_states, encoder_hidden_states)


def replace_z_image_unified_sequence(transformer, build) -> None:
    """Make ``transformer`` (a ``ZImageTransformer2DModel``) build its unified image + caption
    sequence with ``build`` (same arguments and returns as its private
    ``_build_unified_sequence``), for this instance only: where ``parallel.z_image`` splits it.
    Raises :class:`CompatError` when the class has no ``_build_unified_sequence``."""
    if not callable(getattr(type(transformer), "_build_unified_sequence", None)):
        raise _fail("ZImageTransformer2DModel._build_unified_sequence", AttributeError("missing"))
    transformer._build_unified_sequence = build
