"""Parallel layout of one replica and the checks that refuse layouts that cannot work."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """USP layout (yunchang's terms): ``world_size = ulysses_degree × ring_degree`` ranks.

    Ulysses splits attention heads across ``ulysses_degree`` ranks with all-to-all; ring
    attention passes K/V blocks around ``ring_degree`` ranks and merges partial results by
    their log-sum-exp (DeepSpeed-Ulysses, arXiv 2309.14509; USP, arXiv 2405.07719).
    """

    ulysses_degree: int = 1
    ring_degree: int = 1

    @property
    def world_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    def startup_problems(self, *, num_heads: int, bundles: int | None = None) -> list[str]:
        """Every reason this layout cannot serve a model with ``num_heads`` attention heads."""
        problems = []
        if self.ulysses_degree < 1 or self.ring_degree < 1:
            problems.append(f"ulysses_degree ({self.ulysses_degree}) and ring_degree ({self.ring_degree}) "
                            "must be >= 1")
        elif num_heads % self.ulysses_degree:
            problems.append(f"the model has {num_heads} attention heads, not divisible by "
                            f"ulysses_degree={self.ulysses_degree}")
        if bundles is not None and bundles != self.world_size:
            problems.append(f"world_size = ulysses_degree x ring_degree = {self.world_size} but the replica has "
                            f"{bundles} placement-group bundles (one per rank)")
        return problems

    def split_problems(self, lengths: dict[str, int]) -> list[str]:
        """Sequences that cannot be split evenly across the ranks (name -> token count)."""
        n = self.world_size
        return [f"{name} has {count} tokens, not divisible by world_size={n}"
                for name, count in lengths.items() if n > 1 and count % n]
