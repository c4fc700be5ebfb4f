"""The ``megatron`` trainer backend: megatron-core's ``GPTModel``, optionally with MTP layers.

The engine serves the Hugging Face model; this backend trains the same network as a megatron
``GPTModel`` (local transformer spec, RMSNorm, SwiGLU, RoPE) and converts weights at the
boundary: Hugging Face -> megatron when it loads, megatron -> Hugging Face for every weight sync
and checkpoint (so checkpoints stay in Hugging Face layout). Supported: Llama-architecture models
(``model_type`` ``llama``); other architectures are refused by name.

Megatron runs through the selected hardware backend (on CPU, the cpu backend's megatron fixes)
at world size 1, one document per row (no packed attention without Transformer Engine).

With ``trainer.mtp_num_layers > 0`` the model carries multi-token-prediction layers trained as an
auxiliary loss (``trainer.mtp_loss_coef``). The model is prepared with
:func:`miles_core.patches.prepare_model`, where miles-mtp installs (and verifies) the label
adapter for this megatron-core's convention: the trainer then passes raw ``input_ids`` and the
token-aligned loss mask only -- never labels -- and the adapter shifts, once.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from miles_core.errors import ConfigError
from miles_core.hardware.devices import to_host
from miles_core.rl.algorithms.base import Algorithm
from miles_core.rl.algorithms.batch import PackedRow, TrainDocument
from miles_core.rl.config import TrainConfig
from miles_core.rl.policy_update import UpdateSettings, policy_update
from miles_core.rl.tensor_tree import load_tree, save_tree
from miles_core.rl.trainers.hf import DTYPES, TOKENIZER_FILES

SUPPORTED = ("llama",)


def megatron_config(hf: Any, mtp_layers: int, mtp_coef: float, dtype: torch.dtype) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads, num_query_groups=hf.num_key_value_heads,
        kv_channels=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True,
        mtp_num_layers=mtp_layers or None, mtp_loss_scaling_factor=mtp_coef,
    )


def build_gpt(hf: Any, mtp_layers: int, mtp_coef: float, dtype: torch.dtype) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    config = megatron_config(hf, mtp_layers, mtp_coef, dtype)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if mtp_layers else None
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings, position_embedding_type="rope",
        rotary_base=int(getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]),
        share_embeddings_and_output_weights=hf.tie_word_embeddings, mtp_block_spec=mtp_spec,
    )


def hf_to_megatron(state: dict[str, torch.Tensor], hf: Any) -> dict[str, torch.Tensor]:
    """Hugging Face Llama names and layouts -> megatron GPTModel (local spec)."""
    heads, groups = hf.num_attention_heads, hf.num_key_value_heads
    dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    out = {"embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": state["model.norm.weight"]}
    if not hf.tie_word_embeddings:
        out["output_layer.weight"] = state["lm_head.weight"]
    for i in range(hf.num_hidden_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = state[p + "self_attn.q_proj.weight"].view(groups, heads // groups * dim, -1)
        k = state[p + "self_attn.k_proj.weight"].view(groups, dim, -1)
        v = state[p + "self_attn.v_proj.weight"].view(groups, dim, -1)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])
        out[m + "self_attention.linear_proj.weight"] = state[p + "self_attn.o_proj.weight"]
        out[m + "input_layernorm.weight"] = state[p + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = state[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = state[p + "mlp.down_proj.weight"]
    return out


def megatron_to_hf(state: dict[str, torch.Tensor], hf: Any) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_to_megatron` (MTP layers have no Hugging Face counterpart)."""
    heads, groups = hf.num_attention_heads, hf.num_key_value_heads
    dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    per_group = heads // groups * dim
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"]}
    out["lm_head.weight"] = state["embedding.word_embeddings.weight" if hf.tie_word_embeddings else "output_layer.weight"]
    for i in range(hf.num_hidden_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = state[m + "self_attention.linear_qkv.weight"].view(groups, per_group + 2 * dim, -1)
        out[p + "self_attn.q_proj.weight"] = qkv[:, :per_group].reshape(-1, qkv.shape[-1])
        out[p + "self_attn.k_proj.weight"] = qkv[:, per_group:per_group + dim].reshape(-1, qkv.shape[-1])
        out[p + "self_attn.v_proj.weight"] = qkv[:, per_group + dim:].reshape(-1, qkv.shape[-1])
        out[p + "self_attn.o_proj.weight"] = state[m + "self_attention.linear_proj.weight"]
        out[p + "input_layernorm.weight"] = state[m + "input_layernorm.weight"]
        out[p + "post_attention_layernorm.weight"] = state[m + "pre_mlp_layernorm.weight"]
        gate, up = state[m + "mlp.linear_fc1.weight"].chunk(2)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = state[m + "mlp.linear_fc2.weight"]
    return out


class MegatronTrainer:
    def __init__(self, model_dir: Path, config: TrainConfig, device: torch.device, algorithm: Algorithm) -> None:
        from safetensors.torch import load_file
        from transformers import AutoConfig

        from miles_core.hardware.megatron_state import single_rank_parallel_state
        from miles_core.patches import prepare_model

        self.model_dir = Path(model_dir)
        self.config = config
        self.device = device
        self.hf_config = AutoConfig.from_pretrained(self.model_dir)
        if self.hf_config.model_type not in SUPPORTED:
            raise ConfigError(
                f"trainer.backend = 'megatron' supports {', '.join(SUPPORTED)} models; "
                f"{self.model_dir} is {self.hf_config.model_type!r} (use trainer.backend = 'hf')"
            )
        self._state = contextlib.ExitStack()
        self._state.enter_context(single_rank_parallel_state(seed=config.run.seed))
        dtype = DTYPES[config.model.dtype]
        trainer = config.trainer
        self.mtp_layers = trainer.mtp_num_layers
        self.model = build_gpt(self.hf_config, self.mtp_layers, trainer.mtp_loss_coef, dtype).to(device)
        hf_state = {}
        for shard in sorted(self.model_dir.glob("*.safetensors")):
            hf_state.update(load_file(shard))
        self._load_hf(hf_state)
        patch_report = prepare_model(self.model)
        applied = getattr(patch_report, "applied", {})
        if self.mtp_layers and not any(applied.values()):
            raise ConfigError(
                "trainer.mtp_num_layers > 0 needs the MTP label contract: install miles-mtp "
                "(pip install 'miles[mtp]') and do not list it in MILES_DISABLE_PLUGINS"
            )
        self.model.train()
        self._mtp_rows = 0
        if self.mtp_layers:  # the records are process-wide: what earlier forwards left is not this run's
            from miles_core.hardware.megatron_state import clear_mtp_loss_records

            clear_mtp_loss_records()
        algo = config.algorithm
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=algo.lr, weight_decay=algo.weight_decay)
        # the MTP loss joins the backward inside the forward, per row: every sample laid out
        self.settings = UpdateSettings.from_config(config, algorithm, packing=False,
                                                   merge_duplicates=not self.mtp_layers)
        self.report = {"backend": "megatron", "algorithm": algorithm.name, "mtp_num_layers": self.mtp_layers, "packing": False,
                       "patches": applied, "merge_duplicates": self.settings.merge_duplicates}

    def _load_hf(self, hf_state: dict[str, torch.Tensor]) -> None:
        converted = hf_to_megatron(hf_state, self.hf_config)
        own = self.model.state_dict()
        missing = [k for k in own if k not in converted and not k.startswith("mtp.") and not k.endswith("_extra_state")]
        if missing:
            raise RuntimeError(f"megatron model has weights the Hugging Face checkpoint lacks: {missing[:5]}")
        with torch.no_grad():
            for name, tensor in converted.items():
                own[name].copy_(tensor)

    def _forward(self, row: PackedRow) -> torch.Tensor:
        """Logits ``[T, vocab]`` of one document; with MTP, the MTP loss joins the backward pass."""
        from miles_core.hardware.megatron_state import causal_attention_mask

        ids = row.input_ids[None].to(self.device)
        kwargs: dict[str, Any] = {}
        logits_seen: list[torch.Tensor] = []
        if self.mtp_layers:  # the canonical contract: the adapter derives every label from input_ids
            kwargs = {"loss_mask": row.token_mask()[None].to(self.device)}
            self._mtp_rows += 1
        # cloned: megatron's cross entropy later works on the logits tensor in place
        hook = self.model.output_layer.register_forward_hook(lambda _m, _i, out: logits_seen.append(out[0].clone()))
        try:
            out = self.model(
                input_ids=ids, position_ids=row.position_ids[None].to(self.device),
                attention_mask=causal_attention_mask(ids.shape[1], self.device), **kwargs,
            )
        finally:
            hook.remove()
        if not self.mtp_layers:
            return out[0]
        return logits_seen[-1][:, 0]  # the main head is the last output-layer call: [s, 1, v] -> [s, v]

    def train(self, docs: Sequence[TrainDocument]) -> dict[str, float]:
        stats = policy_update(docs, self._forward, self.optimizer, self.model.parameters(), self.settings)
        if self.mtp_layers:
            stats.update(self._mtp_losses())
        return stats

    def _mtp_losses(self) -> dict[str, float]:
        from miles_core.hardware.megatron_state import clear_mtp_loss_records, mtp_loss_sums

        values = mtp_loss_sums()
        rows, self._mtp_rows = self._mtp_rows, 0
        if not rows:
            return {}
        if values is None:
            raise RuntimeError(f"megatron-core recorded no MTP losses for the step's {rows} MTP rows")
        out = {f"mtp_loss_depth{depth + 1}": float(value) / rows for depth, value in enumerate(values.tolist())}
        clear_mtp_loss_records()
        return out

    def engine_weights(self) -> dict[str, torch.Tensor]:
        state = {k: v.detach() for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        return megatron_to_hf(state, self.hf_config)

    def save(self, directory: Path) -> None:
        from safetensors.torch import save_file

        target = directory / "model"
        target.mkdir(parents=True, exist_ok=True)
        weights = {k: v.contiguous() for k, v in to_host(self.engine_weights()).items()}
        if self.hf_config.tie_word_embeddings:
            weights.pop("lm_head.weight")
        save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
        self.hf_config.save_pretrained(target)
        for name in TOKENIZER_FILES:
            if (self.model_dir / name).exists():
                shutil.copy2(self.model_dir / name, target / name)
        save_tree(directory / "optimizer", {
            "optimizer": self.optimizer.state_dict(),
            "mtp": {k: v for k, v in self.model.state_dict().items() if k.startswith("mtp.")},
        })
        (directory / "megatron.json").write_text(json.dumps(self.report))

    def load(self, directory: Path) -> None:
        from safetensors.torch import load_file

        self._load_hf(load_file(directory / "model" / "model.safetensors"))
        saved = load_tree(directory / "optimizer")
        with torch.no_grad():
            own = self.model.state_dict()
            for name, tensor in saved["mtp"].items():
                own[name].copy_(tensor)
        self.optimizer.load_state_dict(saved["optimizer"])

    def close(self) -> None:
        self._state.close()
