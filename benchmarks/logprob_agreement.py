"""Where the train/rollout log-prob mismatch comes from (a diagnostic for issue 16's agreement target).

The engine samples ``--requests`` completions; the same tokens are then scored by the trainer's
model (transformers, prepared as the hf trainer prepares it) four ways: each sequence alone, all of
them packed into one row (the trainer's layout), alone with the LM head in fp32, and alone by an
fp32 copy of the model (the reference). Prints one JSON line: mean and max |delta log p| for each
pair. If two valid bf16 computations of the trainer (alone vs packed) already differ by about as
much as the engine and the trainer do, the gap is bf16 itself, not a kernel disagreement.

    python benchmarks/logprob_agreement.py --preset small-gpu --device cuda
    python benchmarks/logprob_agreement.py --preset tiny --device cpu --requests 4
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import torch

from miles_core.engine.base import GenerationRequest, SamplingParams
from miles_core.engine.engine import Engine, EngineConfig
from miles_core.engine.presets import preset_dir
from miles_core.patches import prepare_model
from miles_core.rl.trainers.hf import load_causal_lm

Sequences = list[tuple[list[int], list[int]]]


def score_alone(model: Any, seqs: Sequences, device: torch.device, fp32_head: bool = False) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for prompt, completion in seqs:
            ids = torch.tensor([prompt + completion], device=device)
            if fp32_head:
                hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
                logits = torch.nn.functional.linear(hidden.float(), model.lm_head.weight.float())
            else:
                logits = model(input_ids=ids, use_cache=False).logits[0].float()
            out.append(_gather(logits[len(prompt) - 1 : -1], completion, device))
    return out


def score_packed(model: Any, seqs: Sequences, device: torch.device) -> list[torch.Tensor]:
    ids = torch.tensor([list(itertools.chain.from_iterable(p + c for p, c in seqs))], device=device)
    positions = torch.tensor([list(itertools.chain.from_iterable(range(len(p) + len(c)) for p, c in seqs))],
                             device=device)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0].float()
    out, offset = [], 0
    for prompt, completion in seqs:
        start = offset + len(prompt) - 1
        out.append(_gather(logits[start : start + len(completion)], completion, device))
        offset += len(prompt) + len(completion)
    return out


def _gather(logits: torch.Tensor, tokens: list[int], device: torch.device) -> torch.Tensor:
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens, device=device)[:, None])[:, 0].cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-gpu")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    device = torch.device(args.device)
    path = preset_dir(args.preset)
    generator = torch.Generator().manual_seed(0)
    requests = [
        GenerationRequest([int(t) for t in torch.randint(5, 60, (6 + i % 5,), generator=generator)],
                          SamplingParams(max_tokens=args.new_tokens, seed=i, ignore_eos=True))
        for i in range(args.requests)
    ]
    config = EngineConfig(max_batch_size=args.requests, dtype=args.dtype, device=device.type)
    with Engine.from_pretrained(path, config) as engine:
        completions = engine.generate(requests)
    seqs = [(list(r.input_ids), list(c.token_ids)) for r, c in zip(requests, completions)]
    scores = {"engine": [torch.tensor(c.logprobs) for c in completions]}
    model = load_causal_lm(path, args.dtype, device)
    prepare_model(model, packed=True)
    scores["trainer_alone"] = score_alone(model, seqs, device)
    scores["trainer_packed"] = score_packed(model, seqs, device)
    scores["trainer_fp32_head"] = score_alone(model, seqs, device, fp32_head=True)
    del model
    reference = load_causal_lm(path, "float32", device)
    prepare_model(reference, packed=True)
    scores["fp32"] = score_alone(reference, seqs, device)

    def delta(a: str, b: str) -> dict[str, float]:
        diff = torch.cat([(x - y).abs() for x, y in zip(scores[a], scores[b])])
        return {"mean": round(float(diff.mean()), 6), "max": round(float(diff.max()), 5)}

    pairs = [("engine", "trainer_packed"), ("engine", "trainer_alone"), ("trainer_alone", "trainer_packed"),
             ("engine", "fp32"), ("trainer_packed", "fp32"), ("trainer_alone", "fp32"),
             ("trainer_fp32_head", "fp32"), ("engine", "trainer_fp32_head")]
    print(json.dumps({"preset": args.preset, "device": args.device, "dtype": args.dtype, "requests": args.requests,
                      "new_tokens": args.new_tokens, **{f"{a}~{b}": delta(a, b) for a, b in pairs}}))


if __name__ == "__main__":
    main()
