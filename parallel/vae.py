"""Tile-parallel VAE decode: diffusers' own ``tiled_decode``, its tiles spread over the ranks.

Each rank decodes the tiles of the tile grid that fall to it (round-robin in row-major order),
rank 0 gathers them and blends them with the VAE's own ``blend_v`` / ``blend_h`` exactly as
diffusers' ``tiled_decode`` does. Frames cannot be spread instead: Wan's decoder is causal in
time (each latent frame reads the feature cache the previous one left), so a tile's frames run
on one rank in order.

Supported: ``AutoencoderKLWan`` (Wan 2.1 / 2.2 video, incl. ``patch_size``), ``AutoencoderKL``
(FLUX.1) and ``AutoencoderKLFlux2`` (its ``tiled_decode`` is ``AutoencoderKL``'s, line for line).

diffusers internals this relies on (diffusers 0.42; listed for ``compat/diffusers.py``):

- ``AutoencoderKLWan``: ``clear_cache()``, the instance attributes ``_feat_map`` and
  ``_conv_idx`` it sets, ``decoder(x, feat_cache=, feat_idx=, first_chunk=)``,
  ``post_quant_conv``, ``spatial_compression_ratio``, ``tile_sample_min_height/width``,
  ``tile_sample_stride_height/width``, ``config.patch_size``, ``blend_v``, ``blend_h`` and the
  module function ``diffusers.models.autoencoders.autoencoder_kl_wan.unpatchify``;
- ``AutoencoderKL`` / ``AutoencoderKLFlux2``: ``tile_latent_min_size``,
  ``tile_sample_min_size``, ``tile_overlap_factor``, ``decoder``, ``post_quant_conv``,
  ``config.use_post_quant_conv``, ``blend_v``, ``blend_h``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@torch.no_grad()
def parallel_tiled_decode(vae, latents: torch.Tensor, rank: int, world_size: int, group=None) -> torch.Tensor | None:
    """Decode ``latents`` with ``vae``'s tiled decode, the tiles shared among ``world_size`` ranks.

    Every rank of ``group`` (the default group if None) calls it at the same point with the same
    ``latents``; rank 0 returns the decoded batch, the others None.

    - Wan (``AutoencoderKLWan``): ``latents`` (B, z_dim, T, H/8, W/8) in the VAE's dtype (already
      de-normalised, as ``vae.decode`` takes them) -> (B, 3, 1 + 4 (T - 1), H, W), clamped to
      [-1, 1], the VAE's dtype (``spatial_compression_ratio`` stands in for 8, the temporal
      factor for 4).
    - FLUX (``AutoencoderKL``, ``AutoencoderKLFlux2``): ``latents`` (B, C, H/f, W/f) in the VAE's
      dtype, unpacked and de-normalised -> (B, 3, H, W), the VAE's dtype, not clamped, like
      ``vae.decode`` (f = 2 ** (len(block_out_channels) - 1), 8 for FLUX.1).

    The tile grid and blending come from the VAE's own tile settings (``vae.enable_tiling(...)``
    for Wan; ``tile_sample_min_size`` / ``tile_latent_min_size`` / ``tile_overlap_factor`` for
    ``AutoencoderKL``); ``vae.use_tiling`` itself is not read: this always tiles, as
    ``vae.tiled_decode`` does. With ``vae.use_slicing`` and B > 1 each tile is decoded one sample
    at a time, as ``vae.decode`` does.

    Equality: the result equals ``vae.tiled_decode(latents).sample`` (with slicing:
    ``vae.decode(latents).sample`` when that tiles) for any ``world_size``: every tile is decoded by
    the same calls on the same inputs and blended in the same order. Measured on CPU: bit-equal
    when the ranks and the reference run the same number of torch threads; up to 6e-7 apart
    when they do not (FLUX's attention and GroupNorm reductions change order).

    Against the untiled ``vae.decode`` it differs where tiles overlap (blended linearly) and
    wherever a tile's decoder sees less context than the whole frame (its mid-block attention,
    and GroupNorm statistics for ``AutoencoderKL``); that depends on the VAE and the tile size,
    not on this function. Measured on the tiny models of ``pipeline/tiny`` with seeded N(0, 1)
    latents, max / mean |tiled - untiled| (outputs about [-1, 1]): tiny-wan (random weights),
    96x96, 9 frames, 3x3 tiles of 48 px at stride 32: 0.69 / 0.070; tiny-flux (trained), 96x96,
    2x2 tiles of 64 px: 0.64 / 0.082; tiny-flux2 (random), 96x96, 2x2 tiles: 0.44 / 0.026.
    ``tests/test_parallel_vae.py`` holds them to 0.75 / 0.08, 0.7 / 0.09 and 0.5 / 0.03. No bound
    is claimed for real checkpoints at diffusers' default tiles (Wan: 256 px at stride 192).

    Traffic: the decoded tiles travel to rank 0 through ``dist.gather_object`` as host tensors
    (about the decoded video's size in all, plus the overlaps); rank 0 moves them to
    ``latents.device``. Runs under ``torch.no_grad()``. Accelerate offload hooks
    (``enable_model_cpu_offload``) are not run: the VAE must already be on ``latents.device``.

    Raises ``TypeError`` for a VAE class other than the supported ones, ``ValueError`` for
    latents of the wrong rank (5-D for Wan, 4-D otherwise), a ``rank`` outside
    ``[0, world_size)`` or a ``world_size`` that differs from the process group's.
    """
    tiling = _tiling_for(vae)
    if latents.dim() != tiling.latent_dims:
        raise ValueError(f"{type(vae).__name__} decodes {tiling.latent_dims}-D latents, got shape "
                         f"{tuple(latents.shape)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if world_size > 1 and dist.get_world_size(group) != world_size:
        raise ValueError(f"world_size {world_size} differs from the process group's {dist.get_world_size(group)}")

    rows, cols = tiling.grid(vae, latents)
    origins = [(i, j) for i in rows for j in cols]
    slices = latents.split(1) if vae.use_slicing and latents.shape[0] > 1 else (latents,)
    mine = {n: torch.cat([tiling.decode_tile(vae, z, i, j) for z in slices])
            for n, (i, j) in enumerate(origins) if n % world_size == rank}
    if tiling.after_tiles is not None:
        tiling.after_tiles(vae)
    tiles = _gather_on_rank0(mine, rank, world_size, group, latents.device)
    if rank != 0:
        return None
    grid = [[tiles[r * len(cols) + c] for c in range(len(cols))] for r in range(len(rows))]
    return tiling.blend(vae, grid, latents)


def _gather_on_rank0(mine: dict[int, torch.Tensor], rank: int, world_size: int, group,
                     device: torch.device) -> dict[int, torch.Tensor]:
    """Every rank's ``{tile index: tile}`` merged on rank 0 (on ``device``); {} elsewhere."""
    if world_size == 1:
        return mine
    dst = 0 if group is None else dist.get_global_rank(group, 0)
    sent = {} if rank == 0 else {n: t.cpu() for n, t in mine.items()}  # rank 0 keeps its own
    received = [None] * world_size if rank == 0 else None
    dist.gather_object(sent, received, dst=dst, group=group)
    if rank != 0:
        return {}
    for part in received:
        mine.update({n: t.to(device) for n, t in part.items()})
    return mine


@dataclass(frozen=True)
class _Tiling:
    """One VAE class's ``tiled_decode``, cut where the tiles are decoded.

    ``grid(vae, z)``: the latent row and column origins of the tiles; ``decode_tile(vae, z, i,
    j)``: the decoded tile at latent origin (i, j); ``after_tiles(vae)``: what diffusers runs once
    all tiles are decoded; ``blend(vae, rows, z)``: the decoded tiles, row-major, blended into
    the output."""

    latent_dims: int
    grid: Callable
    decode_tile: Callable
    blend: Callable
    after_tiles: Callable | None = None


def supports(vae) -> bool:
    """Whether :func:`parallel_tiled_decode` can decode with ``vae`` (its class is supported)."""
    try:
        _tiling_for(vae)
    except TypeError:
        return False
    return True


def tiles_needed(vae, latents: torch.Tensor) -> bool:
    """Whether diffusers' ``decode`` of ``latents`` would tile (the VAE's tiling is on and the
    latents exceed one tile): only then is the parallel decode the same computation."""
    if not getattr(vae, "use_tiling", False):
        return False
    if _tiling_for(vae) is _WAN:
        min_h, min_w, _, _ = _wan_latent_tile(vae)
        return latents.shape[-1] > min_w or latents.shape[-2] > min_h
    return latents.shape[-1] > vae.tile_latent_min_size or latents.shape[-2] > vae.tile_latent_min_size


def _tiling_for(vae) -> _Tiling:
    from diffusers import AutoencoderKL, AutoencoderKLFlux2, AutoencoderKLWan

    if isinstance(vae, AutoencoderKLWan):
        return _WAN
    if isinstance(vae, (AutoencoderKL, AutoencoderKLFlux2)):
        return _KL
    raise TypeError(f"no parallel tiled decode for {type(vae).__name__} "
                    "(supported: AutoencoderKLWan, AutoencoderKL, AutoencoderKLFlux2)")


# --- AutoencoderKLWan.tiled_decode (diffusers 0.42) ------------------------------------------

def _wan_latent_tile(vae) -> tuple[int, int, int, int]:
    r = vae.spatial_compression_ratio
    return (vae.tile_sample_min_height // r, vae.tile_sample_min_width // r,
            vae.tile_sample_stride_height // r, vae.tile_sample_stride_width // r)


def _wan_grid(vae, z: torch.Tensor) -> tuple[range, range]:
    _, _, stride_h, stride_w = _wan_latent_tile(vae)
    return range(0, z.shape[3], stride_h), range(0, z.shape[4], stride_w)


def _wan_decode_tile(vae, z: torch.Tensor, i: int, j: int) -> torch.Tensor:
    min_h, min_w, _, _ = _wan_latent_tile(vae)
    vae.clear_cache()
    time = []
    for k in range(z.shape[2]):
        vae._conv_idx = [0]
        tile = vae.post_quant_conv(z[:, :, k: k + 1, i: i + min_h, j: j + min_w])
        time.append(vae.decoder(tile, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=(k == 0)))
    return torch.cat(time, dim=2)


def _wan_blend(vae, rows: list[list[torch.Tensor]], z: torch.Tensor) -> torch.Tensor:
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    sample_height = z.shape[3] * vae.spatial_compression_ratio
    sample_width = z.shape[4] * vae.spatial_compression_ratio
    stride_h, stride_w = vae.tile_sample_stride_height, vae.tile_sample_stride_width
    patch_size = vae.config.patch_size
    if patch_size is not None:
        sample_height, sample_width = sample_height // patch_size, sample_width // patch_size
        stride_h, stride_w = stride_h // patch_size, stride_w // patch_size
        blend_height = vae.tile_sample_min_height // patch_size - stride_h
        blend_width = vae.tile_sample_min_width // patch_size - stride_w
    else:
        blend_height = vae.tile_sample_min_height - stride_h
        blend_width = vae.tile_sample_min_width - stride_w

    dec = _blend_grid(vae, rows, blend_height, blend_width, stride_h, stride_w)[..., :sample_height, :sample_width]
    if patch_size is not None:
        dec = unpatchify(dec, patch_size=patch_size)
    return torch.clamp(dec, min=-1.0, max=1.0)


def _blend_grid(vae, rows: list[list[torch.Tensor]], blend_height: int, blend_width: int, keep_height: int,
                keep_width: int) -> torch.Tensor:
    """diffusers' seam blending of decoded tiles (both ``tiled_decode`` loops): in place and in
    its order, each tile's upper edge (``vae.blend_v`` over ``blend_height`` pixels) then its left
    edge (``blend_h``) are blended with its neighbours, the first ``keep_height`` × ``keep_width``
    pixels kept, rows then the grid concatenated along the last two (H, W) dimensions."""
    result_rows = []
    for i, row in enumerate(rows):
        result_row = []
        for j, tile in enumerate(row):
            if i > 0:
                tile = vae.blend_v(rows[i - 1][j], tile, blend_height)
            if j > 0:
                tile = vae.blend_h(row[j - 1], tile, blend_width)
            result_row.append(tile[..., :keep_height, :keep_width])
        result_rows.append(torch.cat(result_row, dim=-1))
    return torch.cat(result_rows, dim=-2)


_WAN = _Tiling(5, _wan_grid, _wan_decode_tile, _wan_blend, after_tiles=lambda vae: vae.clear_cache())


# --- AutoencoderKL.tiled_decode (diffusers 0.42; AutoencoderKLFlux2's is the same) ------------

def _kl_grid(vae, z: torch.Tensor) -> tuple[range, range]:
    overlap_size = int(vae.tile_latent_min_size * (1 - vae.tile_overlap_factor))
    return range(0, z.shape[2], overlap_size), range(0, z.shape[3], overlap_size)


def _kl_decode_tile(vae, z: torch.Tensor, i: int, j: int) -> torch.Tensor:
    tile = z[:, :, i: i + vae.tile_latent_min_size, j: j + vae.tile_latent_min_size]
    if vae.config.use_post_quant_conv:
        tile = vae.post_quant_conv(tile)
    return vae.decoder(tile)


def _kl_blend(vae, rows: list[list[torch.Tensor]], z: torch.Tensor) -> torch.Tensor:
    blend_extent = int(vae.tile_sample_min_size * vae.tile_overlap_factor)
    row_limit = vae.tile_sample_min_size - blend_extent
    return _blend_grid(vae, rows, blend_extent, blend_extent, row_limit, row_limit)


_KL = _Tiling(4, _kl_grid, _kl_decode_tile, _kl_blend)
