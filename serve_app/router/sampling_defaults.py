"""The model's default sampling parameters, which vLLM's OpenAI server applies to every request
that leaves them out.

vLLM reads them from the model's ``generation_config.json`` (engine argument
``generation_config``: ``auto``, the default; ``vllm`` for its neutral defaults; or a directory)
with ``override_generation_config`` on top (``ModelConfig.get_diff_sampling_param``). The router
builds every request's ``SamplingParams`` itself, so it reads the same sources, with the decode
engine's arguments (decode samples every token): a request without ``temperature`` to a model
whose generation config says 0.6 samples at 0.6, as it would on vLLM's server.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# The generation-config fields vLLM's server takes as sampling defaults (HF's max_new_tokens is
# vLLM's max_tokens).
SAMPLING_FIELDS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)


def model_sampling_defaults(model: str, engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults a vLLM engine of ``engine_kwargs`` (the decode engine's merged arguments)
    serving ``model`` would apply; empty when the model sets none."""
    source = engine_kwargs.get("generation_config") or "auto"
    config: dict[str, Any] = {}
    if source != "vllm":
        from vllm.transformers_utils.config import try_get_generation_config

        found = try_get_generation_config(
            model if source == "auto" else source,
            trust_remote_code=bool(engine_kwargs.get("trust_remote_code", False)),
            revision=engine_kwargs.get("revision"),
        )
        config = found.to_diff_dict() if found is not None else {}
    config.update(engine_kwargs.get("override_generation_config") or {})
    defaults = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults
