"""``miles engine serve|presets|build-preset``."""

from __future__ import annotations

from pathlib import Path

import click

from miles_core.cli._output import emit_json
from miles_core.engine.base import require_model_dir
from miles_core.engine.presets import PRESETS
from miles_core.errors import ConfigError


@click.group()
def engine() -> None:
    """Serve the embedded inference engine (SGLang-compatible HTTP) and manage model presets."""


@engine.command("serve")
@click.option("--model", "model_path", type=click.Path(file_okay=False), help="Hugging Face model directory (config.json, *.safetensors, tokenizer files).")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), help="Serve a preset built by code in miles instead of --model (see `miles engine presets`).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on.")
@click.option("--port", default=30000, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on (0 picks a free one; the URL is printed).")
@click.option("--max-batch-size", default=64, show_default=True, type=click.IntRange(min=1), help="Sequences decoded together; further requests wait.")
@click.option("--max-model-len", type=click.IntRange(min=2), help="Longest prompt + completion in tokens [default: the model's max_position_embeddings].")
@click.option("--max-tokens", "default_max_tokens", default=256, show_default=True, type=click.IntRange(min=1), help="Completion length for requests that set no max_tokens.")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "float32", "bfloat16", "float16"]), help="Weights and activations dtype ('auto': as saved).")
@click.option("--device", default="auto", show_default=True, help="'auto' (CUDA if available), 'cpu', 'cuda' or 'cuda:N'.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seeds the per-request seeds of requests that bring none.")
@click.option("--weight-version", default="0", show_default=True, help="Weight version reported until the first weight update.")
@click.option("--served-model-name", help="Model name in responses and /v1/models [default: the directory or preset name].")
@click.option("--gdn-state-dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16"]), help="Storage of the Gated DeltaNet recurrent states: bfloat16 halves their memory and most of a decode step's traffic, at one rounding of each state per token (see docs/engine.md).")
@click.option("--cpu-threads", default=1, show_default=True, type=click.IntRange(min=1), help="torch intra-op threads when serving on CPU.")
@click.option("--log-level", default="warning", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]), help="uvicorn log level.")
def serve(
    model_path: str | None,
    preset: str | None,
    host: str,
    port: int,
    max_batch_size: int,
    max_model_len: int | None,
    default_max_tokens: int,
    dtype: str,
    device: str,
    seed: int,
    weight_version: str,
    served_model_name: str | None,
    gdn_state_dtype: str,
    cpu_threads: int,
    log_level: str,
) -> None:
    """Serve a model over HTTP until interrupted (SIGINT/SIGTERM).

    Routes: POST /v1/chat/completions (input_ids or messages; choices[0].meta_info carries
    output_token_logprobs and weight_version), GET /health, POST /update_weights_from_disk.
    Prints one line with the URL once listening.
    """
    if (model_path is None) == (preset is None):
        raise ConfigError("give exactly one of --model DIR or --preset NAME")
    if model_path is not None:
        require_model_dir(model_path)  # before the heavy imports: bad input fails fast
    from miles_core.engine.engine import Engine, EngineConfig
    from miles_core.engine.presets import preset_dir
    from miles_core.engine.server import EmbeddedServer

    config = EngineConfig(
        max_batch_size=max_batch_size, max_model_len=max_model_len, dtype=dtype, device=device,
        seed=seed, weight_version=weight_version, cpu_threads=cpu_threads, gdn_state_dtype=gdn_state_dtype,
    )
    if preset is not None:
        path: str | Path = preset_dir(preset)
        default_name = preset
    else:
        assert model_path is not None  # exactly one of the two: checked above
        path, default_name = model_path, click.format_filename(model_path).rstrip("/").rsplit("/", 1)[-1]
    name = served_model_name or default_name
    model = Engine.from_pretrained(path, config, name=name)
    server = EmbeddedServer(model, host=host, port=port, default_max_tokens=default_max_tokens, log_level=log_level)
    click.echo(f"miles engine: serving {name} at {server.base_url} (weight_version {model.weight_version})", err=False)
    server.serve_forever()


@engine.command("presets")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document instead of text.")
def presets(as_json: bool) -> None:
    """List the model presets (built by code in miles, no downloads)."""
    rows = [{"name": p.name, "description": p.description, "dtype": p.dtype, "device": p.device} for p in PRESETS.values()]
    if as_json:
        emit_json({"presets": rows})
        return
    for row in rows:
        click.echo(f"{row['name']:<10} {row['device']:<5} {row['dtype']:<9} {row['description']}")


@engine.command("build-preset")
@click.argument("name", type=click.Choice(sorted(PRESETS)))
@click.option("--cache-dir", type=click.Path(file_okay=False), help="Cache root [default: $MILES_CACHE_DIR, else $XDG_CACHE_HOME/miles or ~/.cache/miles].")
def build_preset(name: str, cache_dir: str | None) -> None:
    """Build preset NAME once (Hugging Face layout) and print its directory."""
    from miles_core.engine.presets import preset_dir

    click.echo(str(preset_dir(name, cache_dir)))
