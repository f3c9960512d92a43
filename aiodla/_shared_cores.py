"""DLA cores and the engines on them: :class:`Cores`, opened once.

Every engine runs on a ``Cores``: ``Engine(model, cores=[0, 1])`` makes a private one
(as an HTTP client makes its own connection pool), ``Engine(model, cores=dla)`` joins
one the application shares between engines.

``async with aiodla.Cores([0, 1]) as dla:`` owns what the engines on it share: the
runtime, one record per physical core (``_core_record``: the tasks it holds of every
engine and when it should finish them), one poller thread that sees every engine's
completions, and one dispatcher (``_dispatch``) whose one decision, after every change,
says which engine's request goes next on which core: by priority, by weight, by each
model's own service-time estimate. Every ``Engine(model, cores=dla)`` opened on it
loads its model there (a device handle and a module per core: see ``docs/design.md``)
and keeps its own requests, slots, statistics and health.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import anyio

from ._core_record import CoreRecord
from ._device import CompletionSource
from ._dispatch import Dispatcher
from ._errors import AiodlaError, ConfigurationError, EngineClosedError
from ._local_device import read_model, release_runtime
from ._options import DEFAULT_TRACE_CAPACITY, EngineOptions
from ._poller import SharedPoller
from ._slots import completion_probe
from ._trace import CoresTracing, cores_trace
from .runtime._protocol import Runtime
from .runtime._select import select_runtime

if TYPE_CHECKING:
    import os

__all__ = ["CoreSet", "Cores", "CoresState", "shared_cores"]


class CoresState(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class Closeable(Protocol):
    async def aclose(self) -> None: ...


class Cores:
    """DLA cores shared by several engines, opened once as an async context manager.

    ``cores``: the DLA core numbers (Orin has 0 and 1). ``runtime``: as for
    :class:`~aiodla.Engine` (``"auto"`` picks it for the first model opened here), and
    ``trust_compute`` for the emulated runtime made here. Engines take it as their
    cores, with a priority and a weight::

        async with aiodla.Cores([0, 1]) as dla:
            async with (
                aiodla.Engine("det.bin", cores=dla, priority=1) as detector,
                aiodla.Engine("cls.bin", cores=dla, weight=2) as classifier,
            ):
                ...

    ``dla.subset([1])`` puts an engine on some of the cores only. An engine keeps its
    own ``streams_per_core`` here too; engines of one priority fill a core up to the
    smallest ring among them, so that weights decide (``streams_per_core=4`` queues
    more work on each core: see ``aiodla._dispatch``). Closing the cores closes the
    engines still open on them first.
    """

    def __init__(
        self,
        cores: Iterable[int] = (0, 1),
        *,
        runtime: str | Runtime = "auto",
        trust_compute: bool = False,
    ) -> None:
        self._numbers = EngineOptions.from_keywords(
            {"cores": cores}
        ).cores  # (checked as an engine's are)
        if not isinstance(trust_compute, bool):
            raise ConfigurationError(f"trust_compute={trust_compute!r} must be a bool")
        self._choice = runtime
        self._trust_compute = trust_compute
        # A lone engine's own cores (see ``private``): no runtime is chosen here.
        self._private = False
        self._runtime: Runtime | None = None  # chosen with the first model opened here
        self._owns_runtime = False
        self._choosing: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._engines: dict[int, Closeable] = {}  # open engines, by id (closed with us)
        self._in_process: dict[int, Callable[[BaseException], None]] = {}  # their deaths
        self.state = CoresState.NEW
        # One record per physical core, written by _core_record alone; the engines'
        # lanes on a core all point to it.
        self.records = {number: CoreRecord(number) for number in self._numbers}
        self.dispatcher = Dispatcher(self.records)
        self._poller: SharedPoller | None = None  # started with the first engine in-process

    @classmethod
    def private(cls, numbers: tuple[int, ...]) -> Cores:
        """The cores of one engine alone (``Engine(model, cores=[0, 1])``), opened and
        closed with it. Their runtime is the engine's: its device layer makes it from
        the engine's own choice and closes it, as a lone engine's always did."""
        cores = cls(numbers)
        cores._private = True
        return cores

    @property
    def is_private(self) -> bool:
        """Whether these are one lone engine's own cores (made by the engine)."""
        return self._private

    @property
    def cores(self) -> tuple[int, ...]:
        return self._numbers

    @property
    def runtime(self) -> Runtime:
        """The runtime the engines here share (chosen when the first one opens)."""
        if self._runtime is None:
            raise EngineClosedError("no engine has opened on these cores: no runtime yet")
        return self._runtime

    def __iter__(self) -> Iterator[int]:
        """The core numbers (so ``Engine(cores=dla)`` reads as ``cores=[0, 1]`` does)."""
        return iter(self._numbers)

    def subset(self, cores: Iterable[int]) -> CoreSet:
        """Some of these cores, for an engine that should use only them."""
        numbers = EngineOptions.from_keywords({"cores": cores}).cores
        outside = sorted(set(numbers) - set(self._numbers))
        if outside:
            raise ConfigurationError(
                f"core(s) {outside} are not among these shared cores {list(self._numbers)}"
            )
        return CoreSet(self, numbers)

    async def __aenter__(self) -> Cores:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        if self.state is not CoresState.NEW:
            raise AiodlaError(f"the cores are {self.state.value}; open them once")
        self._loop = asyncio.get_running_loop()
        self._choosing = asyncio.Lock()
        self.state = CoresState.OPEN

    async def aclose(self) -> None:
        """Close every engine still open here, then the runtime if it was made here.
        Idempotent."""
        if self.state in (CoresState.CLOSING, CoresState.CLOSED):
            return
        self.state = CoresState.CLOSING
        try:
            await asyncio.gather(*(engine.aclose() for engine in list(self._engines.values())))
        finally:
            poller, self._poller = self._poller, None
            if poller is not None:
                poller.stop()
                await anyio.to_thread.run_sync(poller.join)
            runtime, self._runtime = self._runtime, None
            if runtime is not None and self._owns_runtime:
                await anyio.to_thread.run_sync(release_runtime, runtime)
            self.state = CoresState.CLOSED

    # -- engines ----------------------------------------------------------------------------

    async def runtime_for(
        self, model: str | os.PathLike[str] | bytes | bytearray | memoryview, options: EngineOptions
    ) -> str | Runtime:
        """What an engine opening here passes as its runtime: the shared one (chosen
        now for the first model), or its name for an engine whose runtime lives in a
        worker process. Raises before anything opens when the cores cannot take it."""
        self.check_open()
        if asyncio.get_running_loop() is not self._loop:
            raise AiodlaError("an engine opens on shared cores from the cores' own event loop")
        if options.trust_compute:
            raise ConfigurationError(
                "trust_compute applies to the runtime of the shared cores: "
                "aiodla.Cores(..., trust_compute=True)"
            )
        if options.process_isolation is not None:
            if not isinstance(self._choice, str):
                raise ConfigurationError(
                    "isolation='process' on shared cores needs the runtime by name "
                    "(aiodla.Cores(runtime='auto' | 'cuda' | 'emulated'))"
                )
            return self._choice
        assert self._choosing is not None  # (set when opened)
        async with self._choosing:  # engines opening at once share the first choice
            if self._runtime is None:
                data = await anyio.to_thread.run_sync(read_model, model)
                runtime, owned = select_runtime(
                    self._choice, data, trust_compute=self._trust_compute
                )
                self.check_open()  # (closed meanwhile: nothing may stay open)
                self._runtime, self._owns_runtime = runtime, owned
            return self._runtime

    def check_open(self) -> None:
        if self.state is not CoresState.OPEN:
            raise EngineClosedError(
                f"the shared cores are {self.state.value}: "
                "open them first ('async with aiodla.Cores(...) as dla')"
            )

    def attach(self, engine: Closeable, die: Callable[[BaseException], None] | None) -> None:
        """An engine opening here; ``die`` kills it when the CUDA context it shares is
        lost (None for an engine whose runtime lives in a worker process)."""
        self.check_open()
        self._engines[id(engine)] = engine
        if die is not None:
            self._in_process[id(engine)] = die

    def detach(self, engine: Closeable) -> None:
        self._engines.pop(id(engine), None)
        self._in_process.pop(id(engine), None)

    def context_lost(self, engine: Closeable, cause: BaseException) -> None:
        """An engine in this process died: the CUDA context under every engine of this
        process here is lost with it (their requests would wait for cores that its
        stuck tasks hold), so they die too, with the same cause."""
        if id(engine) not in self._in_process:
            return
        self._lose_context(cause)

    def _lose_context(self, cause: BaseException) -> None:
        for die in list(self._in_process.values()):
            die(cause)

    def poller_share(
        self, runtime: Runtime, lanes: list[Any], priority: int
    ) -> Callable[[Any], CompletionSource]:
        """How an engine in this process whose lanes on the cores are ``lanes`` takes
        its completions: from the cores' one poller thread (started with the first, on
        ``runtime``: the cores' own, or a lone engine's)."""
        poller = self._poller
        if poller is None:
            assert self._loop is not None  # (open: an engine opens only then)
            poller = self._poller = SharedPoller(
                completion_probe(runtime),
                self._loop,
                self._lose_context,
                pause=runtime.poll_pause,
                private=self._private,
            )

        def share(flow: Any) -> CompletionSource:
            return poller.share(flow, lanes, priority)

        return share

    def abandon(self) -> None:
        """The cores' engine (a lone engine's own cores) was collected unclosed: stop the
        poller thread, without waiting."""
        poller = getattr(self, "_poller", None)
        if poller is not None:
            poller.stop()

    def __del__(self) -> None:
        # Dropped unclosed: its poller thread must not outlive it (the engines on it
        # were closed, or hold it alive).
        self.abandon()

    @property
    def pollers(self) -> int:
        """Poller threads running for the engines here (one at most)."""
        return 0 if self._poller is None or not self._poller.poller.alive else 1

    def trace(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        names: Mapping[Any, str] | None = None,
        capacity: int = DEFAULT_TRACE_CAPACITY,
    ) -> CoresTracing:
        """Record every engine open here on one timeline, in an ``async with`` block:
        ``async with dla.trace("run.json", names={detector: "detector"}):``. Each engine
        is a process of the file with its own tracks, named after it (``names``, else
        its model's file stem); written on leaving the block (see ``engine.trace()``).
        Engines that open during the block are not in it."""
        self.check_open()
        return cores_trace(list(self._engines.values()), path, names=names, capacity=capacity)

    @property
    def engines(self) -> int:
        """How many engines are open here."""
        return len(self._engines)

    def shares(self) -> dict[int, tuple[int, float]]:
        """Per engine (by its order of opening): tasks granted and the core time they
        cost, by the engine's own estimates."""
        return {c.order: (c.grants, c.granted_time) for c in self.dispatcher.clients}

    def __repr__(self) -> str:
        held = ", ".join(f"{n}: {r.held} held" for n, r in self.records.items())
        return f"<aiodla.Cores {self.state.value} [{held}] engines={len(self._engines)}>"


