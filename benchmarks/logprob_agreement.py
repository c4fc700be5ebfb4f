"""Where the train/rollout log-prob mismatch comes from (a diagnostic for issue 16's agreement target).

The engine samples ``--requests`` completions; the trainer's own forward (the hf trainer's
``target_logits`` over rows from ``pack_documents``, log-probs by ``token_logprobs``) then scores the
same tokens with the model prepared as the trainer prepares it, once with each document in a row of
its own and once packed as training packs them, and an fp32 copy of the model scores them alone as
the reference. Prints one JSON line: mean and max |delta log p| for each pair. If two valid bf16
computations of the trainer (alone vs packed) differ by about as much as the engine and the trainer
do, the gap is bf16 itself, not a disagreement between the engine's kernels and the trainer's.

    python benchmarks/logprob_agreement.py --preset small-gpu --device cuda
    python benchmarks/logprob_agreement.py --preset tiny --device cpu --requests 4
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from miles_core.engine.base import GenerationRequest, SamplingParams
from miles_core.engine.engine import Engine, EngineConfig
from miles_core.engine.presets import preset_dir
from miles_core.patches import prepare_model
from miles_core.rl.algorithms.batch import TrainDocument, pack_documents
from miles_core.rl.algorithms.losses import token_logprobs
from miles_core.rl.trainers.hf import load_causal_lm, row_inputs, target_logits


def score(path: Path, dtype: str, device: torch.device, docs: Sequence[TrainDocument], max_tokens_per_row: int,
          layouts: Sequence[bool]) -> list[torch.Tensor]:
    """The trainer's log-prob of every response token, in document order, for each layout
    (``packing`` as :func:`pack_documents` takes it)."""
    model = load_causal_lm(path, dtype, device)
    prepare_model(model, packed=True)
    out = []
    with torch.no_grad():
        for packing in layouts:
            logprobs, owners = [], []
            for row in pack_documents(docs, max_tokens_per_row, packing=packing):
                logits = target_logits(model, row_inputs(row, device))
                logprobs.append(token_logprobs(logits, row.targets.to(device)).cpu())
                owners.append(row.advantages)  # each document's index (see main)
            # a stable sort by document restores document order, each document's tokens in order
            order = torch.cat(owners).argsort(stable=True)
            out.append(torch.cat(logprobs)[order])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-gpu")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gdn-state-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="storage of the engine's GDN recurrent states")
    parser.add_argument("--max-tokens-per-row", type=int, default=8192, help="the trainer's row length (small-gpu's)")
    args = parser.parse_args()
    device = torch.device(args.device)
    path = preset_dir(args.preset)
    generator = torch.Generator().manual_seed(0)
    requests = [
        GenerationRequest([int(t) for t in torch.randint(5, 60, (6 + i % 5,), generator=generator)],
                          SamplingParams(max_tokens=args.new_tokens, seed=i, ignore_eos=True))
        for i in range(args.requests)
    ]
    config = EngineConfig(max_batch_size=args.requests, dtype=args.dtype, device=device.type,
                          gdn_state_dtype=args.gdn_state_dtype)
    with Engine.from_pretrained(path, config) as engine:
        completions = engine.generate(requests)
    # scoring needs no advantage: it carries the document's index through packing instead
    docs = [
        TrainDocument((*r.input_ids, *c.token_ids), len(c.token_ids), (1,) * len(c.token_ids), c.logprobs, float(i))
        for i, (r, c) in enumerate(zip(requests, completions))
    ]
    scores = {"engine": torch.tensor([lp for c in completions for lp in c.logprobs])}
    scores["trainer_alone"], scores["trainer_packed"] = score(path, args.dtype, device, docs, args.max_tokens_per_row,
                                                              layouts=(False, True))
    (scores["fp32"],) = score(path, "float32", device, docs, args.max_tokens_per_row, layouts=(False,))

    def delta(a: str, b: str) -> dict[str, float]:
        diff = (scores[a] - scores[b]).abs()
        return {"mean": float(f"{float(diff.mean()):.3g}"), "max": float(f"{float(diff.max()):.3g}")}

    pairs = [("engine", "trainer_packed"), ("engine", "trainer_alone"), ("trainer_alone", "trainer_packed"),
             ("engine", "fp32"), ("trainer_packed", "fp32"), ("trainer_alone", "fp32")]
    print(json.dumps({"preset": args.preset, "device": args.device, "dtype": args.dtype,
                      "gdn_state_dtype": args.gdn_state_dtype, "requests": args.requests,
                      "new_tokens": args.new_tokens, **{f"{a}~{b}": delta(a, b) for a, b in pairs}}))


if __name__ == "__main__":
    main()
