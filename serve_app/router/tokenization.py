"""vLLM's ``/tokenize`` and ``/detokenize``: a prompt's token ids as an engine would get them, and
token ids back to text.

Clients count a prompt's tokens before they send it (whether it fits the context, what it will
cost, where to cut a long document), and for a chat request only the server's template says what
the count is. vLLM's server answers these routes from its renderer, with no engine involved; the
router holds the same tokenizer and renders chat prompts for ``/v1/chat/completions`` itself, so
it answers them the same way, with vLLM's own request and response models. The ids are those a
completion of the same prompt sends to its engine (the same template call and encoder).

As on vLLM's server, a prompt longer than the context is counted, not refused (the body's size
limit bounds the work: a rendered prompt longer than a body can be is refused), and a client's
own chat template is refused unless the operator trusts clients
(``router.trust_request_chat_template``). Differences, on purpose: a token id outside the
tokenizer's vocabulary is a 400 naming it, where vLLM's tokenizer silently leaves it out of the
text, and so are more ids than the model's context (decoding holds the interpreter's lock, so
the replica's streams wait for it).
"""

from __future__ import annotations

from typing import Any, Literal

from serve_app.router.errors import bad_request
from serve_app.router.parsing import ModelContext, chat_prompt_text, check_template_kwargs, checked_model, validated

TokenizerRoute = Literal["tokenize", "detokenize"]
TOKENIZER_ROUTES: frozenset[str] = frozenset({"tokenize", "detokenize"})


def answer(route: TokenizerRoute, body: Any, ctx: ModelContext, max_chars: int) -> dict[str, Any]:
    """The response body of a tokenizer route; an ``OpenAIError`` for a bad request.
    ``max_chars``: the longest text tokenized (the body's size limit: only a chat template can
    render more than a body holds)."""
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    checked_model(body, ctx)
    return detokenize(body, ctx) if route == "detokenize" else tokenize(body, ctx, max_chars)


def tokenize(body: dict[str, Any], ctx: ModelContext, max_chars: int) -> dict[str, Any]:
    """A completion prompt (``prompt``: text) or a chat conversation (``messages``) as token ids."""
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest, TokenizeResponse

    if "messages" in body:
        if body["messages"] == []:  # vLLM's renderer refuses it too
            raise bad_request("'messages' must be a non-empty list of messages", param="messages")
        request = validated(TokenizeChatRequest, body)
        check_template_kwargs(request, ctx)
        text = chat_prompt_text(request, ctx, bounded=False)
    else:
        if "prompt" not in body:
            raise bad_request("'prompt' or 'messages' is a required property", param="prompt")
        request = validated(TokenizeCompletionRequest, body)
        text = request.prompt
    if len(text) > max_chars:  # a client's template (router.trust_request_chat_template) can render without end
        raise bad_request(f"The rendered prompt is {len(text)} characters; this server tokenizes at most {max_chars}", param="messages")
    ids = ctx.encode(text, request.add_special_tokens)
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs).model_dump()


def detokenize(body: dict[str, Any], ctx: ModelContext) -> dict[str, Any]:
    """Token ids as text, special tokens included (vLLM's server decodes them so too)."""
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, DetokenizeResponse

    request = validated(DetokenizeRequest, body)
    if len(request.tokens) > ctx.max_model_len:  # decoding holds the GIL: a bound on the event loop's wait
        raise bad_request(f"{len(request.tokens)} tokens are more than the model's context of {ctx.max_model_len}", param="tokens")
    known = min(ctx.vocab_size, len(ctx.tokenizer))  # (a model's embeddings may be padded past its tokenizer's)
    bad = next((i for i, token in enumerate(request.tokens) if token >= known), None)
    if bad is not None:
        raise bad_request(f"Token id {request.tokens[bad]} at tokens[{bad}] is out of range [0, {known})", param="tokens")
    return DetokenizeResponse(prompt=ctx.tokenizer.decode(request.tokens)).model_dump()
