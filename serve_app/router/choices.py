"""A response of several choices (``n`` > 1, or several completion prompts), as vLLM's server
answers one: each choice is a ``ResponseSession`` of its own (its own attempts, recomputes and
framing, its chunks carrying its index), run side by side; their chunks are merged into one
stream, or their replies into one response with the usage of them all.

vLLM's engine makes a prompt's n samples from one request (its ``ParentRequest``). Here each is
an engine request, so a prompt's first sample goes first, and the others follow once it has its
first token: the prompt is then in its engines' prefix caches, and the router's prefix routing
sends the others where it is. Side by side, a later sample would find only what the engine had
computed of the prompt by then (a long prompt is computed in chunks) and compute the rest again.

One failure fails the response, as on vLLM's server: the other choices are stopped (their
engine requests aborted, their leases released) and the client gets the error.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from serve_app.router.framing import usage
from serve_app.router.parsing import ParsedRequest
from serve_app.router.session import ResponseSession, observe_request_times

# Choices being stopped, held until they have (a task the loop alone refers to may be collected).
_STOPPING: set[asyncio.Task] = set()


class ChoicesSession:
    """The ``ResponseSession`` interface the router's HTTP and handle paths use, over every
    choice of one response."""

    def __init__(
        self,
        request: ParsedRequest,
        session_of: Callable[[ParsedRequest], ResponseSession],
        received_at: float | None = None,
    ) -> None:
        self.request = request
        # The usage chunk is the response's, sent once, after every choice has finished.
        # In index order: choice i is sample i % n of prompt i // n.
        self.sessions = [session_of(replace(choice, include_usage=False, others=())) for choice in request.choices]
        self._first_token = [asyncio.Event() for _ in self.sessions[:: request.n]]  # each prompt's first sample's
        for first, event in zip(self.sessions[:: request.n], self._first_token, strict=True):
            first.on_first_token = event.set
        self.status = 200
        self.client_wait_s = 0.0
        self._started = received_at if received_at is not None else time.monotonic()

    @property
    def finished(self) -> bool:
        return all(session.finished for session in self.sessions)

    # ------------------------------------------------------------------ streaming
    async def event_batches(self) -> AsyncIterator[list[dict[str, Any]]]:
        """Each choice's groups of events as they come; a choice's error ends the stream. At
        most as many groups as there are choices wait for the client: a client that reads slowly
        holds the choices back, as it holds a one-choice stream (the engines' output waits in the
        engines, merged, not in the router as chunks)."""
        queue: asyncio.Queue[tuple[ResponseSession, list[dict[str, Any]] | BaseException | None]] = asyncio.Queue()
        room = asyncio.Semaphore(len(self.sessions))
        tasks = [asyncio.create_task(self._stream(i, queue, room)) for i in range(len(self.sessions))]
        running = len(tasks)
        try:
            while running:
                session, batch = await queue.get()
                if batch is None:
                    running -= 1
                    continue
                if isinstance(batch, BaseException):
                    raise batch
                room.release()
                if session.status != 200:  # its error event ends its batch: the response ends with it
                    self.status = session.status
                    await _stop(tasks)  # the others released before the client takes the error
                    yield batch
                    return
                yield batch
            if self.request.include_usage:
                yield [self._usage_chunk()]
        finally:
            await _stop(tasks)

    async def _stream(self, i: int, queue: asyncio.Queue, room: asyncio.Semaphore) -> None:
        """Choice i's groups into ``queue``, each once there is ``room``; its end (None, or the
        exception it raised) whatever happens."""
        session = self.sessions[i]
        end: BaseException | None = None
        try:
            await self._start(i)
            async with aclosing(session.event_batches()) as batches:
                async for batch in batches:
                    if session.finished:  # its last group: its attempt released before it waits for room
                        await batches.aclose()
                    await room.acquire()
                    queue.put_nowait((session, batch))
        except Exception as exc:  # a bug of ours: the response fails as a one-choice response would
            end = exc
        finally:
            if end is not None:
                queue.put_nowait((session, end))
            queue.put_nowait((session, None))

    def _usage_chunk(self) -> dict[str, Any]:
        return self.sessions[0].framer.usage_chunk(*self._usage())

    def _usage(self) -> tuple[int, int, int | None]:
        """As vLLM's server counts them: each prompt once, however many samples it has; every
        choice's output, and its thinking where the server counts it."""
        prompts = sum(s.machine.prompt_tokens for s in self.sessions[:: self.request.n])
        reasoning = [s.framer.reasoning_tokens(s.machine.output_token_ids) for s in self.sessions]
        counted = [count for count in reasoning if count is not None]
        return prompts, sum(s.machine.completion_tokens for s in self.sessions), sum(counted) if counted else None

    # ------------------------------------------------------------------ whole
    async def final_response(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body): every choice's reply in one response, or the first error."""
        tasks = [asyncio.create_task(self._final(i)) for i in range(len(self.sessions))]
        try:
            for done in asyncio.as_completed(tasks):
                status, body = await done
                if status != 200:
                    self.status = status
                    return status, body
        finally:
            await _stop(tasks)
        bodies = [task.result()[1] for task in tasks]
        response = bodies[0]
        response["choices"] = [choice for body in bodies for choice in body["choices"]]
        response["usage"] = usage(*self._usage()).model_dump(mode="json", exclude_none=True)
        return 200, response

    async def _final(self, i: int) -> tuple[int, dict[str, Any]]:
        await self._start(i)
        return await self.sessions[i].final_response()

    async def _start(self, i: int) -> None:
        """Choice i may start: at once for a prompt's first sample, after its first token for the
        others, which take the prompt's logprobs (an echo's) from it rather than ask again."""
        n = self.request.n
        if i % n == 0:
            return
        await self._first_token[i // n].wait()
        first = self.sessions[i - i % n].machine
        if first.error is not None:
            # The first sample failed, and with it the response: this one starts no engine request
            # and waits to be stopped, as every choice is once that error reaches the response.
            await asyncio.get_running_loop().create_future()
        self.sessions[i].machine.prompt_logprobs = first.prompt_logprobs

    # ------------------------------------------------------------------ metrics
    def observe_times(self) -> None:
        """The response's time once; its engine wait is its longest choice's."""
        engine_wait_s = max(session.engine_wait_s for session in self.sessions)
        observe_request_times(self.sessions[0].metrics, self.request.route, self._started, engine_wait_s, self.client_wait_s)


async def _stop(tasks: list[asyncio.Task]) -> None:
    """Cancel the choices still running and wait for them to release what they hold. If this
    wait is cancelled in turn (the client went away), they finish releasing on their own."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
        _STOPPING.add(task)
        task.add_done_callback(_STOPPING.discard)
    if pending:
        await asyncio.wait(pending)
