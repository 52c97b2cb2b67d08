"""FLUX.1-dev-sized transformer (random weights, bf16) at 1024x1024 on one GPU, per kernel.

Builds FluxTransformer2DModel with FLUX.1-dev's config (19 double + 38 single blocks,
24 heads x 128, guidance embedding), random weights, and times one transformer forward
(4096 image + 512 text tokens, batch 1) with each available attention kernel, through the
same per-layer switch the server uses; then the same with world size 1 through yunchang's
LongContextAttention (the sequence-parallel path). Prints ms per step and the ratio to
torch SDPA.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402


def main() -> None:
    from diffusers import FluxTransformer2DModel

    from parallel.kernels import KERNELS
    from pipeline.attention import AttentionSwitch, replica_kernel_rejections

    assert torch.cuda.is_available(), "needs CUDA"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56)).to(torch.bfloat16).eval()
    inputs = dict(
        hidden_states=torch.randn(1, 4096, 64, device="cuda", dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, 512, 4096, device="cuda", dtype=torch.bfloat16),
        pooled_projections=torch.randn(1, 768, device="cuda", dtype=torch.bfloat16),
        timestep=torch.tensor([0.5], device="cuda", dtype=torch.bfloat16),
        guidance=torch.tensor([3.5], device="cuda", dtype=torch.float32),
        txt_ids=torch.zeros(512, 3, device="cuda"),
        img_ids=torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(64.0), torch.arange(64.0),
                                           indexing="ij"), -1).reshape(-1, 3).cuda(),
        return_dict=False)

    def step_ms(iters: int = 5) -> float:
        with torch.no_grad():
            model(**inputs)
            times = []
            for _ in range(iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(**inputs)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    print(f"FLUX.1-dev-sized transformer, bf16, 1024x1024, {torch.cuda.get_device_name()}")
    switch = AttentionSwitch([model])
    results = {}
    for name in sorted(KERNELS, key=lambda k: k != "torch_sdpa"):  # the baseline first: every row has its ratio
        reasons = replica_kernel_rejections(name, device=torch.device("cuda"), dtype=torch.bfloat16,
                                            torch_compile=False, num_layers=len(switch.layers))
        if reasons:
            print(f"  {name:12s} skipped: {'; '.join(reasons)}")
            continue
        switch.apply(switch.prepare(name))
        results[name] = step_ms()
        ratio = f"{results['torch_sdpa'] / results[name]:.2f}x" if "torch_sdpa" in results else "n/a"
        print(f"  {name:12s} {results[name]:8.1f} ms/step  ({ratio} vs torch_sdpa)")
    switch.apply(switch.prepare(None))

    import torch.distributed as dist

    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    from parallel.attention import USPAttention
    from parallel.config import ParallelConfig
    from parallel.flux import USPFluxAttnProcessor
    from parallel.groups import free_port, join

    join(0, ParallelConfig(1, 1), "127.0.0.1", free_port(), "cuda:0")

    usp = USPAttention("cuda", 1)
    for module in model.modules():
        if isinstance(getattr(module, "processor", None), FluxAttnProcessor):
            module.set_processor(USPFluxAttnProcessor(usp))
    switch = AttentionSwitch([model])
    for name in ("torch_sdpa", "fa", "sage_attn"):
        if name not in results:
            continue
        switch.apply(switch.prepare(name))
        ms = step_ms()
        print(f"  yunchang USP world_size 1, {name:10s} {ms:8.1f} ms/step  ({results[name] / ms:.2f}x of its "
              "own kernel without yunchang)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