class CoreSet:
    """Some of a :class:`Cores`' cores, for ``Engine(model, cores=dla.subset([1]))``."""

    def __init__(self, shared: Cores, numbers: tuple[int, ...]) -> None:
        self.shared = shared
        self.numbers = numbers

    def __iter__(self) -> Iterator[int]:
        return iter(self.numbers)

    def __repr__(self) -> str:
        return f"<aiodla.CoreSet {list(self.numbers)} of {self.shared!r}>"


def shared_cores(options: dict[str, Any], runtime: object) -> tuple[dict[str, Any], Cores | None]:
    """``Engine``'s keywords with ``cores=`` a shared :class:`Cores` (or a subset)
    turned into its core numbers, and that :class:`Cores`; else as they came, and None
    (the engine makes cores of its own). ``runtime``: the engine's own choice, which
    shared cores make for it. The engine's options stay as the caller gave them."""
    cores = options.get("cores")
    if isinstance(cores, Cores):
        shared, numbers = cores, cores.cores
    elif isinstance(cores, CoreSet):
        shared, numbers = cores.shared, cores.numbers
    else:
        return options, None
    if runtime != "auto":
        raise ConfigurationError(
            f"runtime={runtime!r}: an engine on shared cores uses theirs; "
            "pass it to aiodla.Cores(..., runtime=...)"
        )
    if shared.state in (CoresState.CLOSING, CoresState.CLOSED):
        shared.check_open()
    return {**options, "cores": numbers}, shared
