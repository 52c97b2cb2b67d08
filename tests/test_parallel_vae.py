"""Tile-parallel VAE decode on CPU: two gloo processes against diffusers' own tiled decode."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.groups import free_port
from parallel.vae import parallel_tiled_decode
from pipeline.tiny.registry import resolve_checkpoint

# name: (tiny model, VAE class, latent shape, VAE setup). Wan: 96x96, 9 frames, 3x3 tiles of
# 48 px at stride 32 (the last row and column narrower), so the two ranks hold 5 and 4 tiles of
# different shapes; FLUX / FLUX.2: 96x96 images, 2x2 tiles of their default 64 px at stride 48.
CASES = {
    "wan": ("tiny-wan", "AutoencoderKLWan", (1, 4, 3, 12, 12), lambda vae: vae.enable_tiling(48, 48, 32, 32)),
    "wan-sliced": ("tiny-wan", "AutoencoderKLWan", (2, 4, 2, 12, 12),
                   lambda vae: (vae.enable_tiling(48, 48, 32, 32), vae.enable_slicing())),
    "flux": ("tiny-flux", "AutoencoderKL", (1, 4, 24, 24), lambda vae: vae.enable_tiling()),
    "flux2": ("tiny-flux2", "AutoencoderKLFlux2", (1, 4, 48, 48), lambda vae: vae.enable_tiling()),
}
# |tiled - untiled| bounds, (max, mean): what parallel_tiled_decode's docstring states for
# CASES' seeded latents (measured: wan 0.69 / 0.070, flux 0.64 / 0.082, flux2 0.44 / 0.026).
UNTILED_BOUND = {"wan": (0.75, 0.08), "flux": (0.7, 0.09), "flux2": (0.5, 0.03)}


def _case(name: str, path):
    import diffusers

    model, cls, shape, setup = CASES[name]
    vae = getattr(diffusers, cls).from_pretrained(path, subfolder="vae").eval()
    setup(vae)
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(sum(map(ord, name))))
    return vae, latents


@torch.no_grad()
def _diffusers_tiled(vae, latents):
    # with slicing, decode() runs tiled_decode one sample at a time (the latents exceed one tile)
    return vae.decode(latents).sample if vae.use_slicing else vae.tiled_decode(latents).sample


def _rank(rank: int, world_size: int, port: int, paths: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        subgroup = dist.new_group(list(range(world_size)))
        results = {}
        for name in CASES:
            vae, latents = _case(name, paths[CASES[name][0]])
            group = subgroup if name == "flux" else None  # once through an explicit group
            results[name] = parallel_tiled_decode(vae, latents, rank, world_size, group=group)
            assert (results[name] is None) == (rank != 0)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as in the rank processes: on a busy 2-core machine, several threads
    spin-wait for each other and these tiny convolutions get about ten times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def paths():
    return {model: resolve_checkpoint(model, None) for model, *_ in CASES.values()}


@pytest.fixture(scope="module")
def two_ranks(paths, tmp_path_factory):
    """Rank 0's result of every case, decoded by two gloo processes."""
    out = str(tmp_path_factory.mktemp("parallel_vae") / "rank0.pt")
    mp.spawn(_rank, args=(2, free_port("127.0.0.1"), paths, out), nprocs=2, join=True)
    return torch.load(out)


@pytest.mark.parametrize("name", CASES)
def test_two_ranks_equal_diffusers_tiled_decode(two_ranks, paths, name):
    vae, latents = _case(name, paths[CASES[name][0]])
    expected = _diffusers_tiled(vae, latents)
    got = two_ranks[name]
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", CASES)
def test_one_rank_is_diffusers_tiled_decode(paths, name):
    vae, latents = _case(name, paths[CASES[name][0]])
    assert torch.equal(parallel_tiled_decode(vae, latents, 0, 1), _diffusers_tiled(vae, latents))


@pytest.mark.parametrize("name", UNTILED_BOUND)
def test_tiled_stays_within_the_stated_bound_of_untiled(paths, name):
    vae, latents = _case(name, paths[CASES[name][0]])
    tiled = parallel_tiled_decode(vae, latents, 0, 1)
    vae.disable_tiling()
    with torch.no_grad():
        untiled = vae.decode(latents).sample
    diff = (tiled - untiled).abs()
    max_bound, mean_bound = UNTILED_BOUND[name]
    assert diff.max().item() <= max_bound and diff.mean().item() <= mean_bound
    assert diff.mean().item() > 0  # it did tile


def test_bad_calls_are_refused(paths):
    vae, latents = _case("wan", paths["tiny-wan"])
    with pytest.raises(ValueError, match="5-D latents"):
        parallel_tiled_decode(vae, latents[:, :, 0], 0, 1)
    with pytest.raises(ValueError, match="outside world_size"):
        parallel_tiled_decode(vae, latents, 1, 1)
    with pytest.raises(TypeError, match="no parallel tiled decode for Linear"):
        parallel_tiled_decode(torch.nn.Linear(2, 2), latents, 0, 1)
