"""Gated DeltaNet packing: what keeping packed documents apart costs, and what packing buys.

``--device cpu`` (default): a small Qwen3.5-architecture model, float32, one packed row of
documents. Forward+backward of the model prepared by miles-qwen35 (pure-torch variable-length
kernels) against the same weights unprepared (transformers' boundary-blind fallback, which mixes
the documents), interleaved; and the two GDN kernels alone on the same row. Headline ``ratio``:
prepared / unprepared step time (target <= 1.5).

``--device cuda``: a ~0.5B Qwen3.5-architecture model in bf16 with fla. Training steps
(forward+backward) on 8 documents of 64-4096 tokens, packed into one row vs padded to
``[8, 4096]`` and run in micro-batches of ``--padded-rows`` rows with the gradients accumulated
(default: as many rows as the packed row's tokens fill, so both sides hold about the same
activations; all 8 rows at once need ~95 GB); headline ``ratio``: packed / padded real tokens
per second (target >= 2.4), with MFU (6 * parameters * tokens / time against the measured bf16 matmul rate) and the max diff
between packed and per-document logits (with and without the packing context; bf16, and fp32
with ``--fp32-diffs``). ``--attention sdpa`` and ``--compile`` measure the two speed-ups alone; ``--mix-copies K``
packs the length mix K times into the row (a trainer's ``max_tokens_per_row`` of ~10k x K), which
spreads the step's fixed host cost over more tokens.

Prints one JSON line. ``--smoke`` runs the chosen part on a tiny model (checks the script, not
the numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import torch

from miles_core.patches import prepare_model
from miles_core.patches.packing import packed_position_ids
from miles_core.rl.trainers.compile import compile_regions
from miles_core.testing import isolated_plugin_manager

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: H200 dense bf16 matmul rate measured on the lent machines (8192^3 products, random data)
PEAK_BF16_FLOPS = 790e12
GPU_LENGTHS = [4096, 2048, 1536, 1024, 640, 384, 256, 64]
CPU_LENGTHS = [256, 64, 512, 128, 64]

CPU_MODEL: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
)
GPU_MODEL: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_value_heads=16,
    linear_num_key_heads=8,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
)
SMOKE_MODEL: dict[str, Any] = dict(CPU_MODEL, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   layer_types=["linear_attention", "full_attention"], head_dim=16,
                                   linear_key_head_dim=8, linear_value_head_dim=8)


class Batch(TypedDict):
    """A training batch, the model's keyword arguments: packed (``position_ids``) or padded
    (``attention_mask``)."""

    input_ids: torch.Tensor
    position_ids: NotRequired[torch.Tensor]
    attention_mask: NotRequired[torch.Tensor]
    labels: torch.Tensor
    use_cache: bool


def build_model(overrides: dict[str, Any], device: str = "cpu") -> PreTrainedModel:
    """A Qwen3.5-architecture causal LM with random weights (the same for every call)."""
    from miles_qwen35.tiny import tiny_config
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(tiny_config("qwen3_5", **overrides)).float()


def median_times(steps: dict[str, Callable[[], None]], iters: int, warmup: int, sync: Callable[[], None]) -> dict[str, float]:
    """Median seconds per call of each step, the steps interleaved so drift hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(warmup + iters):
        for name, step in steps.items():
            sync()
            start = time.perf_counter()
            step()
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def packed_batch(lengths: list[int], vocab: int, device: str, generator: torch.Generator) -> Batch:
    """One row, position ids restarting per document, no label across a boundary."""
    ids = torch.randint(2, vocab, (1, sum(lengths)), generator=generator).to(device)
    position_ids = packed_position_ids(lengths, device=device)
    labels = ids.clone()
    labels[position_ids == 0] = -100
    return {"input_ids": ids, "position_ids": position_ids, "labels": labels, "use_cache": False}


def padded_batch(packed: Batch, lengths: list[int]) -> Batch:
    """The same documents, one per row, right-padded to the longest."""
    width = max(lengths)
    ids = packed["input_ids"].new_zeros(len(lengths), width)
    mask = torch.zeros_like(ids)
    for row, doc in enumerate(packed["input_ids"][0].split(lengths)):
        ids[row, : len(doc)] = doc
        mask[row, : len(doc)] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False}


