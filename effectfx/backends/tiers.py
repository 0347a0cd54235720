"""Tiered compilation for ``efx.compile(..., backend="inductor")``: tier 1 for the first calls, tier 2 for
the steady state.

Tier 1 (``effectfx.backends.inductor``) compiles each region body once and shares it between call sites:
a fast first call, but nothing fuses across call sites and every body call pays Inductor's prologue.
Tier 2 is the same program with its regions inlined (``effectfx.backends.inline``) -- one root graph per
half of a training program, forward and backward -- lowered by the same lowering, so each half is as few
Inductor segments as its Python nodes allow, and Inductor fuses and plans buffers across layers.

The switch.  A program's :class:`TierState` counts the calls it serves.  Once it has served ``Tiers.after``
calls (by default, once they paid for it: Note [When tier 2 pays]), tier 2 is built: in a background thread
(``mode="background"``, the default), or in the calling thread (``mode="at-once"``: the slow call, for servers
and benchmarks; ``after`` 0 by default, the first call).  The calling thread alone swaps the program, at the
start of a call (:meth:`TierState.program`): a call runs one tier from start to end, and the backward of a
forward run under tier 1 runs tier 1's backward (the autograd node holds the program it ran:
``program.training._RunTraining``).  Both tiers have one calling convention (same inputs, same outputs, same
saved values), so the call that switches and every later one give tier 1's results within Inductor's
tolerance, and the same effect log.  A backward of some outputs only (Note [Partial backward]) runs tier 1's
partial backward on tier 2's saved values (:class:`Tier2Training`).  A tier 2 that fails to build, or whose
segments Inductor could not all compile, is not used: the program stays in tier 1, and ``efx.explain`` says
why.

Note [When tier 2 pays]
~~~~~~~~~~~~~~~~~~~~~~~
Tier 2 costs its build and saves a little on every later call; whether it pays depends on how long the run
goes on, which no compiler knows.  The rule is the ski-rental one: keep renting (tier 1) until the rent paid
equals the price of buying (the build), then buy.  Whatever the run's length, the time lost against the
best choice in hindsight is then at most the build's price -- at most 2x the optimum -- while building at
a fixed call count can lose the whole build on a short run.  By default (``mode="background"``, no
``after``) a program builds its tier 2 once it served 10 calls (the first calls compile tier 1) and the
wall time since its 11th call reaches its price, estimated as twice the Inductor compile seconds of tier 1's
segments of this program (its region bodies' included): tier 2 compiles the same operations, inlined, and a
build in the background costs the loop about its own wall time, which was 1.3-2.1x tier 1's compiles.  A
segment loaded from the cache counts the seconds its compile took in the process that saved it (kept beside
the artifact): a warm process that estimated by its loads (0.1 s) built tier 2 at call 24 and trained 300
steps in 1.16x the time of a cold one.
Measured (GPT-2, 12 layers, AdamW, whole step, one thread, idle 2-core machine; ``benchmarks/tiers.py``):
tier 1's segments compiled in 34 s, tier 2 in 43 s alone and 64-70 s in the background, where it all but
stalled the loop (they share the GIL and the cores); a step takes 17-18 ms in tier 1 and 15 ms in tier 2.
Priced at 1x, a 3,000-step run built tier 2 from step 2,238, switched at 2,950 and trained in 1.51x tier
1's time: the build cost the loop 54 s, which 3 ms a step repays only after some 16,000 steps.  At 2x a
300-step run (5 s of steps) and a 3,000-step one (55 s) stay in tier 1; a longer run switches once its
steps cost the price.  ``after=n`` builds at the n-th call instead (the old rule), ``"at-once"`` at the
first, for servers and benchmarks that know the run is long.

Tier 2 must also be faster, and it is not always: Llama's inference step ran slower in tier 2 than in tier 1
(5.2 ms against 4.3, ``benchmarks/inductor.py``; the same operations, fused across layers).  So after the
default switch, the time from one call's start to the next one's over 5 calls of tier 2 (its first run apart)
is compared with the same over tier 1's last 5 calls before the build; a tier 2 more than 2 % slower goes back
to tier 1 for good, and ``efx.explain`` says so with both figures.  The switch back is a call boundary like
the switch: the calling convention is one.

Tier 2's segments run by Inductor's Python wrapper (the code that allocates buffers and calls the kernels).
``efx.Tiers(cpp_wrapper=True)`` compiles that code as C++ instead: a little faster to run on small models
(GPT-2 hidden 64, 12 layers, forward and backward against torch.compile: 0.92x with it, 0.99x without), but
g++'s build grows with the program.  GPT-2's whole training step with AdamW (12 layers, one segment of about
5,900 nodes) built in 191 s with it against 59 s without on an idle machine, and in 806 s on a loaded one
(``benchmarks/tiers.py``), longer than the 300 steps it was to speed up.  With Python's wrapper that step's
tier 2 ran 0.905x torch.compile's (15.8 against 17.4 ms, interleaved, one thread), so the C++ wrapper is
opt-in.  A segment with symbolic sizes keeps Python's wrapper either way (its C++ wrapper's guards name
Inductor's own symbols: ``inductor._Lowering.segment``).

Effects in tier 2 stay Python nodes, in program order, between Inductor segments -- not fallback calls
inside Inductor's graph ordered by tokens.  The lowering already moves pure work across effects that only
read values (``record``, ``log``), so a per-layer effect costs no segment boundary; inside Inductor an
effect would need torch's effect registry, every key collapsed onto one token chain, and Inductor's
fallback path for each op, for no fusion gained.  Random ops also stay Python nodes (eager's generator, in
eager's order): a model with dropout gets a boundary per dropout in tier 2 too.

The background compile and the training loop share the GIL and, on a small CPU machine, the cores.  A
thread is safe: Inductor's compile state is per thread (tracing context, fake mode) or global and taken
under the one compile lock (``inductor_cache._LOCK``); the switch happens on the calling thread.  Measured
on this 2-core machine (GPT-2, 4 layers, hidden 64, ids (4, 32), one intra-op thread; tier 1 4.4 ms a
step): while tier 2 compiles (12 s), a step takes 9.2 ms (median; mean 16.5 ms), 2x slower; another
process compiling the same tier 2 (a cold cache, its imports included) slows it to 8.8 ms: most of it is
the cores, not the GIL (a shorter switch interval made it worse, a longer one barely better; torch's
``TORCHINDUCTOR_FX_COMPILE_MODE=subprocess`` cannot pickle GPT-2's graph, ``prims.iota``, and compiles
in process).  ``EFFECTFX_TIER2_NICE=10`` runs the build thread (and the compilers it starts) at a lower
priority: a step then takes 4.5 ms (median; mean 7.0 ms) while tier 2 compiles, in 36 s instead of 12 --
fewer steps done by then, so the default is 0: time to train counts, and on a GPU machine the compile
would not compete with the loop.  The compile stops at its next segment when the interpreter exits.

Artifacts: each tier-2 segment is compiled and saved like tier 1's (``effectfx.backends.inductor_cache``).
A process that finds every tier-2 segment saved starts in tier 2 on its first call (``background`` mode).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import BackendError
from ..graph.walk import nested_graphs
from ..passes.pipeline import run_passes
from ..program.program import Program
from ..program.training import TrainingProgram
from . import progress
from .inline import inline_regions

MODES = ("tier1", "background", "at-once")
DEFAULT_AFTER = 10  # calls a program serves before tier 2 may be built in the background (then PRICE)
BACKGROUND_NICE = int(os.environ.get("EFFECTFX_TIER2_NICE", "0"))  # the build thread's (module docstring)
_clock = time.perf_counter  # the time rule's clock (Note [When tier 2 pays]; tests set it)
COMPARED_CALLS = 5  # calls of each tier compared after the switch (Note [When tier 2 pays])
SLOWER = 1.02  # tier 2 slower than tier 1 by more than this: back to tier 1
PRICE = 2.0  # tier 2's price in tier 1's compile seconds (Note [When tier 2 pays]: measured)
_STOP = threading.Event()  # set at exit: a background compile stops at its next segment
atexit.register(_STOP.set)


@dataclass(frozen=True)
class Tiers:
    """How ``efx.compile(..., backend="inductor", tiers=...)`` tiers its programs: ``mode`` "tier1" (only
    tier 1), "background" (tier 2 compiled in a thread once a program served ``after`` calls; by default,
    once it served 10 calls and its calls since the 11th took twice as long as tier 1's compiles of it: Note
    [When tier 2 pays]) or "at-once" (tier 2 compiled in the calling thread once it served ``after`` calls,
    default 0);
    ``cpp_wrapper``: tier 2's segments run by Inductor's C++ wrapper (minutes longer to compile a whole
    training step, a little faster to run; off by default: module docstring)."""

    mode: str = "background"
    after: int | None = None
    cpp_wrapper: bool = False  # Inductor's C++ wrapper for tier 2 (module docstring)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise BackendError(f"tiers mode must be one of {MODES}, not {self.mode!r}.")
        if self.after is not None and (type(self.after) is not int or self.after < 0):
            raise BackendError(f"tiers after must be a number of calls (an int >= 0), not {self.after!r}.")

    @property
    def threshold(self) -> int:
        if self.after is not None:
            return self.after
        return DEFAULT_AFTER if self.mode == "background" else 0

    @property
    def budgeted(self) -> bool:
        """Whether the build waits for the time rule too (Note [When tier 2 pays]): the default background."""
        return self.mode == "background" and self.after is None


def tiers_for(backend: str, tiers: str | Tiers | None) -> Tiers | None:
    """The tiering of a compiled callable: None for a backend without tiers, or ``mode="tier1"``."""
    spec = tiers if isinstance(tiers, Tiers) else Tiers(tiers or "background")
    return spec if backend == "inductor" and spec.mode != "tier1" else None


@dataclass(frozen=True)
class Tier2Training(TrainingProgram):
    """A training program's tier 2: its partial backwards (Note [Partial backward]) are tier 1's, which
    read the same saved values."""

    tier1: TrainingProgram | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.tier1 is not None:
            object.__setattr__(self, "partial", self.tier1.partial)

    def partial_backward(self, live: tuple[bool, ...]) -> tuple[Program, tuple[int, ...]]:
        assert self.tier1 is not None
        return self.tier1.partial_backward(live)


def run_tiered(traced: Any, passes: Sequence[Callable[[Program], Program]], spec: Tiers | None
               ) -> tuple[Any, TierState | None]:
    """``run_passes(traced, passes)`` -- tier 1 --, and with ``spec`` the program's :class:`TierState`,
    which keeps the token-free program (before ``passes``' last, the lowering) to build tier 2 from."""
    if spec is None:
        return run_passes(traced, passes), None
    token_free = run_passes(traced, passes[:-1])
    tier1 = run_passes(token_free, passes[-1:])
    return tier1, TierState(spec, token_free, tier1)


def build_tier2(token_free: Any, tier1: Any, spec: Tiers) -> Any:
    """Tier 2 of a token-free program: regions inlined, lowered; its segments not compiled yet (nor counted
    in the compile log's progress: :meth:`TierState._build` counts them when it compiles them)."""
    from .inductor import lower_to_inductor

    options = {"cpp_wrapper": True} if spec.cpp_wrapper else None

    def lower_tier_2(prog: Program) -> Program:
        """The lowering, every segment compiled on its first run (none deferred); "[tier 2]" in logs."""
        named = prog.replace(name=f"{prog.name} [tier 2]")
        return lower_to_inductor(named, defer=False, options=options).replace(name=prog.name)

    with progress.uncounted():
        prog = run_passes(token_free, [inline_regions, lower_tier_2])
    if isinstance(prog, TrainingProgram):
        fields = {f.name: getattr(prog, f.name) for f in dataclasses.fields(TrainingProgram) if f.init}
        prog = Tier2Training(**fields, tier1=tier1)
    return prog


def segments(prog: Any) -> list[Any]:
    """Every segment of ``prog``'s graphs (both halves; control-flow subgraphs too)."""
    from .inductor_segments import segments_of

    halves = [prog.forward, prog.backward] if isinstance(prog, TrainingProgram) else [prog]
    out = []
    for half in halves:
        nested = nested_graphs(half.graph_module, regions_only=False)
        graphs = [half.graph_module, *(gm for _, _, gm in nested)]
        out.extend(s for gm in graphs for _, s in segments_of(gm))
    return out


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _lower_priority() -> None:
    """Run this thread (and the compilers it starts) at :data:`BACKGROUND_NICE`: the training loop comes
    first.  Linux only, where a thread has a nice value of its own (elsewhere it is the whole process's)."""
    if BACKGROUND_NICE > 0 and sys.platform.startswith("linux"):
        try:
            now = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), max(now, BACKGROUND_NICE))
        except OSError:
            pass


