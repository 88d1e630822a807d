"""AsyncLLMEngine: one engine loop shared by many concurrent callers (the OS's run loop).

An OS kernel runs one scheduler loop however many processes ask for time; each process
waits on its own channel for its results. Here the callers are coroutines (one per
HTTP request in the server), the loop is a single coroutine that steps the LLMEngine
while any request is unfinished and sleeps when idle, and each request gets its
outputs through its own ``asyncio.Queue``. A request that arrives while others run
joins the running batch at the next step: continuous batching across clients.

Only one thread ever touches the LLMEngine: the loop's worker thread. ``engine.step()``
runs there, so it never blocks the event loop, and requests and aborts are handed to it
through a queue and applied just before the next step. A request is validated (and
tokenized) before it is handed over, so a bad one raises ``RequestError`` at once in
its caller and never reaches the engine.

Nothing on the event loop waits for the engine's thread to answer a question about the
engine: each step leaves a heartbeat (engine/liveness.py) with a copy of the statistics,
which ``get_stats`` and ``health`` read. With a ``step_timeout``, a watchdog declares the
engine dead when one step runs past it (a hung or lost worker): every caller gets
``EngineDeadError``, and so does every later request.

    engine = AsyncLLMEngine.from_engine_args(model="smollm2-135m-instruct")
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from ..outputs import RequestOutput
from ..sampling_params import OutputKind, SamplingParams
from ..sequence import SequenceGroup
from .beam_search import BeamSearchParams
from .input_processor import RequestError
from .liveness import Heartbeat
from .llm_engine import LLMEngine
from .warm_up import warm_up

logger = logging.getLogger("minipaged")


class EngineDeadError(RuntimeError):
    """The engine loop stopped (a step failed, or the engine was shut down)."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None,
                 step_timeout: float | None = None) -> None:
        if max_queued_requests is not None and not (isinstance(max_queued_requests, int)
                                                    and not isinstance(max_queued_requests, bool)
                                                    and max_queued_requests >= 0):
            raise ValueError(f"max_queued_requests must be an integer >= 0 or None, got {max_queued_requests!r}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests   # waiting requests beyond this are refused
        self._queues: dict[str, asyncio.Queue] = {}       # request id -> its outputs (or an exception)
        self._pending = []                                # (kind, payload) for the worker thread
        self._pending_lock = threading.Lock()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minipaged-engine")
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self.steps_with_several_requests = 0              # steps that served more than one request
        # called as fn(output, num_output_tokens) when a request finishes (the server's metrics)
        self.finished_listeners: list = []
        self._delta: dict[str, list[int]] = {}            # DELTA requests: tokens so far per sample
        self.heartbeat = Heartbeat(step_timeout)          # when the step now running began; the stats
        self._watchdog: asyncio.Task | None = None        # declares the engine dead past step_timeout
        # called as fn(error) once, on the event loop, when the engine dies (the server exits)
        self.dead_listeners: list = []
        self._between: set = set()                        # call_between_steps futures waiting for the thread

    @classmethod
    def from_engine_args(cls, max_queued_requests: int | None = None, step_timeout: float | None = None,
                         **engine_kwargs) -> "AsyncLLMEngine":
        """Build the LLMEngine (``LLMEngine(**engine_kwargs)``) and wrap it."""
        return cls(LLMEngine(**engine_kwargs), max_queued_requests=max_queued_requests, step_timeout=step_timeout)

    # ------------------------------------------------------------------ callers
    async def add_request(self, request_id: str, prompt, params: SamplingParams | BeamSearchParams | None,
                          strict_max_tokens: bool = False) -> "RequestStream":
        """Validate and queue a request; returns the stream its outputs arrive on.

        Bad input raises here (``RequestError``, a ``ValueError``), before anything is
        queued; a full queue raises ``QueueFullError``. What each output holds follows
        ``params.output_kind`` (cumulative, delta or final only). With ``strict_max_tokens`` a
        prompt + max_tokens beyond max_model_len is refused (vLLM's server) instead of capped.
        """
        request_id = str(request_id)
        self._start()
        if request_id in self._queues:
            raise RequestError(f"request id {request_id!r} is already in use")
        if self.max_queued_requests is not None and self.num_waiting() >= self.max_queued_requests:
            raise QueueFullError(f"the queue is full ({self.max_queued_requests} requests are waiting); "
                                 "try again later")
        # Tokenizing a long prompt takes a while: off the event loop, but not on the
        # engine's thread, which may be stepping.
        group = await asyncio.get_running_loop().run_in_executor(
            None, self._make_group, request_id, prompt, params)
        if self._dead is not None:        # the engine died while this one was tokenized
            raise EngineDeadError(f"the engine loop has stopped: {self._dead}")
        if request_id in self._queues:    # the same id arrived while this one was tokenized
            raise RequestError(f"request id {request_id!r} is already in use")
        asked = getattr(params, "max_tokens", None)
        prompt_len = len(group.prompt_token_ids)
        limit = self.engine.max_model_len
        if strict_max_tokens and asked is not None and prompt_len + asked > limit:
            raise RequestError(f"this model's maximum context length is {limit} tokens, but {prompt_len + asked} "
                               f"were asked for ({prompt_len} in the prompt, max_tokens {asked}); lower max_tokens")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        if group.sampling_params.output_kind == OutputKind.DELTA:
            self._delta[request_id] = [0] * len(group.seqs)
        self._hand_over(("add", group))
        return RequestStream(self, request_id, queue)

    async def generate(self, prompt, params: SamplingParams | BeamSearchParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its outputs as the engine produces them (vLLM's API).

        Leaving the loop early (``break``, cancellation, a dropped connection) aborts the
        request; its blocks are free after the next step.
        """
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()        # a no-op once the request finished

    async def abort(self, request_id: str) -> None:
        """Cancel a request: its stream raises ``RequestAbortedError``, and its blocks are
        free after the next step."""
        request_id = str(request_id)
        self._delta.pop(request_id, None)
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(RequestAbortedError(f"request {request_id!r} was aborted"))
        self._hand_over(("abort", request_id))

    def _make_group(self, request_id: str, prompt, params) -> SequenceGroup:
        engine = self.engine
        if isinstance(params, BeamSearchParams):
            return engine.input_processor.make_beam_group(request_id, prompt, params, engine._seq_ids)
        return engine.input_processor.make_group(request_id, prompt, params, engine._seq_ids)

    def num_waiting(self) -> int:
        """Requests not yet running: handed over but not stepped, and the scheduler's waiting queue."""
        with self._pending_lock:
            pending = sum(1 for kind, _ in self._pending if kind == "add")
        return pending + len(self.engine.scheduler.waiting)

    async def get_stats(self) -> dict:
        """The engine's get_stats() as the last step left it (at most ``Heartbeat.stats_interval``
        old while steps run, exact when idle): it never waits for a step, or for a hung one."""
        stats = self.heartbeat.stats
        if stats is None or not self.is_running:
            if self._dead is not None or self.thread_stuck:
                return dict(stats or {})
            return self.engine.get_stats()
        return dict(stats)

    def health(self) -> str | None:
        """None if the engine loop is alive; else why not (it stopped, or a step hangs)."""
        if self._dead is not None:
            return f"the engine loop has stopped: {self._dead}"
        return self.heartbeat.problem()

    async def call_between_steps(self, fn, *args):
        """Run ``fn(*args)`` on the engine's thread between two steps (to read its state safely)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead}")
        if not self.is_running:
            return fn(*args)
        future = asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)
        self._between.add(future)
        try:
            return await future
        except asyncio.CancelledError:
            if self._dead is not None and future.cancelled():   # cancelled by _die: a 503, not a hang
                raise EngineDeadError(f"the engine loop has stopped: {self._dead}") from None
            raise
        finally:
            self._between.discard(future)

    def warm_up(self, calculate_kv_scales: bool = False) -> float | None:
        """engine/warm_up.py's dummy passes, on the engine's own thread (where its steps, and
        their OpenMP pool, will run), before the loop starts; the seconds taken, or None if
        skipped."""
        if self.is_running:
            return None
        return self._worker.submit(warm_up, self.engine, calculate_kv_scales).result()

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def abort_all(self) -> None:
        """Abort every request in flight (a server shutting down)."""
        for request_id in list(self._queues):
            await self.abort(request_id)

    async def shutdown(self) -> None:
        """Abort every request (their blocks are freed) and stop the loop."""
        await self.abort_all()
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._loop_task is not None:
            self._hand_over(("stop", None))
            # a step that hangs (before the watchdog saw it) must not hold the shutdown for ever
            done, _ = await asyncio.wait({self._loop_task}, timeout=self.heartbeat.step_timeout)
            if not done:
                self._loop_task.cancel()
            self._loop_task = None
        stuck = self.thread_stuck                         # a hung step: its thread cannot be joined
        self._worker.shutdown(wait=not stuck, cancel_futures=True)
        self.engine.shutdown()                        # its workers too (Ray actors exit)
        self._dead = self._dead or EngineDeadError("the engine was shut down")

    @property
    def thread_stuck(self) -> bool:
        """A step is still running on the engine's thread; after the engine died, one that hangs
        (the process can then only leave with os._exit; serve does so)."""
        return self.heartbeat.step_running_for() is not None

    # ------------------------------------------------------------------ the loop
    def _start(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead}")
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self.heartbeat.set_stats(self.engine.get_stats())     # no step runs now
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
            if self.heartbeat.step_timeout is not None and (self._watchdog is None or self._watchdog.done()):
                self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    def _hand_over(self, item: tuple) -> None:
        with self._pending_lock:
            self._pending.append(item)
        if self._wake is not None:
            self._wake.set()

    def _apply(self, items: list) -> bool:
        """In the worker thread: queue the handed-over requests, apply aborts. False on "stop"
        (then every request left is aborted)."""
        keep_running = True
        for kind, payload in items:
            if kind == "add":
                self.engine._queue(payload)
            elif kind == "abort":
                self.engine.abort_request(payload)
            else:
                keep_running = False
        if not keep_running:
            for group in list(self.engine.groups.values()):
                self.engine.abort_request(group.request_id)
        return keep_running

    def _step(self) -> tuple[bool, list[RequestOutput]]:
        """In the worker thread: one engine step, after the pending requests and aborts,
        between two beats of the heartbeat. False: stop the loop."""
        self.heartbeat.begin()
        ended = False
        try:
            with self._pending_lock:
                items, self._pending = self._pending, []
            keep_running = self._apply(items)
            outputs = []
            if keep_running and self.engine.has_unfinished_requests():
                outputs = self.engine.step()
                if len({o.request_id for o in outputs}) > 1:
                    self.steps_with_several_requests += 1
            ended = True
            return keep_running, outputs
        finally:
            self.heartbeat.end(self.engine.get_stats if ended else None,
                               fresh=ended and not self.engine.has_unfinished_requests())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                with self._pending_lock:
                    idle = not self._pending
                if idle and not self.engine.has_unfinished_requests():
                    self._wake.clear()
                    await self._wake.wait()          # sleep until a request or an abort arrives
                    continue
                keep_running, outputs = await loop.run_in_executor(self._worker, self._step)
                for out in outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                    self._count(out)
                if not keep_running:
                    return
                await asyncio.sleep(0)                # let callers add requests between steps
        except Exception as err:  # noqa: BLE001 (a failed step: every caller hears of it)
            if self._dead is not None:                # the watchdog got there first
                return
            self._die(err)
            try:   # free every block: no request can be served any more
                await loop.run_in_executor(self._worker, self._abort_everything)
            except Exception:  # noqa: BLE001
                pass

    def _die(self, err: BaseException) -> None:
        """The engine cannot serve any more: tell every caller, and the listeners, once."""
        logger.error("the engine loop stopped: %s: %s", type(err).__name__, err)
        self._dead = err
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(EngineDeadError(f"the engine loop stopped: {type(err).__name__}: {err}"))
        for future in list(self._between):            # /kv waiting behind a hung step
            future.cancel()
        for listener in self.dead_listeners:
            listener(err)

    async def _watch(self) -> None:
        """The watchdog: a step running past step_timeout kills the engine (its thread may
        stay stuck in the step; nothing can stop a thread from outside)."""
        period = min(1.0, self.heartbeat.step_timeout / 4)
        while self._dead is None:
            await asyncio.sleep(period)
            problem = self.heartbeat.problem()
            if problem is not None and self._dead is None:
                self._die(EngineHungError(problem))
                if self._loop_task is not None:
                    self._loop_task.cancel()          # it waits on the hung step
                return

    def _count(self, out: RequestOutput) -> None:
        """Output tokens per sample (deltas add up); tell the listeners when a request ends."""
        counts = self._delta.get(out.request_id)
        if counts is not None:
            for c in out.outputs:
                if c.index < len(counts):
                    counts[c.index] += len(c.token_ids)
        if not out.finished:
            return
        self._delta.pop(out.request_id, None)
        longest = max(counts) if counts else max((len(c.token_ids) for c in out.outputs), default=0)
        for listener in self.finished_listeners:
            listener(out, longest)

    def _abort_everything(self) -> None:
        with self._pending_lock:
            self._pending = []
        for group in list(self.engine.groups.values()):
            self.engine.abort_request(group.request_id)


class RequestStream:
    """The outputs of one request, in order; iterating past the last one ends the loop.

    Leaving early (``break``, an exception, cancellation, ``aclose()``) aborts the request.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:                 # cancelled while waiting: the caller went away
            await self.aclose()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            self.engine._queues.pop(self.request_id, None)
            raise item
        if item.finished:
            self.finished = True
            self.engine._queues.pop(self.request_id, None)
        return item

    async def aclose(self) -> None:
        """Stop listening; an unfinished request is aborted (its blocks freed by the next step)."""
        if not self.finished:
            self.finished = True
            await self.engine.abort(self.request_id)
        self.engine._queues.pop(self.request_id, None)   # a finished one unread: drop its outputs


class EngineHungError(RuntimeError):
    """A step ran past the step timeout (a hung or lost worker); the engine counts as dead."""


class QueueFullError(RuntimeError):
    """More requests are waiting than ``max_queued_requests`` allows; the server answers 503."""


class RequestAbortedError(RuntimeError):
    """The request was aborted (by ``abort``, or by a shutdown) before it finished."""
