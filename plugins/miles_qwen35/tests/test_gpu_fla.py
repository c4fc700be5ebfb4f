"""On a GPU with fla: the packed path runs fla's variable-length kernels and stays per-document.

Skips without CUDA or without flash-linear-attention. The first run compiles and autotunes fla's
kernels (minutes on an H200; the CI estimate includes it). fla's kernels run float32 matmuls in
tf32, so the tolerances are relative to the outputs' magnitude, and the leak (without the packing
context) must stay far above them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from miles_qwen35 import fla_varlen, torch_varlen
from miles_qwen35.tiny import tiny_model

from miles_core.ci.register import register_cuda_ci
from miles_core.patches import prepare_model
from miles_core.patches.packing import PackedSequences, packed_position_ids

register_cuda_ci(est_time=300, suite="stage-b-1-gpu-h200", labels=["gpu"])

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and fla_varlen.fla_available()), reason="needs CUDA and fla"
)
#: fla vs the fp32 torch reference, relative to each tensor's largest entry. Measured on an H200
#: (2026-11-30): 2.8e-3 at worst over the outputs and gradients (tf32 rounding, ~5e-4 per product,
#: compounded through the chunked recurrence).
RTOL = 5e-3
#: the least a leak across the boundaries must move each compared tensor (measured on CPU with the
#: same data: 0.038-0.67 for the kernels' outputs and gradients, 0.044-0.11 for tiny models' logits)
LEAK_FLOOR = 2e-2
LENGTHS = [100, 37, 1, 250]
NAMES = ("conv", "chunk", "dq", "dk", "dv", "dg", "dbeta", "dx", "dw")


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def test_fla_kernels_match_the_torch_reference_with_gradients() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    total, hk, hv, d = sum(LENGTHS), 2, 4, 64
    ctx = PackedSequences.from_lengths(LENGTHS, device="cuda")
    one_document = PackedSequences.from_lengths([total], device="cuda")

    def leaf(*shape, fn=lambda t: t):
        return fn(torch.randn(*shape, device="cuda", generator=gen)).requires_grad_()

    q, k, v = leaf(1, total, hk, d), leaf(1, total, hk, d), leaf(1, total, hv, d)
    g = leaf(1, total, hv, fn=lambda t: -torch.sigmoid(t))
    beta = leaf(1, total, hv, fn=torch.sigmoid)
    x, w = leaf(1, 96, total), leaf(96, 4, fn=lambda t: t * 0.5)

    def torch_kernels(seq_idx):
        return (lambda: torch_varlen.causal_conv1d(x, w, None, "silu", seq_idx),
                lambda: torch_varlen.chunk_gated_delta_rule(q, k, v, g, beta, seq_idx, use_qk_l2norm_in_kernel=True))

    results = {}
    for name, (conv, chunk) in {
        "fla": (lambda: fla_varlen.causal_conv1d(x, w, None, "silu", ctx),
                lambda: fla_varlen.chunk_gated_delta_rule(q, k, v, g, beta, ctx, use_qk_l2norm_in_kernel=True)),
        "torch": torch_kernels(ctx.seq_idx),
        "leaking": torch_kernels(one_document.seq_idx),  # negative control: the tolerance can fail
    }.items():
        for t in (q, k, v, g, beta, x, w):
            t.grad = None
        out_conv, out_chunk = conv(), chunk()
        (out_conv.square().sum() + out_chunk.square().sum()).backward()
        results[name] = [out_conv, out_chunk] + [t.grad.clone() for t in (q, k, v, g, beta, x, w)]
    diffs = {n: rel_diff(a, b) for n, a, b in zip(NAMES, results["fla"], results["torch"])}
    leaks = {n: rel_diff(a, b) for n, a, b in zip(NAMES, results["leaking"], results["torch"])}
    assert max(diffs.values()) <= RTOL, diffs
    assert min(leaks.values()) > LEAK_FLOOR, leaks


def test_packed_model_on_gpu_matches_per_document(miles_pm, monkeypatch) -> None:
    import miles_qwen35.plugin

    miles_pm.register(miles_qwen35.plugin, name="miles-qwen35")
    calls = []
    monkeypatch.setattr(fla_varlen, "chunk_gated_delta_rule",
                        lambda *a, _f=fla_varlen.chunk_gated_delta_rule, **k: calls.append(1) or _f(*a, **k))
    model = tiny_model("qwen3_5").cuda().eval()
    unprepared = copy.deepcopy(model)  # the negative control: the same weights through transformers' forward
    report = prepare_model(model)
    assert report["gdn-packing"].kernels["fla.ops.gated_delta_rule"].startswith("available")
    assert report["gdn-packing"].probe.passed, report["gdn-packing"].probe
    ids = torch.randint(2, 128, (1, sum(LENGTHS)), device="cuda")
    with torch.no_grad():
        packed = model(ids, position_ids=packed_position_ids(LENGTHS, device="cuda")).logits
        leaked = unprepared(ids, position_ids=packed_position_ids(LENGTHS, device="cuda")).logits
        alone = torch.cat([model(doc).logits for doc in ids.split(LENGTHS, dim=1)], dim=1)
    assert calls, "the packed forward did not use fla"
    assert rel_diff(packed, alone) <= RTOL
    assert rel_diff(leaked, alone) > LEAK_FLOOR
