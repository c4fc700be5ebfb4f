"""One update on a tiny model: what every trainer backend's ``verify()`` checks.

The model is the character-level 2-layer Llama of :mod:`miles_core.assets.char_model`, written to
a scratch directory. Two documents share the prompt ``"2+3="``; one answers ``"5"`` with advantage
+1, the other ``"7"`` with advantage -1, and both carry the model's own log-probs as rollout
log-probs (ratio 1). After one GRPO update (learning rate :data:`LR`, no KL, one minibatch), the
weights the trainer hands the engine, loaded into the Hugging Face model, must give ``"5"`` a
higher and ``"7"`` a lower log-prob than before: the update went in the direction the advantages
say, and it reached the weights the engine serves.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miles_core.rl.trainers.base import TrainerBackend

PROMPT, REWARDED, UNREWARDED = "2+3=", "5", "7"
LR = 1e-2


def check_one_update(backend: TrainerBackend, device: str = "cpu") -> dict[str, float]:
    """Raise ``AssertionError`` unless one update moves the log-probs as documented above;
    returns the log-prob changes (``rewarded``, ``unrewarded``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles_core.assets.char_model import build_char_tokenizer, write_char_model
    from miles_core.assets.tokens import token_id
    from miles_core.rl.algorithms.batch import TrainDocument
    from miles_core.rl.algorithms.builtin import GRPO
    from miles_core.rl.config import TrainConfig

    tokenizer = build_char_tokenizer()
    prompt = list(tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    answers = [token_id(tokenizer, a) for a in (REWARDED, UNREWARDED)]
    with tempfile.TemporaryDirectory(prefix="miles-trainer-probe-") as tmp, torch.random.fork_rng(devices=[]):
        model_dir = write_char_model(Path(tmp) / "model", seed=0)
        reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()

        def answer_logprobs() -> list[float]:
            with torch.no_grad():
                logits = reference(input_ids=torch.tensor([prompt])).logits[0, -1].float()
            logp = logits.log_softmax(-1)
            return [float(logp[a]) for a in answers]

        before = answer_logprobs()
        config = TrainConfig.model_validate({
            "model": {"path": str(model_dir)},
            "trainer": {"backend": backend.name, "device": device},
            "algorithm": {"lr": LR, "kl_coef": 0.0},
            "run": {"seed": 0},
        })
        docs = [
            TrainDocument((*prompt, answer), 1, (1,), (logp,), advantage)
            for answer, logp, advantage in zip(answers, before, (1.0, -1.0))
        ]
        trainer = backend.create(model_dir, config, torch.device(device), GRPO())
        try:
            trainer.train(docs)
            weights = trainer.engine_weights()
        finally:
            trainer.close()
        if not isinstance(weights, dict):
            raise AssertionError(f"engine_weights() returned {type(weights).__name__}, not a name -> tensor dict")
        missing, unexpected = reference.load_state_dict({k: v.cpu() for k, v in weights.items()}, strict=False)
        missing = [k for k in missing if k not in set(getattr(reference, "_tied_weights_keys", None) or [])]
        if missing or unexpected:
            raise AssertionError(
                f"engine_weights() do not name the Hugging Face model's weights: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
        after = answer_logprobs()
    change = {"rewarded": after[0] - before[0], "unrewarded": after[1] - before[1]}
    if not (change["rewarded"] > 0 and change["unrewarded"] < 0):
        raise AssertionError(
            f"one update with advantages +1 ({REWARDED!r}) / -1 ({UNREWARDED!r}) changed their log-probs by "
            f"{change['rewarded']:+.3g} / {change['unrewarded']:+.3g}; expected up / down"
        )
    return change
