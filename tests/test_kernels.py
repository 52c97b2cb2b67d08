"""Attention-kernel decisions that only bite on GPUs, proven on CPU: which package versions
can serve a kernel, which default kernels a replica may start with, and how ring attention
gets the exact float32 log-sum-exp it merges partial results by."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from yunchang.ring.utils import update_out_and_lse

import parallel.kernels as kernels
from deployments.config import AppConfig
from parallel.attention import cpu_sdpa_attention, efficient_attention_lse, exact_lse, lse_math_attention, usp_kernel
from parallel.kernels import KERNELS, default_kernel_rejections, kernel_rejections, version_problem
from pipeline.runner import BatchRunner


@pytest.mark.parametrize(("name", "installed", "ok"), [
    ("fa", "2.6.3", False),   # yunchang would take it down the 2.7 API path ('2.6.3' < '2.6.3' is False)
    ("fa", "2.7.0", True),
    ("fa", "2.8.3", True),
    ("fa", "2.10.0", False),  # '2.10.0' < '2.6.3' as strings: yunchang picks the pre-2.6.3 API
    ("sage_attn", "1.0.6", False),  # PyPI's sageattention; diffusers needs >= 2.1.1
    ("sage_attn", "2.1.1", True),
    ("sage_attn", "2.2.0", True),
    ("fa", "not-a-version", False),
])
def test_kernel_package_versions(name, installed, ok):
    problem = version_problem(KERNELS[name], installed)
    assert (problem is None) == ok, problem
    if not ok:
        assert installed in problem and KERNELS[name].versions in problem and "README: GPU kernels" in problem


def test_an_installed_but_unusable_kernel_is_refused(monkeypatch):
    """sageattention 1.0.6 (what `pip install sageattention` gets) is installed: requests for
    sage_attn are refused up front, not accepted and failed in every batch."""
    versions = {"sageattention": "1.0.6", "flash_attn": "2.6.3"}
    monkeypatch.setattr(kernels, "installed_version", versions.get)
    sage = kernel_rejections("sage_attn", device_type="cuda", dtype="bfloat16", torch_compile=False, num_layers=4)
    assert sage == ["sageattention 1.0.6 is installed; sage_attn needs >=2.1.1 (README: GPU kernels)"]
    fa = default_kernel_rejections("fa", device_type="cuda", dtype="bfloat16")
    assert fa == ["flash-attn 2.6.3 is installed; fa needs >=2.7,<2.10 (README: GPU kernels)"]
    monkeypatch.setattr(kernels, "installed_version", {"flash_attn": "2.8.3"}.get)
    assert default_kernel_rejections("fa", device_type="cuda", dtype="bfloat16") == []


def test_default_kernel_is_checked_like_a_request():
    """The server's default kernel gets the device/dtype/package rules of an override, not the
    switching rules (torch.compile, a kernel fixed under ring), plus a ring-LSE rule."""
    fa32 = default_kernel_rejections("fa", device_type="cuda", dtype="float32", check_installed=False)
    assert fa32 == ["fa supports float16, bfloat16, not float32"]
    assert default_kernel_rejections("torch_sdpa", device_type="cuda", dtype="bfloat16", ring_degree=2) == []
    assert default_kernel_rejections("torch_math", device_type="cpu", dtype="float32", ring_degree=2) == []
    sage_ring = default_kernel_rejections("sage_attn", device_type="cuda", dtype="bfloat16", ring_degree=2,
                                          check_installed=False)
    assert len(sage_ring) == 1 and "no log-sum-exp" in sage_ring[0] and "fa, torch_sdpa, torch_math" in sage_ring[0]
    assert default_kernel_rejections("nope", device_type="cpu", dtype="float32")[0].startswith(
        "unknown attention backend 'nope'; allowed: fa, torch_sdpa")


def test_config_refuses_a_default_kernel_its_device_cannot_run():
    """The issue's example: dtype float32 with attention_backend fa on CUDA used to start and
    fail every batch with flash-attn's "only supports fp16 and bf16"."""
    with pytest.raises(ValidationError, match=r"acceleration.attention_backend='fa' cannot run with "
                                              r"model.device='cuda', model.dtype='float32'.*not float32"):
        AppConfig.model_validate({"model": {"device": "cuda", "dtype": "float32"},
                                  "acceleration": {"attention_backend": "fa"}})
    with pytest.raises(ValidationError, match="sage_attn gives ring attention no log-sum-exp"):
        AppConfig.model_validate({"model": {"device": "cuda", "dtype": "bfloat16"},
                                  "acceleration": {"attention_backend": "sage_attn"},
                                  "parallel": {"ulysses_degree": 1, "ring_degree": 2}})
    ok = AppConfig.model_validate({"model": {"device": "cuda", "dtype": "bfloat16"},
                                   "acceleration": {"attention_backend": "fa"}})
    assert ok.acceleration.attention_backend == "fa"  # installed or not is the replica's check


def test_a_replica_refuses_to_start_with_a_default_kernel_it_cannot_run():
    with pytest.raises(ValueError, match=r"acceleration.attention_backend='fa' cannot run on this replica "
                                         r"\(cpu, float32\): .*fa needs a CUDA device"):
        BatchRunner("tiny-flux", attention_backend="fa")
    runner = BatchRunner("tiny-flux", attention_backend="torch_math")
    assert runner.state.attention_backend == "torch_math"