def train_step(model: torch.nn.Module, batch: Batch, rows_per_forward: int | None = None
               ) -> Callable[[], None]:
    """One optimizer step's gradients of ``batch``, its rows ``rows_per_forward`` at a time (all at
    once by default): each micro-batch's loss is its label tokens' sum over the whole batch's count
    (``num_items_in_batch``), so the accumulated gradient is the whole batch's mean."""
    rows = batch["input_ids"].shape[0]
    per = rows if rows_per_forward is None else rows_per_forward
    labelled = int((batch["labels"][:, 1:] != -100).sum())
    parts = [{k: v[i:i + per] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
             for i in range(0, rows, per)]

    def step() -> None:
        model.zero_grad(set_to_none=True)
        for part in parts:
            model(**part, num_items_in_batch=labelled).loss.backward()

    return step


@torch.no_grad()
def per_document_diffs(model: torch.nn.Module, unprepared: torch.nn.Module, batch: Batch,
                       lengths: list[int]) -> dict[str, float]:
    """Max |packed - alone| over all documents' logits, with the packing context (``model``, prepared)
    and without it (``unprepared``: the same weights, no packing scope anywhere -- every entry point
    of a prepared model, its backbone included, opens the scope)."""
    ids, position_ids = batch["input_ids"], batch["position_ids"]
    packed = model(ids, position_ids=position_ids, use_cache=False).logits[0]
    leaking = unprepared(ids, position_ids=position_ids, use_cache=False).logits[0]
    alone = torch.cat([model(doc).logits[0] for doc in ids.split(lengths, dim=1)])
    return {
        "max_diff": (packed - alone).abs().max().item(),
        "max_diff_without_context": (leaking - alone).abs().max().item(),
        "logit_scale": alone.abs().max().item(),
    }


def gdn_kernel_times(lengths: list[int], iters: int, warmup: int) -> dict[str, float]:
    """The two GDN kernels, forward+backward, on one packed row: variable-length vs transformers'."""
    from miles_qwen35 import torch_varlen
    from transformers.models.qwen3_5 import modeling_qwen3_5 as reference

    gen = torch.Generator().manual_seed(0)
    total, heads_k, heads_v, dim, conv_dim, width = sum(lengths), 2, 4, 32, 256, 4
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).view(1, -1)

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    q, k = leaf(1, total, heads_k, dim), leaf(1, total, heads_k, dim)
    v = leaf(1, total, heads_v, dim)
    g = (-torch.rand(1, total, heads_v, generator=gen)).requires_grad_()
    beta = torch.rand(1, total, heads_v, generator=gen).requires_grad_()
    x, w = leaf(1, conv_dim, total), leaf(conv_dim, width, scale=0.5)

    def varlen() -> None:
        out = torch_varlen.chunk_gated_delta_rule(q, k, v, g, beta, seq_idx, use_qk_l2norm_in_kernel=True)
        conv = torch_varlen.causal_conv1d(x, w, None, "silu", seq_idx)
        (out.sum() + conv.sum()).backward()

    def leaking() -> None:
        out, _ = reference.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        conv = reference.causal_conv1d_fn(x, w, None, activation="silu")
        (out.sum() + conv.sum()).backward()

    return median_times({"varlen": varlen, "leaking": leaking}, iters, warmup, lambda: None)


