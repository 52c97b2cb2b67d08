"""The private APIs ditserve relies on still exist in the installed dependencies (``compat/``).

An upgrade that removes one fails here, naming what is missing and the tested range, rather
than deep inside a batch.
"""

from __future__ import annotations

import pytest
import torch

from compat import Reliance, missing
from compat import cache_dit as cache_dit_compat
from compat import diffusers as diffusers_compat
from compat import ray_serve as ray_serve_compat
from compat import torch as torch_compat
from compat import transformers as transformers_compat
from compat import yunchang as yunchang_compat


@pytest.mark.parametrize("module", [diffusers_compat, cache_dit_compat, yunchang_compat, ray_serve_compat,
                                    torch_compat, transformers_compat],
                         ids=lambda m: m.DISTRIBUTION)
def test_every_reliance_is_present(module):
    problems = module.check()
    assert not problems, "\n".join(problems)


def test_a_missing_reliance_is_named_with_the_tested_range():
    (message,) = missing("diffusers", ">=0.42,<0.43", (Reliance("diffusers", "NoSuchPipeline._helper", "a test"),))
    assert "lacks diffusers.NoSuchPipeline._helper (a test)" in message and "diffusers>=0.42,<0.43" in message


def test_diffusers_accessors_on_the_tiny_models():
    from pipeline.families import load_family
    from pipeline.tiny.registry import EMBEDDED

    for name in ("tiny-flux-random", "tiny-wan"):
        model = EMBEDDED[name]
        family = load_family(model.family, model.build(), torch_dtype=torch.float32, device="cpu")
        assert diffusers_compat.cp_plan(family.transformers["transformer"])  # splittable by diffusers' hooks
    assert diffusers_compat.backend_problem("native") is None
    assert diffusers_compat.backend_problem("_native_math") is None
    assert diffusers_compat.context_parallel_config(1, 2).ulysses_degree == 2


def test_cache_dit_accessors_on_a_mounted_transformer():
    from pipeline.cache_dit_actions import CacheDiTExecutor
    from pipeline.cache_dit_params import CacheDiTParams
    from pipeline.families import load_family
    from pipeline.state import CacheKey
    from pipeline.tiny.registry import EMBEDDED

    model = EMBEDDED["tiny-flux-random"]
    transformer = load_family("flux", model.build(), torch_dtype=torch.float32, device="cpu").transformer
    executor = CacheDiTExecutor(transformer)
    assert not cache_dit_compat.is_mounted(transformer) and cache_dit_compat.contexts(transformer) == []
    executor.mount(CacheKey(CacheDiTParams(), True), 4, [0, 1, 2, 3])
    contexts = cache_dit_compat.contexts(transformer)
    assert cache_dit_compat.is_mounted(transformer) and contexts
    assert contexts[0].cache_config.num_inference_steps == 4
    cache_dit_compat.advance_one_call(transformer)
    executor.unmount()
    assert not cache_dit_compat.is_mounted(transformer)


def test_dynamo_counts_a_frame_past_the_recompile_limit():
    """Past ``recompile_limit`` dynamo runs a frame uncompiled and only warns; the count that
    ``/v1/stats`` reports (``recompile_limit_hits``) sees it."""
    import torch._dynamo

    def scaled(x):
        return x * 2 + 1

    before = torch_compat.dynamo_counts()
    compiled = torch.compile(scaled, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        for dtype in (torch.float32, torch.float64, torch.float16, torch.int32):  # a recompile each
            assert torch.equal(compiled(torch.ones(3, dtype=dtype)), scaled(torch.ones(3, dtype=dtype)))
        after = torch_compat.dynamo_counts()
    assert after["recompile_limit_hits"] > before["recompile_limit_hits"]
    assert after["compiled_graphs"] >= before["compiled_graphs"] + 2 and after["recompile_limit"] == 2
    torch._dynamo.reset()


def test_qwen2vl_processor_of_the_tiny_edit_checkpoint():
    """Without torchvision the processor is transformers' Qwen2VLProcessor less its video part:
    it still expands an image's vision tokens in the text and makes the vision tower's input."""
    import numpy as np
    from PIL import Image
    from transformers import Qwen2VLProcessor

    from pipeline.tiny.registry import EMBEDDED

    processor = transformers_compat.qwen2vl_processor(EMBEDDED["tiny-qwen-image-edit"].build() / "processor")
    assert isinstance(processor, Qwen2VLProcessor)
    if not transformers_compat.has_torchvision():
        assert type(processor).get_attributes() == ["image_processor", "tokenizer"]
    image = Image.fromarray(np.zeros((56, 84, 3), dtype=np.uint8))
    out = processor(text=["<|vision_start|><|image_pad|><|vision_end|>a red cat"], images=[image], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 4, 6]]  # 14-pixel patches of 56x84
    image_token = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((out["input_ids"] == image_token).sum()) == 4 * 6 // 4  # 2x2 merged
