"""MTP learning on CPU: depth-1 loss through the label contract vs a deliberately double-shifted run.

A tiny megatron-core GPTModel with MTP (built through the cpu hardware backend) trains on
arithmetic sequences (miles_mtp.experiment). Both runs start from the same seed; both are
evaluated on the same held-out batch against the contract's targets (tokens[i + 2] at depth 1).
Prints one JSON line; the headline is ``ratio``: the correct run's final depth-1 loss over the
double-shifted run's (lower is better; the control should not learn depth 1 at all).

    python benchmarks/mtp_learning.py [--steps 300] [--seed 0] [--mtp-num-layers 1]
"""

from __future__ import annotations

import argparse
import json
import warnings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--seed", type=int, default=0, help="seed of both runs")
    parser.add_argument("--mtp-num-layers", type=int, default=1, help="MTP depths of the model")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # two threads stall intermittently on the 2-core machines
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    from miles_mtp.experiment import learning_run

    from miles_core.hardware.megatron_state import single_rank_parallel_state

    runs = {}
    for name, extra_shift in (("correct", False), ("double_shift", True)):
        with single_rank_parallel_state(seed=args.seed) as hw:
            runs[name] = learning_run(
                args.steps,
                extra_shift=extra_shift,
                seed=args.seed,
                mtp_num_layers=args.mtp_num_layers,
                device=hw.device,
            ).to_dict()
    correct = runs["correct"]["final"]["mtp_losses"][0]
    control = runs["double_shift"]["final"]["mtp_losses"][0]
    print(json.dumps({"benchmark": "mtp_learning", "ratio": correct / control, **runs}))


if __name__ == "__main__":
    main()
