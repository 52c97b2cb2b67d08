"""Weight sharding of a diffusers transformer across a replica's ranks with PyTorch FSDP2.

``parallel.shard_weights: true``: every block of the transformer's block lists, then the
transformer itself, is wrapped with ``torch.distributed.fsdp.fully_shard`` (FSDP2: PyTorch's
docs of ``fully_shard``; design in pytorch/pytorch#114299, "Per-Parameter-Sharding FSDP"). Each
rank then holds a dim-0 shard of every parameter (a ``DTensor``), so per-rank weight memory
drops about ``world_size``×; a block's parameters are all-gathered by a forward pre-hook just
before the block runs and freed by its forward hook right after (``reshard_after_forward=True``,
set on the root too: FSDP2 otherwise keeps the root's parameters gathered after forward, a
heuristic for training). Buffers are not sharded (each rank keeps them whole).

**Collective contract.** Every all-gather is a collective over the weight mesh: every rank
in the mesh must call the same blocks, in the same order, the same number of times, or the
ranks deadlock. Under sequence parallelism that already holds (every rank runs every step
on its own shard); anything that decides per rank whether to run a block (a cache that skips
blocks, an early stop, a branch that only one rank takes) must decide identically on every
rank, and nothing may call the transformer on one rank only (a warmup on rank 0, a probe).

Inference only: run forwards under ``torch.no_grad()``, not ``torch.inference_mode()``
(FSDP2 copies the all-gathered weights in place into the unsharded parameters, which
inference mode refuses: a clear ``RuntimeError`` is raised before the first collective).
Works on CPU with gloo (a ``"cpu"`` device mesh) and on CUDA with NCCL.
"""

from __future__ import annotations

import torch

# diffusers DiTs' block lists: FLUX.1/FLUX.2/Qwen-Image, FLUX's single stream, Wan; Z-Image's main
# layers and its two refiners
BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers", "noise_refiner",
               "context_refiner")


def weight_mesh(mesh=None):
    """The 1-D ``DeviceMesh`` weights are sharded over: ``mesh`` itself, or (None) one over all
    ``world_size`` ranks of the default process group (``"cuda"`` under NCCL, ``"cpu"`` under
    gloo). Raises ``ValueError`` for a mesh of more than one dimension (FSDP2 would read a 2-D
    mesh as replicate × shard, HSDP) and ``RuntimeError`` when torch.distributed is not
    initialised."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if mesh is not None:
        if mesh.ndim != 1:
            raise ValueError(f"weights are sharded over a 1-D device mesh, got {mesh.ndim} dimensions "
                             f"{mesh.mesh_dim_names}: pass a 1-D mesh over the ranks that share the weights")
        return mesh
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: join the replica's process group first")
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def shard_transformer(transformer: torch.nn.Module, mesh=None) -> None:
    """Shard ``transformer``'s parameters across ``mesh`` in place with FSDP2.

    ``fully_shard`` is applied to each block of ``transformer_blocks``,
    ``single_transformer_blocks`` and ``blocks`` (whichever exist), then to the transformer,
    whose group takes the remaining parameters (embedders, final norm, ``proj_out``, Wan's
    ``scale_shift_table``), all with ``reshard_after_forward=True``. Parameters are set to
    ``requires_grad=False`` (inference: no gradient hooks). The transformer's class becomes
    FSDP2's ``FSDP<Class>`` subclass (``isinstance`` holds), renamed to the original class's
    name so that lookups by class name (cache-dit's adapters) still find it.

    Every rank of ``mesh`` must call this with the same model, and then run the same
    forwards (see the module docstring). ``mesh``: a 1-D ``DeviceMesh`` over the ranks that
    share the weights, or None for all ranks of the default process group (see
    :func:`weight_mesh`). FSDP2 moves each group's parameters to the mesh's device just before
    sharding them, so a transformer loaded on the host is moved block by block (read in
    torch 2.13's ``_move_states_to_device``; not measured here, there is no GPU in CI).
    Raises ``ValueError`` if the transformer has no block list, is already sharded, or
    ``mesh`` is not 1-D.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if isinstance(transformer, FSDPModule):
        raise ValueError(f"{type(transformer).__name__} is already sharded")
    blocks = [block for name in BLOCK_LISTS for block in getattr(transformer, name, ())]
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} has none of the block lists {', '.join(BLOCK_LISTS)}: "
                         "nothing to shard block by block")
    mesh = weight_mesh(mesh)
    transformer.requires_grad_(False)
    for module in (*blocks, transformer):
        fully_shard(module, mesh=mesh, reshard_after_forward=True)
        _keep_class_name(module)
    transformer.register_forward_pre_hook(_refuse_inference_mode, prepend=True)  # before FSDP's own pre-hook


def _keep_class_name(module: torch.nn.Module) -> None:
    """Give FSDP2's ``FSDP<Class>`` subclass its base's name and module back.

    cache-dit finds its adapter for a transformer by class name (``"Flux"``, ``"Wan"``
    prefixes) and branches on it inside adapters (``Flux2``, ``WanVACE``...), and
    ``pipeline.cache_dit_actions.BLOCK_REGISTRY`` is keyed by class name: under FSDP's name
    none of them would match. FSDP2 itself recognises its modules by ``isinstance(m, FSDPModule)``.
    """
    cls = type(module)
    base = next((b for b in cls.__bases__ if b.__name__ != "FSDPModule"), None)
    if base is not None and cls.__name__ == f"FSDP{base.__name__}":
        cls.__name__, cls.__qualname__, cls.__module__ = base.__name__, base.__qualname__, base.__module__


def _refuse_inference_mode(module, args):
    if torch.is_inference_mode_enabled():
        raise RuntimeError(f"{type(module).__name__} has FSDP2-sharded weights: run it under torch.no_grad(), "
                           "not torch.inference_mode() (FSDP2 writes the gathered weights in place)")


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` went through :func:`shard_transformer` (FSDP2's ``FSDPModule``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def local_parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s weights held by this rank: parameters and buffers, a ``DTensor``
    counted by its local shard (``to_local()``; FSDP2's dim-0 padding not included). Between
    forwards a sharded transformer holds about ``1/world_size`` of its parameters; during a
    forward, also the root's own parameters (gathered for the whole forward) and the running
    block's."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    return sum(local(t).numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
