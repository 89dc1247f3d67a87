"""vLLM's own server-side renderer for the tiny model, built in-process as vLLM's api_server
builds it (model config, renderer, no engine): the oracle for what vLLM's server makes of a chat
request or a /tokenize request. vLLM 0.32's API only (0.23 builds these over an engine client)."""

from __future__ import annotations

from typing import Any
from unittest import mock

from serve_app.config.settings import DEFAULT_MODEL_DIR


def online_renderer(max_model_len: int, trust_request_chat_template: bool = False) -> Any:
    """vLLM's ``OnlineRenderer``: ``preprocess_chat`` renders and tokenizes a chat request."""
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.renderers.registry import renderer_from_config

    with mock.patch.dict("os.environ", {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}):
        model_config = ModelConfig(model=str(DEFAULT_MODEL_DIR), dtype="float32", seed=0, max_model_len=max_model_len)
        renderer = renderer_from_config(VllmConfig(model_config=model_config))
    return OnlineRenderer(
        model_config,
        renderer,
        request_logger=None,
        chat_template=None,
        chat_template_content_format="auto",
        trust_request_chat_template=trust_request_chat_template,
    )


def tokenization(model_name: str, max_model_len: int) -> Any:
    """vLLM's ``ServingTokenization``, the handler of its /tokenize and /detokenize."""
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization

    online = online_renderer(max_model_len)
    models = OpenAIModelRegistry(online.model_config, [BaseModelPath(name=model_name, model_path=str(DEFAULT_MODEL_DIR))])
    return ServingTokenization(models, online, chat_template=None, chat_template_content_format="auto")


async def chat_prompt_ids(online: Any, body: dict[str, Any]) -> list[int]:
    """The prompt token ids vLLM's server gives its engine for a chat completion request."""
    return list((await chat_engine_input(online, body))["prompt_token_ids"])


async def chat_prompt_text(online: Any, body: dict[str, Any]) -> str:
    """The rendered prompt vLLM's server shows for ``return_prompt_text`` (its output's ``prompt``)."""
    return (await chat_engine_input(online, body))["prompt"]


async def chat_engine_input(online: Any, body: dict[str, Any]) -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(**body)
    tools = None if request.tools is None else [tool.model_dump() for tool in request.tools]
    _, inputs = await online.preprocess_chat(
        request,
        request.messages,
        default_template=None,
        default_template_content_format="auto",
        default_template_kwargs={},
        tool_dicts=tools,
    )
    return dict(inputs[0])
