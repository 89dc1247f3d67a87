"""OpenAI response framing: stream chunks, the final response, SSE encoding.

One ``ResponseFramer`` per client response, whatever the number of attempts behind it: it owns
the response id and ``created``, sends the chat role delta exactly once, and never shows an
attempt boundary (there is no ``recomputed`` chunk: the state machine swallows it). The objects
are vLLM's OpenAI response models, dumped to plain dicts, so the HTTP API and the handle API send
the same events.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable
from typing import Any

from serve_app.router.parsing import ParsedRequest
from serve_app.router.recompute import Emission
from serve_app.router.tools import ForcedCall, ParsedCalls, RequiredCalls, RequiredCallsStream, new_call_id, required_tool_calls
from serve_app.wire.protocol import TokenLogprob

logger = logging.getLogger("pd_serve.router")

TokenText = Callable[[int], str]
# A token's text read with the tokens before it at its place (text.piece_in_context); None: unknown.
InContext = Callable[[int, list[int]], "str | None"]
PIECE_CONTEXT = 4  # the tokens before a position that can hold the rest of its character (UTF-8: 4 bytes)


def sse(event: dict[str, Any] | str) -> str:
    """One server-sent event; every event is framed here and nowhere else."""
    data = event if isinstance(event, str) else json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


SSE_DONE = sse("[DONE]")


class ResponseFramer:
    def __init__(self, request: ParsedRequest, token_text: TokenText, in_context: InContext | None = None) -> None:
        self.request = request
        self.token_text = token_text
        self.in_context = in_context
        self._output_context: list[int] = []  # the output's last tokens whose logprobs were framed (``_piece``)
        self._role_sent = False
        self._text_offset = 0
        self._first_chunk_framed = False  # the prompt's ids and text go with the choice's first chunk only
        self._call_opened = False  # a named tool choice's call: its first delta sent
        self._required: RequiredCallsStream | None = None  # a required tool choice's calls so far
        self._parser: Any = None  # vLLM's reply parser (auto tool calls, reasoning), with the stream's state
        self._parser_failed = False  # it raised: the rest of the text goes on unparsed
        self._auto_calls = 0  # the calls an auto choice's parser has opened
        self._echoed = False  # the echo (ParsedRequest.echo) has been sent
        self._reasoning_counter: Any = None  # a parser kept for counting the reply's thinking
        # The chunks of the latest ``chunks`` that open a chat reply (its role, its echo): before any output.
        self.opening_chunks = 0

    def _prompt_once(self) -> tuple[list[int] | None, str | None]:
        """(prompt token ids, prompt text) for a choice's first chunk, as vLLM's server sends them
        (the ids with ``return_token_ids``, the text with a chat's ``return_prompt_text``), and
        (None, None) for every later chunk."""
        if self._first_chunk_framed:
            return None, None
        self._first_chunk_framed = True
        ids = list(self.request.prompt_token_ids) if self.request.return_token_ids else None
        return ids, self.request.prompt_text

    # ------------------------------------------------------------------ streaming
    def chunks(self, emission: Emission) -> list[dict[str, Any]]:
        """The stream chunks for one step (none when it carries nothing the client can see)."""
        out: list[dict[str, Any]] = []
        self.opening_chunks = 0
        visible = bool(emission.text or emission.token_ids or emission.finish_reason)
        if self.request.route == "chat":
            # The role delta opens the first chunk that shows something; an error before any
            # token sends none, so the client gets a plain error response instead.
            if visible and not self._role_sent:
                self._role_sent = True
                out.append(self._chat_chunk({"role": self.request.reply_role, "content": ""}, None, None, None))
                if self.request.echo:  # the last message, as its own chunk (as vLLM's server)
                    out.append(self._chat_chunk({"content": self.request.echo}, None, None, None))
                self.opening_chunks = len(out)
            if visible:
                delta = self._chat_delta(emission)
                if not delta and not emission.finish_reason and not self._carries_token_data(emission):
                    return out  # a tool call still being written: nothing to show yet (as vLLM's server)
                out.append(
                    self._chat_chunk(
                        delta,
                        self._chat_logprobs(emission.logprobs),
                        self._finish_reason(emission.finish_reason, self._streamed_calls()),
                        emission.stop_reason,
                        emission.token_ids,
                    )
                )
        elif visible:
            out.append(self._completion_chunk(emission))
        return out

    def _chat_delta(self, emission: Emission) -> dict[str, Any]:
        """Text as ``content``, or as tool calls (router/tools.py), with a reasoning model's
        thinking apart as ``reasoning`` (router/output_parsers.py). A named call's id, type and
        name come in the first delta that carries any arguments, as vLLM's server streams them;
        each call of a required choice whole, once its JSON object is complete; calls in the
        model's own format as vLLM's parser for that format reads them."""
        choice = self.request.tool_choice
        if isinstance(choice, ParsedCalls):  # its parser takes the reasoning out too
            delta = self._parsed_delta(choice.new_parser, choice.request, emission)
            if "tool_calls" in delta:
                delta["tool_calls"] = choice.first_call_only(delta["tool_calls"])
                self._auto_calls += sum(1 for call in delta["tool_calls"] if call.get("id"))
                if not delta["tool_calls"]:  # a later call's, left out
                    del delta["tool_calls"]
            return self._shown(delta)
        text, out = emission.text, {}
        if self.request.reasoning is not None:
            out = self._parsed_delta(self.request.reasoning.new_parser, self.request.reasoning.request, emission)
            text = out.pop("content", None) or ""
            out = self._shown(out)
            if choice is None:
                return {**out, "content": text} if text else out
        if choice is None:  # the last chunk too, with nothing left to say: {"content": ""} (as vLLM's server)
            return {"content": text}
        if isinstance(choice, RequiredCalls):
            self._required = self._required or RequiredCallsStream()
            calls = self._required.feed(text)
            return {**out, "tool_calls": calls} if calls else out
        if not text:
            return out
        function: dict[str, Any] = {"arguments": text}
        tool_call: dict[str, Any] = {"index": 0, "function": function}
        if not self._call_opened:
            self._call_opened = True
            function["name"] = choice.name
            tool_call.update(id=choice.call_id, type="function")
        return {**out, "tool_calls": [tool_call]}

    def _parsed_delta(self, new_parser: Callable[[], Any], request: Any, emission: Emission) -> dict[str, Any]:
        """vLLM's parser on the step's text: content, reasoning, tool calls, or nothing yet (a
        marker, or a call's name, is held until the parser knows what it is). A parser that
        fails, at its construction or at any step, is not called again (its state lacks the step
        it failed on): from there the text goes on as content, rather than end a response the
        engines computed, and the failure is logged once."""
        if not self._parser_failed:
            try:
                self._parser = self._parser or new_parser()
                delta = self._parser.parse_delta(
                    emission.text,
                    list(emission.token_ids),
                    request,
                    self.request.prompt_token_ids,
                    finished=emission.finish_reason is not None,
                )
            except Exception:
                self._parser_failed = True
                logger.exception("request %s: the reply parser failed; the rest of the text is sent as content", self.request.response_id)
            else:
                return {k: v for k, v in delta.model_dump(exclude_none=True).items() if v != []} if delta is not None else {}
        # Unparsed text may be thinking the request asked to leave out: then none of it.
        return {"content": emission.text} if emission.text and not self._hides_reasoning() else {}

    def _hides_reasoning(self) -> bool:
        return self.request.reasoning is not None and not self.request.reasoning.include

    def _shown(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Without the reasoning a request asked to leave out (``include_reasoning: false``)."""
        if self._hides_reasoning():
            fields.pop("reasoning", None)
        return fields

    def _streamed_calls(self) -> int:
        return self._required.calls if self._required else self._auto_calls

    def _carries_token_data(self, emission: Emission) -> bool:
        return bool(emission.token_ids and self.request.returns_output_ids) or bool(emission.logprobs and self.request.logprobs is not None)

    def _finish_reason(self, finish_reason: str | None, calls: int, whole: bool = False) -> str | None:
        """OpenAI's: "tool_calls" where a required or an auto choice's calls ended as they should
        (a named choice's reply ends with "stop"). As vLLM's server: a whole (not streamed)
        reply with an auto choice's calls says "tool_calls" whatever ended it."""
        choice = self.request.tool_choice
        parsed = isinstance(choice, ParsedCalls)
        if whole and parsed and not choice.forced and calls:
            return "tool_calls"
        calling = isinstance(choice, RequiredCalls) or (parsed and not choice.named)
        return "tool_calls" if finish_reason == "stop" and calling and calls else finish_reason

    def reasoning_tokens(self, token_ids: list[int]) -> int | None:
        """How many of the reply's tokens are thinking, as vLLM 0.32's server counts them for the
        usage of every chat reply where it has a reasoning parser (its parser's
        ``count_reasoning_tokens``); None where it reports none (no reasoning parser; vLLM 0.23)."""
        split = self.request.reasoning
        if split is None:
            return None
        try:
            parser = self._reasoning_counter = self._reasoning_counter or split.new_parser()
            count = getattr(parser, "count_reasoning_tokens", None)
            return None if count is None else int(count(tuple(token_ids)))
        except Exception:  # the count is a courtesy: never fail a reply the engines computed
            logger.exception("request %s: could not count the reasoning tokens", self.request.response_id)
            return None

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> dict[str, Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse
        from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

        model = ChatCompletionStreamResponse if self.request.route == "chat" else CompletionStreamResponse
        chunk = model(
            id=self.request.response_id,
            created=self.request.created,
            model=self.request.model,
            choices=[],
            usage=usage(prompt_tokens, completion_tokens, reasoning_tokens),
        )
        return _dump(chunk)

    def _completion_chunk(self, emission: Emission) -> dict[str, Any]:
        from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse

        text, logprobs = self._output_shown(emission.text, emission.logprobs)
        prompt_ids, _ = self._prompt_once()  # a completion has no prompt text
        prompt_logprobs = None
        if self.request.echo is not None and not self._echoed:  # the prompt, in the first chunk
            self._echoed = True
            text = self.request.echo + text
            prompt_logprobs = self._prompt_logprobs(emission.prompt_logprobs)
            prompt_ids = list(self.request.prompt_token_ids)  # as vLLM's server, whatever return_token_ids says
        choice = CompletionResponseStreamChoice(
            index=self.request.index,
            text=text,
            logprobs=self._completion_logprobs(logprobs, prompt_logprobs),
            finish_reason=emission.finish_reason,
            stop_reason=emission.stop_reason,
            token_ids=list(emission.token_ids) if self.request.returns_output_ids else None,
            prompt_token_ids=prompt_ids,
        )
        chunk = CompletionStreamResponse(
            id=self.request.response_id, created=self.request.created, model=self.request.model, choices=[choice]
        )
        return _dump(chunk, keep_choice_keys=STREAMED_COMPLETION_KEYS)

    def _chat_chunk(
        self,
        delta: dict[str, Any],
        logprobs: Any,
        finish_reason: str | None,
        stop_reason: int | str | None,
        token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionResponseStreamChoice,
            ChatCompletionStreamResponse,
        )

        from serve_app.runtime.compat import DeltaMessage

        choice = ChatCompletionResponseStreamChoice(
            index=self.request.index,
            delta=DeltaMessage(**delta),
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            token_ids=list(token_ids) if token_ids and self.request.returns_output_ids else None,
        )
        prompt_ids, prompt_text = self._prompt_once()
        chunk = ChatCompletionStreamResponse(
            id=self.request.response_id,
            created=self.request.created,
            model=self.request.model,
            choices=[choice],
            prompt_token_ids=prompt_ids,
            prompt_text=prompt_text,
        )
        return _dump(chunk, keep_choice_keys=STREAMED_CHAT_KEYS if finish_reason is None else STREAMED_CHAT_KEYS + ("stop_reason",))

    # ------------------------------------------------------------------ final response
    def final(
        self,
        *,
        text: str,
        token_ids: list[int],
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
        prompt_tokens: int,
        prompt_logprobs: list[TokenLogprob | None] | None = None,
    ) -> dict[str, Any]:
        use = usage(prompt_tokens, len(token_ids), self.reasoning_tokens(token_ids))
        self._output_context = []
        ids = list(token_ids) if self.request.returns_output_ids else None
        prompt_ids = list(self.request.prompt_token_ids) if self.request.return_token_ids else None
        if self.request.route == "chat":
            from vllm.entrypoints.openai.chat_completion.protocol import (
                ChatCompletionResponse,
                ChatCompletionResponseChoice,
            )

            message = self._chat_message(text, token_ids)
            choice = ChatCompletionResponseChoice(
                index=self.request.index,
                message=message,
                logprobs=self._chat_logprobs(logprobs),
                finish_reason=self._finish_reason(finish_reason, len(message.tool_calls or []), whole=True),
                stop_reason=stop_reason,
                token_ids=ids,
            )
            response: Any = ChatCompletionResponse(
                id=self.request.response_id,
                created=self.request.created,
                model=self.request.model,
                choices=[choice],
                usage=use,
                prompt_token_ids=prompt_ids,
                prompt_text=self.request.prompt_text,
            )
        else:
            from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionResponseChoice

            self._text_offset = 0
            echo = self.request.echo
            text, logprobs = self._output_shown(text, logprobs)
            choice = CompletionResponseChoice(
                index=self.request.index,
                text=text if echo is None else echo + text,
                logprobs=self._completion_logprobs(logprobs, None if echo is None else self._prompt_logprobs(prompt_logprobs)),
                finish_reason=finish_reason,
                stop_reason=stop_reason,
                token_ids=ids,
                prompt_token_ids=prompt_ids,
            )
            response = CompletionResponse(
                id=self.request.response_id,
                created=self.request.created,
                model=self.request.model,
                choices=[choice],
                usage=use,
            )
        data = _dump(response, keep_choice_keys=("finish_reason", "stop_reason", "logprobs"))
        if self.request.prompt_logprobs is not None:  # a completion's choice has its own; a chat reply has one, its first's
            if self.request.route != "chat":
                data["choices"][0]["prompt_logprobs"] = self._prompt_logprobs_field(prompt_logprobs)
            elif self.request.index == 0:
                data["prompt_logprobs"] = self._prompt_logprobs_field(prompt_logprobs)
        for choice in data["choices"]:
            if "message" in choice:  # OpenAI's message always has content: null beside tool calls
                choice["message"].setdefault("content", None)
                if self.request.echo is not None:  # the last message before the reply (as vLLM's server)
                    choice["message"]["content"] = self.request.echo + (choice["message"]["content"] or "")
        return data

    def _chat_message(self, text: str, token_ids: list[int]) -> Any:
        """The reply: text, or tool calls (content "" for a named or required choice, as vLLM's
        server), and a reasoning model's thinking apart."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatMessage

        choice = self.request.tool_choice
        if isinstance(choice, ParsedCalls):  # its parser takes the reasoning out too
            fields = self._parsed_reply(choice.new_parser, choice.request, text, token_ids, auto=True)
            if fields.get("tool_calls"):
                fields["tool_calls"] = choice.first_call_only(fields["tool_calls"])
            if choice.forced:  # as vLLM's server writes a named or required choice's reply
                fields["content"] = fields.get("content") or ""
            return ChatMessage(role=self.request.reply_role, **self._shown(fields))
        fields = {"content": text}
        if self.request.reasoning is not None:  # what follows the thinking (None: it never ended)
            split = self.request.reasoning
            fields = self._shown(self._parsed_reply(split.new_parser, split.request, text, token_ids, auto=False))
        if choice is None:
            return ChatMessage(role=self.request.reply_role, **fields)
        text = fields.pop("content", None) or ""
        if isinstance(choice, ForcedCall):  # no output, no call (as vLLM's server)
            call = {"id": choice.call_id, "type": "function", "function": {"name": choice.name, "arguments": text}}
            return ChatMessage(role=self.request.reply_role, **fields, content="", tool_calls=[call] if text.strip() else [])
        calls = [{k: v for k, v in call.items() if k != "index"} for call in required_tool_calls(text)]
        return ChatMessage(role=self.request.reply_role, **fields, content="", tool_calls=calls)

    def _parsed_reply(self, new_parser: Callable[[], Any], request: Any, text: str, token_ids: list[int], auto: bool) -> dict[str, Any]:
        """The whole text through vLLM's parser: the reasoning, the content around the calls, and
        the calls (an auto choice's); the content as the parser gives it (None where nothing
        follows the thinking, or a call cut short was dropped, as on vLLM's server)."""
        try:
            parser = new_parser()
            if hasattr(parser, "set_prompt_token_ids"):  # vLLM 0.32: parsers that read the prompt's end
                parser.set_prompt_token_ids(self.request.prompt_token_ids)
            extra = {"model_output_token_ids": token_ids} if _takes(parser.parse, "model_output_token_ids") else {}  # 0.32
            reasoning, content, found = parser.parse(text, request, enable_auto_tools=auto, **extra)
        except Exception:
            logger.exception("request %s: the reply parser failed; the reply is sent as content", self.request.response_id)
            return {"content": None if self._hides_reasoning() else text}
        fields: dict[str, Any] = {"content": content}
        if reasoning is not None:
            fields["reasoning"] = reasoning
        if auto and found:
            fields["tool_calls"] = [
                {"id": getattr(f, "id", None) or new_call_id(), "type": "function", "function": {"name": f.name, "arguments": f.arguments}}
                for f in found
            ]
        return fields

    # ------------------------------------------------------------------ logprobs
    def _output_shown(self, text: str, logprobs: list[TokenLogprob] | None) -> tuple[str, list[TokenLogprob] | None]:
        """A completion's output as the response shows it: none of it for an echo of the prompt
        alone (max_tokens 0: the engine's one token is left out, as on vLLM's server)."""
        if self.request.echo_only:
            return "", None if logprobs is None else []
        return text, logprobs

    def _prompt_logprobs(self, prompt_logprobs: list[TokenLogprob | None] | None) -> list[tuple[int, TokenLogprob | None]] | None:
        """An echoed prompt's tokens and their logprobs (where the request wants logprobs); None
        where the engines gave none (logged: vLLM's server would fail the request instead)."""
        if self.request.logprobs is None:
            return None
        ids = self.request.prompt_token_ids
        if prompt_logprobs is None or len(prompt_logprobs) != len(ids):
            logger.warning("request %s: the engine gave no logprobs of the echoed prompt", self.request.response_id)
            prompt_logprobs = [None] * len(ids)
        return list(zip(ids, prompt_logprobs, strict=True))

    def _prompt_logprobs_field(self, prompt_logprobs: list[TokenLogprob | None] | None) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs`` field: per prompt token (None for the first, which nothing
        predicts) its logprob, rank and text, then the top k's, keyed by token id."""
        k = self.request.prompt_logprobs or 0
        ids = self.request.prompt_token_ids
        if prompt_logprobs is None or len(prompt_logprobs) != len(ids):
            logger.warning("request %s: the engine gave no logprobs of the prompt", self.request.response_id)
            prompt_logprobs = [None] * len(ids)
        field: list[dict[str, Any] | None] = []
        for position, lp in enumerate(prompt_logprobs):
            if lp is None:
                field.append(None)
                continue
            context = _prompt_context(ids, position)
            entries = {str(lp.token_id): self._ranked(lp.token_id, lp.logprob, lp.rank, context)}
            for rank, (tid, value) in enumerate(lp.top[:k], start=1):
                entries.setdefault(str(tid), self._ranked(tid, value, rank, context))
            field.append(entries)
        return field

    def _ranked(self, token_id: int, logprob: float, rank: int | None, context: list[int]) -> dict[str, Any]:
        return {"logprob": json_logprob(logprob), "rank": rank, "decoded_token": self._piece(token_id, context)}

    def _completion_logprobs(self, logprobs: list[TokenLogprob] | None, prompt: list[tuple[int, TokenLogprob | None]] | None = None) -> Any:
        """The legacy API's logprobs of these tokens, after an echoed prompt's (``prompt``: its
        first token, which nothing predicts, has none)."""
        if logprobs is None or self.request.logprobs is None:
            return None
        from vllm.entrypoints.openai.completion.protocol import CompletionLogProbs

        out = CompletionLogProbs()
        offset = self._text_offset
        ids = self.request.prompt_token_ids
        echoed = [(token_id, lp, _prompt_context(ids, position)) for position, (token_id, lp) in enumerate(prompt or ())]
        for token_id, lp, context in [*echoed, *((lp.token_id, lp, self._next_output_context(lp.token_id)) for lp in logprobs)]:
            # A token with no logprobs (an echoed prompt's first, which nothing predicts): its own text (vLLM's
            # server decodes it alone, which drops a SentencePiece token's leading space; this keeps it).
            token = self._label(token_id, context) if lp is not None or self.request.tokens_as_ids else self.token_text(token_id)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(json_logprob(lp.logprob))
            # The legacy API's top_logprobs: the token, then the best others, k + 1 in all where
            # the engine gave more (an echo's prompt asked with a larger prompt_logprobs), as vLLM's.
            top = {token: json_logprob(lp.logprob)}
            top.update((self._label(tid, context), json_logprob(value)) for tid, value in _token_first(lp)[1 : self.request.logprobs + 1])
            out.top_logprobs.append(top)
        # The next chunk's offsets go on from these tokens' text, as vLLM's server counts them
        # (not from the text sent, which lags the tokens while a stop string may be forming).
        self._text_offset = offset
        return out

    def _chat_logprobs(self, logprobs: list[TokenLogprob] | None) -> Any:
        if logprobs is None or self.request.logprobs is None:
            return None
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionLogProb,
            ChatCompletionLogProbs,
            ChatCompletionLogProbsContent,
        )

        content = []
        for lp in logprobs:
            context = self._next_output_context(lp.token_id)
            # The sampled token's bytes are its text's, as vLLM's server sends them, whatever its label.
            text = self._piece(lp.token_id, context)
            # vLLM's server: the first top_logprobs of the sampled token and the best others (the
            # sampled one first, whatever its rank).
            top = [
                ChatCompletionLogProb(token=(label := self._label(tid, context)), logprob=json_logprob(value), bytes=list(label.encode()))
                for tid, value in _token_first(lp)[: self.request.logprobs]
            ]
            name = f"token_id:{lp.token_id}" if self.request.tokens_as_ids else text
            content.append(
                ChatCompletionLogProbsContent(token=name, logprob=json_logprob(lp.logprob), bytes=list(text.encode()), top_logprobs=top)
            )
        return ChatCompletionLogProbs(content=content)

    def _label(self, token_id: int, context: list[int]) -> str:
        """A token as logprobs name it: its text, or ``token_id:<id>`` where the request asks
        for ids (``return_tokens_as_token_ids``, as vLLM's server writes them)."""
        return f"token_id:{token_id}" if self.request.tokens_as_ids else self._piece(token_id, context)

    def _piece(self, token_id: int, context: list[int]) -> str:
        """A token's text in logprobs, as vLLM's engine writes it: one that is only a piece of a
        multi-byte character ("\ufffd" alone, as byte-level vocabularies split CJK text and emoji)
        is read with the tokens before its place (``context``): the character where it completes
        one, "" where it does not."""
        text = self.token_text(token_id)
        if text.endswith("\ufffd") and self.in_context is not None:
            read = self.in_context(token_id, context)
            if read is not None:
                return read
        return text

    def _next_output_context(self, token_id: int) -> list[int]:
        """The output tokens before this one (its logprobs' context), and it after them."""
        context = self._output_context[-PIECE_CONTEXT:]
        self._output_context = [*context, token_id]
        return context


def _token_first(lp: TokenLogprob) -> list[tuple[int, float]]:
    """A position's entries as vLLM's engine orders them: the token, then the best others."""
    return [(lp.token_id, lp.logprob), *((tid, value) for tid, value in lp.top if tid != lp.token_id)]


def _prompt_context(ids: list[int], position: int) -> list[int]:
    """The prompt tokens before a position that vLLM's engine reads its logprobs' text with: not
    the first (which has no logprobs entry there)."""
    return ids[max(1, position - PIECE_CONTEXT) : position]


def _takes(method: Any, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


MIN_LOGPROB = -9999.0  # what OpenAI and vLLM's server send for an impossible token


def json_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf (a token masked out, e.g. by top_k or allowed_token_ids,
    under a ``processed_*`` logprobs mode) would be ``-Infinity``, which no JSON parser takes."""
    return max(value, MIN_LOGPROB)


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> Any:
    from serve_app.runtime.compat import UsageInfo

    details = {}
    if reasoning_tokens is not None and "completion_tokens_details" in UsageInfo.model_fields:  # vLLM 0.32
        details["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        **details,
    )


# The choice keys a stream chunk has even where null, as in vLLM's server's (which sets them
# explicitly, and OpenAI's: a client may read choice["logprobs"]); stop_reason on a chat's last chunk.
STREAMED_COMPLETION_KEYS = ("finish_reason", "logprobs", "stop_reason")
STREAMED_CHAT_KEYS = ("finish_reason", "logprobs")


def _dump(model: Any, keep_choice_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """JSON-ready dict without vLLM's unset extras, keeping the keys OpenAI always sends."""
    data = model.model_dump(mode="json", exclude_none=True)
    for choice in data.get("choices", []):
        for key in keep_choice_keys:
            choice.setdefault(key, None)
    return data