class TierState:
    """One compiled program's tiers: which runs, and tier 2's build (module docstring)."""

    def __init__(self, spec: Tiers, token_free: Any, tier1: Any) -> None:
        self.spec = spec
        self.token_free = token_free
        self.tier1 = tier1
        self.tier = 1
        self.calls = 0
        self.started_call: int | None = None  # the call that started tier 2's build
        self.switched_call: int | None = None  # the first call run by tier 2
        self.wall_seconds = 0.0  # tier 2's build, start to ready
        self.cpu_seconds = 0.0  # the CPU time of the thread that built it (not Inductor's workers)
        self.outcomes: dict[str, int] = {}  # how its segments were made: compiled, loaded, cache hit
        self.error: str | None = None
        self._tier2: Any = None  # built, perhaps not compiled
        self._ready: Any = None  # compiled: the next call switches to it
        self._thread: threading.Thread | None = None
        self._started_at: float | None = None
        self._lock = threading.Lock()  # threads calling one program: one starts the build, one switches
        self._steady_since: float | None = None  # when the program served its threshold-th call
        self._last_start: float | None = None  # when the last call started (the time rule's clock)
        # from one tier-1 call's start to the next's, the last ones before the build
        self._tier1_times: collections.deque[float] = collections.deque(maxlen=COMPARED_CALLS)
        self._tier2_times: list[float] | None = None  # the same of tier 2's first calls, while compared
        self.compared_ms: tuple[float, float] | None = None  # tier 1's and tier 2's calls, compared
        self.budget_s: float | None = None  # tier 2's price, in seconds of calls (Note [When tier 2 pays])

    def program(self, entry: Any) -> Any:
        """The program this call runs (on the calling thread, at the start of the call): tier 2 once it is
        ready, from this call on; it starts tier 2's build when due."""
        now = _clock()
        interval, self._last_start = (None if self._last_start is None else now - self._last_start), now
        if self.tier == 2:
            if interval is not None and self._tier2_times is not None:
                self._compare(entry, interval)
            return entry.program
        with self._lock:
            self.calls += 1
            if interval is not None and self.started_call is None and self.calls > self.spec.threshold + 1:
                self._tier1_times.append(interval)  # (not while tier 2 builds: it slows the calls)
            if self._ready is None and self.started_call is None:
                if self.calls == 1 and self.spec.mode == "background" and self._warm():
                    self._start()
                    self._build()  # every segment is saved: loading them is the first call's work
                elif self.calls > self.spec.threshold and self._paid():
                    self._start()
                    if self.spec.mode == "at-once":
                        self._build()
                    else:
                        self._thread = threading.Thread(target=self._build, daemon=True,
                                                        name=f"effectfx tier 2 of {self.tier1_name!r}")
                        self._thread.start()
            # a background build, however fast, serves from the call after the one that started it
            if self._ready is not None and (self._thread is None or self.started_call != self.calls):
                entry.program, self.tier, self.switched_call = self._ready, 2, self.calls
                progress.LOGGER.info("%r runs tier 2 from call %d", self.tier1_name, self.calls)
                if self.spec.budgeted and len(self._tier1_times) >= COMPARED_CALLS:
                    self._tier2_times = []  # Note [When tier 2 pays]: it must also be faster
            return entry.program

    def _compare(self, entry: Any, interval: float) -> None:
        """Tier 2's calls against tier 1's last ones before the build (the time from one call's start to the
        next one's): a tier 2 slower than tier 1 goes back to tier 1 for good (Note [When tier 2 pays])."""
        times = self._tier2_times
        assert times is not None
        times.append(interval)
        if len(times) < COMPARED_CALLS + 1:  # (the first interval holds tier 2's first run)
            return
        self._tier2_times = None
        tier1, tier2 = _median(self._tier1_times), _median(times[1:])
        self.compared_ms = (tier1 * 1e3, tier2 * 1e3)
        if tier2 > tier1 * SLOWER:
            with self._lock:
                entry.program, self.tier, self._ready = self.tier1, 1, None
                self.error = (f"tier 2 was slower than tier 1 ({tier2 * 1e3:.2f} against {tier1 * 1e3:.2f} "
                              f"ms a call): back to tier 1 from call {self.switched_call + len(times)}")
            progress.LOGGER.info("%r: %s", self.tier1_name, self.error)

    def _paid(self) -> bool:
        """Whether tier 2 is due: at once, unless the time rule applies (Note [When tier 2 pays]): the
        calls since the threshold-th have taken its price, twice tier 1's compile seconds of this program."""
        if not self.spec.budgeted:
            return True
        now = _clock()
        if self._steady_since is None:
            self._steady_since = now
            self.budget_s = PRICE * sum(s.cost_seconds for s in segments(self.tier1))
        return now - self._steady_since >= self.budget_s

    @property
    def tier1_name(self) -> str:
        half = self.tier1.forward if isinstance(self.tier1, TrainingProgram) else self.tier1
        return half.name.removesuffix(" (forward)")

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a background build (at most ``timeout`` seconds); whether tier 2 is ready."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self._ready is not None

    def _start(self) -> None:
        self.started_call = self.calls
        self._started_at = time.perf_counter()
        progress.LOGGER.info("%r: tier 2 started at call %d (%s)", self.tier1_name, self.calls,
                             self.spec.mode)

    def _mark(self) -> Any:
        """The marker an earlier process left when it saved this program's tier 2 (named by tier 1's
        segments and the build's options): without it, a warm start need not build tier 2 to look."""
        from .inductor_cache import mark_path

        return mark_path([(s.source, s.inputs) for s in segments(self.tier1)],
                         f"tier2{'-cpp' if self.spec.cpp_wrapper else ''}")

    def _warm(self) -> bool:
        """Whether every tier-2 segment is saved (a warm process): builds tier 2 to find out, where an
        earlier process marked it saved (a program that never built its tier 2 costs no build)."""
        from .inductor_cache import is_cached

        try:
            if not self._mark().exists():
                return False
            self._tier2 = self._tier2 or build_tier2(self.token_free, self.tier1, self.spec)
            return all(is_cached(s.source, s.inputs, s.hints) for s in segments(self._tier2))
        except Exception:  # noqa: BLE001 -- the build says why, when it runs
            return False

    def _build(self) -> None:
        if threading.current_thread() is self._thread:
            _lower_priority()
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            prog = self._tier2 = self._tier2 or build_tier2(self.token_free, self.tier1, self.spec)
            for segment in segments(prog):
                progress.lowered(segment)
            for segment in segments(prog):
                if _STOP.is_set():
                    self.error = "stopped at exit"
                    return
                segment.compiled  # noqa: B018 -- compiles it, or loads it
                self.outcomes[segment.outcome] = self.outcomes.get(segment.outcome, 0) + 1
            fell = [s for s in segments(prog) if s.outcome == "fell back"]
            if fell:
                self.error = f"{len(fell)} segment(s) fell back ({fell[0].why}): tier 1 is faster"
            else:
                self._ready = prog
                self._save_mark()
        except Exception as e:  # noqa: BLE001 -- tier 2 is an optimization: any failure keeps tier 1
            self.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        finally:
            self.wall_seconds = time.perf_counter() - (self._started_at or start)
            self.cpu_seconds = time.thread_time() - cpu
            self.token_free = None if self._ready is not None else self.token_free  # done with it
            progress.LOGGER.info("%r: tier 2 %s in %.2f s (%.2f s CPU)", self.tier1_name,
                                 "ready" if self._ready is not None else f"not used: {self.error}",
                                 self.wall_seconds, self.cpu_seconds)

    def _save_mark(self) -> None:
        try:
            mark = self._mark()
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()
        except OSError:  # a read-only cache: the next process builds tier 2 to look, as before
            pass

    def describe(self) -> str:
        """What ``efx.explain`` says of the program's tiers."""
        if self.tier == 2:
            made = ", ".join(f"{n} {how}" for how, n in sorted(self.outcomes.items()))
            faster = "" if self.compared_ms is None else (
                f"; {self.compared_ms[1]:.2f} ms a call against tier 1's {self.compared_ms[0]:.2f}")
            return (f"tier 2 (regions inlined) since call {self.switched_call}; built from call "
                    f"{self.started_call} ({self.spec.mode}) in {self.wall_seconds:.2f} s "
                    f"({self.cpu_seconds:.2f} s CPU of its thread); segments: {made or 'none'}{faster}")
        if self.error is not None:
            return f"tier 1 (each region body compiled once); tier 2 not used: {self.error}"
        if self.started_call is not None:
            waited = time.perf_counter() - (self._started_at or 0.0)
            state = "ready, used from the next call" if self._ready is not None else f"for {waited:.1f} s"
            return (f"tier 1 (each region body compiled once); tier 2 building since call "
                    f"{self.started_call}, {state}")
        if self.budget_s is not None:
            served = _clock() - (self._steady_since or 0.0)
            return (f"tier 1 (each region body compiled once); tier 2 once its calls since call "
                    f"{self.spec.threshold + 1} take {self.budget_s:.1f} s, twice tier 1's compile time "
                    f"({served:.1f} s so far, {self.calls} calls; background)")
        return (f"tier 1 (each region body compiled once); tier 2 after {self.spec.threshold} calls "
                f"({self.calls} so far, {self.spec.mode})")