def cpu_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    overrides = SMOKE_MODEL if args.smoke else CPU_MODEL
    lengths = [n // 8 for n in CPU_LENGTHS] if args.smoke else CPU_LENGTHS
    prepared, unprepared = build_model(overrides), build_model(overrides)
    report = prepare_model(prepared)
    batch = packed_batch(lengths, overrides["vocab_size"], "cpu", torch.Generator().manual_seed(1))
    steps = {"varlen": train_step(prepared, batch), "leaking": train_step(unprepared, batch)}
    model_times = median_times(steps, args.iters, args.warmup, lambda: None)
    kernel_times = gdn_kernel_times(lengths, args.iters, args.warmup)
    diffs = per_document_diffs(prepared.eval(), unprepared.eval(), batch, lengths)
    return {
        "benchmark": "gdn_packing",
        "device": "cpu",
        "ratio": model_times["varlen"] / model_times["leaking"],
        "target": "<= 1.5",
        "kernel_ratio": kernel_times["varlen"] / kernel_times["leaking"],
        "step_ms": {k: round(v * 1e3, 2) for k, v in model_times.items()},
        "kernel_ms": {k: round(v * 1e3, 2) for k, v in kernel_times.items()},
        "lengths": lengths,
        "parameters": sum(p.numel() for p in prepared.parameters()),
        **diffs,
        "patched": report.applied,
        "smoke": args.smoke,
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def cuda_benchmark(args: argparse.Namespace, device: str = "cuda") -> dict[str, Any]:
    overrides = SMOKE_MODEL if args.smoke else GPU_MODEL
    lengths = [n // 32 for n in GPU_LENGTHS] if args.smoke else GPU_LENGTHS
    lengths = lengths * args.mix_copies
    # transformers decorates to() with functools.wraps(Module.to), which types it as the unbound method
    model: PreTrainedModel = build_model(overrides, device).to(torch.bfloat16)  # type: ignore[arg-type]
    report = prepare_model(model)
    if args.attention == "sdpa":
        model.set_attn_implementation("sdpa")  # transformers' dense block-diagonal mask
    params = sum(p.numel() for p in model.parameters())
    packed = packed_batch(lengths, overrides["vocab_size"], device, torch.Generator().manual_seed(1))
    padded = padded_batch(packed, lengths)
    # before compiling: eval-mode forwards of new shapes would recompile the compiled regions
    unprepared = build_model(overrides, device).to(torch.bfloat16)  # type: ignore[arg-type]  # the same weights
    diffs_bf16 = per_document_diffs(model.eval(), unprepared.eval(), packed, lengths)
    del unprepared
    model.train()
    compiled = compile_regions(model) if args.compile else []
    padded_rows = args.padded_rows or max(1, sum(lengths) // max(lengths))
    steps = {"packed": train_step(model, packed), "padded": train_step(model, padded, padded_rows)}
    times = median_times(steps, args.iters, args.warmup, torch.cuda.synchronize)
    profiles = {name: profile_step(step) for name, step in steps.items()}
    busy = {name: gpu_busy_seconds(prof) for name, prof in profiles.items()}
    if args.profile:  # the kernels that take the packed step's GPU time
        table = profiles["packed"].key_averages().table(sort_by="self_device_time_total", row_limit=25)
        print(table, file=sys.stderr)
    model.zero_grad(set_to_none=True)
    tokens = sum(lengths)
    tps = {name: tokens / t for name, t in times.items()}
    # fp32 doubles fla's first-use kernel compilation (minutes); the GPU tests check fp32 equality
    diffs_fp32 = None
    if args.fp32_diffs:
        fp32_model = build_model(overrides, device)  # the same weights, uncompiled, in fp32
        prepare_model(fp32_model)
        diffs_fp32 = per_document_diffs(fp32_model.eval(), build_model(overrides, device).eval(), packed, lengths)
    return {
        "benchmark": "gdn_packing",
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "ratio": tps["packed"] / tps["padded"],
        "target": ">= 2.4 (packed/padded tokens/s), MFU >= 0.25",
        "tokens_per_s": {k: round(v) for k, v in tps.items()},
        "padded_rows_per_forward": padded_rows,
        "step_ms": {k: round(v * 1e3, 1) for k, v in times.items()},
        # kernel time of one step: well below step_ms means the host (Python, launches) is the limit
        "gpu_busy_ms": {k: round(v * 1e3, 1) for k, v in busy.items()},
        "mfu": {k: round(6 * params * v / PEAK_BF16_FLOPS, 4) for k, v in tps.items()},
        "parameters": params,
        "real_tokens": tokens,
        "lengths": lengths,
        "diff_bf16": diffs_bf16,
        "diff_fp32": diffs_fp32,
        "attention": model.config._attn_implementation,
        "compiled": compiled,
        "kernels": dict(report["gdn-packing"].kernels),
        "patched": report.applied,
        "versions": _versions(),
        "smoke": args.smoke,
    }


def profile_step(step: Callable[[], None]) -> Any:
    """One call of ``step`` under torch.profiler (host and GPU activity)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return prof


def gpu_busy_seconds(prof: Any) -> float:
    """The summed duration of the GPU kernels a profiled step ran."""
    return sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type.name == "CUDA") / 1e6


def _versions() -> dict[str, str]:
    from importlib import metadata

    out: dict[str, str] = {"torch": torch.__version__}
    for dist in ("transformers", "flash-linear-attention", "triton", "tilelang"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="which part to run")
    parser.add_argument("--iters", type=int, default=8, help="timed repetitions per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    parser.add_argument("--attention", choices=["packed", "sdpa"], default="packed",
                        help="GPU: per-document packed attention (what prepare_model sets) or transformers' masked sdpa")
    parser.add_argument("--mix-copies", type=int, default=1,
                        help="GPU: pack the 64-4096 length mix this many times into the row (padded: as many rows)")
    parser.add_argument("--padded-rows", type=int, default=0,
                        help="GPU: padded rows per forward (default: as many as the packed row's tokens fill)")
    parser.add_argument("--compile", action="store_true", help="GPU: torch.compile norms and MLPs (trainer.compile)")
    parser.add_argument("--fp32-diffs", action="store_true", help="GPU: also compare packed and per-document logits in fp32")
    parser.add_argument("--profile", action="store_true", help="GPU: print one packed step's kernel times to stderr")
    parser.add_argument("--smoke", action="store_true", help="tiny model: check the script, not the numbers")
    args = parser.parse_args()
    import miles_qwen35.plugin

    # builtins: on a GPU the packed attention asks the active hardware backend (core-hardware's cuda)
    # what the device supports
    with isolated_plugin_manager([("miles-qwen35", miles_qwen35.plugin)], builtins=True):
        result = cpu_benchmark(args) if args.device == "cpu" else cuda_benchmark(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