def test_usp_kernel_gives_ring_attention_an_exact_lse():
    # on CPU the default runs torch's own SDPA kernel, as on one rank (it ran math, reported as torch_sdpa)
    assert usp_kernel(None, "cpu", 1) == usp_kernel("torch_sdpa", "cpu", 2) == (None, cpu_sdpa_attention)
    assert usp_kernel("torch_math", "cpu", 1) == ("TORCH_MATH", None)
    assert usp_kernel("torch_math", "cpu", 2) == (None, lse_math_attention)
    with pytest.raises(ValueError, match="fa cannot run on cpu"):  # refused before: never a silent fallback
        usp_kernel("fa", "cpu", 2)
    assert usp_kernel(None, "cuda", 1) == ("TORCH_EFFICIENT", None)
    assert usp_kernel("fa", "cuda", 2) == ("FA", None)  # flash-attn returns an exact fp32 LSE
    assert usp_kernel("torch_sdpa", "cuda", 2) == (None, efficient_attention_lse)
    assert usp_kernel("torch_math", "cuda", 2) == (None, lse_math_attention)
    with pytest.raises(ValueError, match="sage_attn gives ring attention no log-sum-exp"):
        usp_kernel("sage_attn", "cuda", 2)


def test_efficient_attention_lse_slices_the_padded_lse():
    """torch's CUDA memory-efficient kernel pads its LSE to a multiple of 32 queries (its meta
    kernel says so on CPU); ditserve's processor returns (B, H, S) float32."""
    q, k, v = (torch.empty(1, 40, 2, 8, device="meta", dtype=torch.bfloat16) for _ in range(3))
    from compat.torch import efficient_attention

    _, padded = efficient_attention(*(x.transpose(1, 2) for x in (q, k, v)))
    assert padded.shape == (1, 2, 64)
    out, lse = efficient_attention_lse(q, k, v)
    assert out.shape == (1, 40, 2, 8) and out.dtype == torch.bfloat16
    assert lse.shape == (1, 2, 40) and lse.dtype == torch.float32


def _two_block_merge(lse_of):
    """Attention over 40 queries and two key blocks (two ring steps), merged by yunchang's
    ``update_out_and_lse`` with each block's LSE as ``lse_of`` gives it; the reference is
    attention over all keys at once."""
    torch.manual_seed(0)
    q = torch.randn(1, 40, 2, 16)
    k, v = torch.randn(1, 80, 2, 16), torch.randn(1, 80, 2, 16)
    out = lse = None
    for block in (slice(0, 40), slice(40, 80)):
        block_out, block_lse = lse_math_attention(q, k[:, block], v[:, block])
        out, lse = update_out_and_lse(out, lse, block_out, lse_of(block_lse))
    reference, _ = lse_math_attention(q, k, v)
    return (out.to(q.dtype) - reference).abs().max().item()


def _padded(lse):  # what the CUDA kernel returns: rows up to a multiple of 32, in the inputs' dtype
    rows = -(-lse.shape[-1] // 32) * 32
    return torch.cat([lse, torch.full((*lse.shape[:-1], rows - lse.shape[-1]), float("inf"))], -1)


def test_ring_merge_needs_the_sliced_float32_lse():
    with pytest.raises(RuntimeError, match="size of tensor"):  # the failure: 64 LSE rows, 40 queries
        _two_block_merge(_padded)
    assert _two_block_merge(lambda lse: exact_lse(_padded(lse), 40)) <= 1e-6
    rounded = _two_block_merge(lambda lse: lse.to(torch.bfloat16))  # what yunchang's cast does
    assert rounded > 100 * _two_block_merge(lambda lse: lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_sdpa_processor_is_torch_sdpa_and_its_lse_merges_exactly(dtype):
    """``torch_sdpa`` under sequence parallelism on CPU: the same output as
    ``F.scaled_dot_product_attention`` on the whole sequence (bit for bit: the same kernel), and
    a float32 LSE two ring blocks merge by to the full attention."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 40, 4, 16, dtype=dtype) for _ in range(3))
    out, lse = cpu_sdpa_attention(q, k, v, softmax_scale=0.3)
    reference = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), scale=0.3)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, 4, 40)
    assert torch.equal(out, reference.transpose(1, 2))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * 0.3
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    merged = merged_lse = None
    for block in (slice(0, 20), slice(20, 40)):
        block_out, block_lse = cpu_sdpa_attention(q, k[:, block], v[:, block], softmax_scale=0.3)
        merged, merged_lse = update_out_and_lse(merged, merged_lse, block_out, block_lse)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (merged.to(dtype).float() - out.float()).abs().max() <= tolerance
    # a strided last dimension (the op reads it as contiguous; helper-36's review: error 2.2)
    wide = torch.randn(2, 40, 4, 32, dtype=dtype)
    strided, _ = cpu_sdpa_attention(wide[..., ::2], k, v, softmax_scale=0.3)
    same, _ = cpu_sdpa_attention(wide[..., ::2].contiguous(), k, v, softmax_scale=0.3)
    assert torch.equal(strided, same)


def test_kernels_without_mask_support_are_refused_for_masked_models():
    from parallel.kernels import mask_problem

    assert mask_problem("fa", masked=True) and mask_problem("sage_attn", masked=True)
    assert mask_problem("torch_sdpa", masked=True) == mask_problem("torch_math", masked=True) == []
    assert mask_problem("fa", masked=False) == []
