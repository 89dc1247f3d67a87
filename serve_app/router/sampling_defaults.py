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

import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger("pd_serve.router")

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
    serving ``model`` would apply; empty when the model sets none, or when its generation config
    cannot be read here (a directory only the engines' nodes have, a repository while offline):
    then the router says so and serves with vLLM's neutral defaults rather than not at all."""
    source = engine_kwargs.get("generation_config") or "auto"
    config: dict[str, Any] = {}
    if source != "vllm":
        from vllm.transformers_utils.config import try_get_generation_config

        where = (engine_kwargs.get("hf_config_path") or model) if source == "auto" else source
        try:
            found = try_get_generation_config(
                where,
                trust_remote_code=bool(engine_kwargs.get("trust_remote_code", False)),
                revision=engine_kwargs.get("revision") if source == "auto" else None,
            )
        except Exception as exc:  # vLLM catches only OSError; a bad path is a ValueError
            logger.warning("the model's generation config at %s could not be read (%s): no sampling defaults", where, exc)
            found = None
        config = found.to_diff_dict() if found is not None else {}
    config.update(engine_kwargs.get("override_generation_config") or {})
    defaults = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults


def max_tokens_cap(engine_kwargs: Mapping[str, Any], defaults: Mapping[str, Any]) -> int | None:
    """The bound vLLM's server puts on every request's max_tokens, even one the client sent: the
    defaults' max_tokens when ``generation_config`` names a directory, else
    ``override_generation_config``'s max_new_tokens (None: no bound)."""
    source = engine_kwargs.get("generation_config") or "auto"
    if source not in ("auto", "vllm"):
        cap = defaults.get("max_tokens")
    else:
        cap = (engine_kwargs.get("override_generation_config") or {}).get("max_new_tokens")
    return int(cap) if cap is not None else None
