"""The engine loop: one thread owns the LLMEngine (it is not thread-safe). It drains the
commands that handlers submit (add, abort), steps while anything is in flight and sleeps
on the command queue otherwise, and hands each request's outputs to that request's asyncio
queue. New requests join the running batch between steps (continuous batching)."""

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from functools import partial

from blockspec.engine.engine import LLMEngine
from blockspec.outputs import RequestOutput
from blockspec.sampling import SamplingParams
from blockspec.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class EngineError(Exception):
    """The engine refused a request (bad_request) or failed while decoding it."""

    def __init__(self, message: str, bad_request: bool, param: str | None = None) -> None:
        super().__init__(message)
        self.bad_request = bad_request
        self.param = param  # the SamplingParams field at fault, where the engine names one


class NewestOutput:
    """A request's newest output, for its reader on the event loop. Outputs are cumulative, so one
    that replaces another loses nothing: a reader that falls behind (a client that stops reading a
    stream) costs one output, not every one since."""

    def __init__(self) -> None:
        self.item: RequestOutput | EngineError | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | EngineError) -> None:
        self.item = item
        self.ready.set()

    async def get(self) -> RequestOutput | EngineError:
        await self.ready.wait()
        self.ready.clear()
        item, self.item = self.item, None
        return item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.streams: dict[str, NewestOutput] = {}  # request id -> where its outputs go; engine thread only
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self.run, name="blockspec-engine", daemon=True)
        self.stopping = False

    # --- called on the event loop ---

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread.start()

    def shutdown(self) -> None:
        self.commands.put(partial(setattr, self, "stopping", True))
        self.thread.join()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """The request's cumulative output after each step that gave it tokens, until it
        finishes. Closing or cancelling the iterator early aborts the request."""
        outputs = NewestOutput()
        self.commands.put(partial(self.add, request_id, prompt_ids, params, outputs))
        done = False
        try:
            while not done:
                item = await outputs.get()
                if isinstance(item, EngineError):
                    done = True  # the engine holds nothing of it
                    raise item
                done = item.finished
                yield item
        finally:
            if not done:  # the client went away: free the request's pages
                self.commands.put(partial(self.abort, request_id))

    # --- called on the engine thread ---

    def run(self) -> None:
        while not self.stopping:
            self.drain(block=not self.engine.has_unfinished())
            if self.engine.has_unfinished():
                self.step()

    def drain(self, block: bool) -> None:
        """Run the submitted commands; when idle, wait for the first one."""
        if block:
            self.commands.get()()
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            command()

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, outputs: NewestOutput) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id)
        except ValueError as e:  # the engine's way of refusing a request
            self.push(outputs, EngineError(str(e), bad_request=True, param=getattr(e, "param", None)))
            return
        self.streams[request_id] = outputs
        self.metrics.request_added(len(prompt_ids))

    def abort(self, request_id: str) -> None:
        if self.streams.pop(request_id, None) is not None:  # else it finished already
            self.engine.abort(request_id)
            self.metrics.request_finished("abort")

    def step(self) -> None:
        try:
            seqs = self.engine.step()
        except Exception:  # keep serving: fail what was in flight, not the server
            log.exception("engine step failed; failing the %d requests in flight", len(self.streams))
            self.fail_all("the engine failed while decoding this request")
            return
        self.metrics.engine_steps.inc()
        for seq in seqs:
            out = self.engine.output(seq)
            self.metrics.step(out)
            if seq.finished:
                self.metrics.request_finished(seq.finish_reason)
            self.push(self.streams.pop(seq.request_id) if seq.finished else self.streams[seq.request_id], out)

    def fail_all(self, message: str) -> None:
        for request_id, outputs in self.streams.items():
            self.engine.abort(request_id)
            self.metrics.request_finished("error")
            self.push(outputs, EngineError(message, bad_request=False))
        self.streams.clear()

    def push(self, outputs: NewestOutput, item: RequestOutput | EngineError) -> None:
        self.loop.call_soon_threadsafe(outputs.put, item)
