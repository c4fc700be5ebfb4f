"""Unpacked forwards between packed ones see no boundaries, and inference is unchanged.

Upstream's patch left the previous packed batch's boundaries on the layers, so the next unpacked
forward reused them. Here the context lives for one forward only.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from miles_qwen35 import torch_varlen
from miles_qwen35.dispatch import CHUNK, _dispatcher
from miles_qwen35.patch import is_gated_deltanet
from miles_qwen35.tiny import tiny_model
from transformers.models.qwen3_5 import modeling_qwen3_5

from miles_core.ci.register import register_cpu_ci
from miles_core.hardware.gdn import gdn_model_device
from miles_core.patches import prepare_model
from miles_core.patches.packing import PACKING_KWARG

register_cpu_ci(est_time=9, suite="stage-a-cpu")


@pytest.fixture
def spies(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Counts calls of the variable-length kernels."""
    counts = {"conv": 0, "chunk": 0}

    def counting(name: str, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(torch_varlen, "causal_conv1d", counting("conv", torch_varlen.causal_conv1d))
    monkeypatch.setattr(
        torch_varlen, "chunk_gated_delta_rule", counting("chunk", torch_varlen.chunk_gated_delta_rule)
    )
    return SimpleNamespace(counts=counts)


@torch.no_grad()
def test_packed_then_unpacked_then_packed(qwen_pm, docs, spies, arch: str) -> None:
    model, unpatched = tiny_model(arch).eval(), tiny_model(arch).eval()  # same seed, same weights
    prepare_model(model)
    assert spies.counts == {"conv": 1, "chunk": 1}  # the probe ran the variable-length kernels
    seen = []
    gdn = next(m for m in model.modules() if is_gated_deltanet(m))
    gdn.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get(PACKING_KWARG)), with_kwargs=True)

    first = model(docs.ids, position_ids=docs.position_ids).logits
    assert spies.counts == {"conv": 2, "chunk": 2} and seen[-1] is not None

    batch = torch.randint(2, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    unpacked = model(batch).logits  # batch of 2, no position_ids, the config's use_cache=True
    assert seen[-1] is None and spies.counts == {"conv": 2, "chunk": 2}
    assert torch.equal(unpacked, unpatched(batch).logits)  # exactly the unpatched model

    again = model(docs.ids, position_ids=docs.position_ids).logits
    assert spies.counts == {"conv": 3, "chunk": 3} and seen[-1] is not None
    assert torch.equal(first, again)
    for ids, part in zip(docs.alone, docs.slices):
        assert (again[:, part] - model(ids).logits).abs().max().item() <= 1e-5


@torch.no_grad()
def test_batched_generation_with_a_cache_is_unchanged(qwen_pm) -> None:
    # Decoding with a cache runs kernels this plugin leaves alone (fla's recurrent one where fla
    # is installed, which takes CUDA tensors only): where the engine would run.
    device = gdn_model_device()
    model, unpatched = tiny_model("qwen3_5", device=device).eval(), tiny_model("qwen3_5", device=device).eval()
    prepare_model(model)
    prompts = torch.randint(2, 128, (2, 9), generator=torch.Generator().manual_seed(4)).to(device)
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0  # left padding, as a batched engine does
    prompts[1, :3] = 0
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    out = model.generate(prompts, **settings)
    assert torch.equal(out, unpatched.generate(prompts, **settings))
    assert out.shape == (2, 15)


def test_unpacked_cpu_calls_skip_a_triton_kernel_that_transformers_bound() -> None:
    """With fla installed transformers binds the kernels to Triton whatever the device; an
    unpacked forward on CPU tensors then goes to the torch implementation under the wrappers."""
    torch_kernel = modeling_qwen3_5.torch_chunk_gated_delta_rule
    triton_calls = []

    @functools.wraps(torch_kernel)
    def triton_bound(*args, **kwargs):
        triton_calls.append(kwargs)
        if not args[0].is_cuda:
            raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")
        return torch_kernel(*args, **kwargs)

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 2, 8, generator=gen) for _ in range(3))
    g, beta = -torch.rand(1, 9, 2, generator=gen), torch.rand(1, 9, 2, generator=gen)
    dispatch = _dispatcher(CHUNK, triton_bound)
    out, _ = dispatch(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    expected, _ = torch_kernel(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert torch.equal(out, expected) and not triton_calls
    # boundaries that transformers passes itself stay with the binding, which refuses or honours them
    with pytest.raises(ValueError, match="Triton"):
        dispatch(q, k, v, g=g, beta=beta, cu_seqlens=torch.tensor([0, 4, 9]))
    assert len(triton_calls) == 1
