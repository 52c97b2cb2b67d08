"""Parallel layout of one replica and the checks that refuse layouts that cannot work."""

from __future__ import annotations

from dataclasses import dataclass

CFG_DEGREES = (1, 2)  # the branches a guided step has: conditional and guiding


@dataclass(frozen=True)
class ParallelConfig:
    """Layout of one replica: ``world_size = cfg_degree × ulysses_degree × ring_degree`` ranks,
    a device mesh (cfg × ring × ulysses; rank = cfg_rank · sp_degree + ring_rank ·
    ulysses_degree + ulysses_rank, yunchang's "Ulysses low" order).

    Each of the ``cfg_degree`` CFG groups is one sequence-parallel group of ``sp_degree =
    ulysses_degree × ring_degree`` ranks (USP, yunchang's terms): Ulysses splits attention heads
    across ``ulysses_degree`` ranks with all-to-all; ring attention passes K/V blocks around
    ``ring_degree`` ranks and merges partial results by their log-sum-exp (DeepSpeed-Ulysses,
    arXiv 2309.14509; USP, arXiv 2405.07719). With ``cfg_degree`` 2 the conditional and guiding
    forwards of a guided step run on different groups (CFG parallelism, as xDiT's
    ``cfg_degree``: arXiv 2411.01738). ``shard_weights``: the transformers' weights are sharded
    across all ``world_size`` ranks with FSDP2 (``parallel.fsdp``).
    """

    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_degree: int = 1
    shard_weights: bool = False

    @classmethod
    def of(cls, parallel: dict | None) -> "ParallelConfig":
        """The layout of a config's ``parallel`` section (a dict; other keys ignored)."""
        parallel = parallel or {}
        return cls(**{k: parallel[k] for k in ("ulysses_degree", "ring_degree", "cfg_degree", "shard_weights")
                      if k in parallel})

    @property
    def sp_degree(self) -> int:
        """Ranks one sample's sequence is split across (one CFG group)."""
        return self.ulysses_degree * self.ring_degree

    @property
    def world_size(self) -> int:
        return self.cfg_degree * self.sp_degree

    def sequence_layout(self) -> "ParallelConfig":
        """The layout of one CFG group: what sequence sharding (``parallel.sharding``) sees."""
        return ParallelConfig(self.ulysses_degree, self.ring_degree)

    def startup_problems(self, *, num_heads: int, bundles: int | None = None) -> list[str]:
        """Every reason this layout cannot serve a model with ``num_heads`` attention heads,
        each naming the ``parallel`` fields."""
        problems = []
        if self.cfg_degree not in CFG_DEGREES:
            problems.append(f"parallel.cfg_degree must be 1 or 2 (the two branches of a guided step), "
                            f"got {self.cfg_degree}")
        if self.ulysses_degree < 1 or self.ring_degree < 1:
            problems.append(f"parallel.ulysses_degree ({self.ulysses_degree}) and parallel.ring_degree "
                            f"({self.ring_degree}) must be >= 1")
        elif num_heads % self.ulysses_degree:
            problems.append(f"the model has {num_heads} attention heads, not divisible by "
                            f"parallel.ulysses_degree={self.ulysses_degree}")
        if bundles is not None and bundles != self.world_size:
            problems.append(f"world_size = cfg_degree x ulysses_degree x ring_degree = {self.world_size} but the "
                            f"replica has {bundles} placement-group bundles (one per rank)")
        if self.shard_weights and self.world_size < 2:
            problems.append("parallel.shard_weights needs a multi-rank replica (world_size = cfg_degree x "
                            "ulysses_degree x ring_degree >= 2)")
        return problems

    def split_problems(self, lengths: dict[str, int]) -> list[str]:
        """Sequences that cannot be split evenly across a CFG group's ranks (name -> token count)."""
        n = self.sp_degree
        return [f"{name} has {count} tokens, not divisible by the {n} sequence-parallel ranks"
                for name, count in lengths.items() if n > 1 and count % n]


def paired_sharding_problem(*, shard_weights: bool, cfg_degree: int, dual_mode: str) -> str | None:
    """Why ``parallel.shard_weights`` under CFG parallelism cannot serve a model whose
    ``dual_mode`` (``pipeline.modes.DualMode``) is ``paired``, else None."""
    if shard_weights and cfg_degree > 1 and dual_mode == "paired":
        return ("parallel.shard_weights with parallel.cfg_degree=2 cannot serve paired transformers: the two CFG "
                "groups run different transformers at once, and every rank must gather the same transformer's "
                "weights together (drop one of the two)")
    return None


def sharding_problems(*, shard_weights: bool, world_size: int, torch_compile: bool = False, loras: bool = False,
                      offload: str = "none") -> list[str]:
    """Every reason ``parallel.shard_weights`` cannot serve this configuration, each naming
    the fields (empty: none, or sharding off).

    ``world_size``: ranks of the replica; ``torch_compile``: ``acceleration.torch_compile``;
    ``loras``: adapters registered in ``model.loras``; ``offload``: ``model.offload``.

    What does work on a sharded transformer, measured on CPU/gloo with torch 2.13, diffusers
    0.42, cache-dit and peft 0.21 (``tests/test_fsdp.py``, ``parallel.fsdp``): diffusers' split/gather hooks with
    our yunchang processors (installed before or after sharding); cache-dit mounted with its
    own adapters (blocks are still called through ``__call__``, so FSDP's hooks run); LoRA
    adapters loaded after sharding (eager ``load_lora_adapter`` / ``set_adapters`` /
    ``delete_adapters``; the adapter weights are plain tensors every rank holds whole). Also
    ``Module.compile`` on the sharded transformer (inductor, measured once outside the tests:
    equal within 2e-6, one graph break at FSDP's hooks). What does not is refused here.
    """
    if not shard_weights:
        return []
    problems = []
    if world_size < 2:
        problems.append(f"parallel.shard_weights needs a multi-rank replica (world_size = {world_size}): "
                        "there is no other rank to share the weights with")
    if torch_compile and loras:
        # The hot-swap slots are created when the model loads, before the ranks join and shard;
        # sharded, they are DTensors, and hot-swapping a plain state dict into them fails
        # ("aten.copy_.default got mixed torch.Tensor and DTensor").
        problems.append("parallel.shard_weights cannot be combined with acceleration.torch_compile and model.loras: "
                        "the LoRA hot-swap slots would be sharded, and PEFT cannot hot-swap into sharded weights")
    if offload != "none":
        problems.append(f"parallel.shard_weights cannot be combined with model.offload={offload!r}: both decide "
                        "where the transformer's weights live (FSDP2 keeps each rank's shard in place and gathers "
                        "it per block); give one or the other")
    return problems
