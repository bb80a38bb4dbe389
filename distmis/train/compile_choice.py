"""Whether a trial's training step runs compiled, decided from measured seconds: what the torch trainer
(``torch.compile``, :mod:`distmis.train.step_settings`) and the Keras trainer (XLA's ``jit_compile``,
:class:`XlaProbe`) share. No framework is imported here.

A compilation costs its time once and pays off over many steps: it is taken where the compiled step measures at
least :data:`MARGIN` faster than the uncompiled one and the time it saves over the trial's planned steps exceeds the
compilation's (:func:`decide_compile`). A trial whose planned training is shorter than
:data:`COMPILE_MIN_TRAINING_SECONDS` is not measured at all. A measurement is cached
(:class:`~distmis.train.choice_cache.ChoiceCache`, as :func:`compile_cache_entry` writes it): the next trial of the
same step decides from it for its own planned steps (:func:`cached_compile`), whatever their length.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["MARGIN", "COMPILE_MIN_TRAINING_SECONDS", "CompileChoice", "decide_compile", "cached_compile",
           "compile_cache_entry", "XlaProbe"]

#: how much faster than the current step another setting must measure to be taken (timing noise is a few %)
MARGIN = 1.05
#: the shortest planned training (its steps at the uncompiled step's measured seconds) for which ``compile: auto``
#: measures compilation: below it a compilation of tens of seconds is not repaid
COMPILE_MIN_TRAINING_SECONDS = 600.0


@dataclass(frozen=True)
class CompileChoice:
    """Whether a trial's training step runs compiled; ``seconds``: what was measured (``eager`` and ``compiled``
    step seconds, ``compiling``: the first compiled step's seconds beyond a steady one; for a Keras trial ``eager``
    is its traced graph's step); ``source``: ``set`` (the spec's), ``measured``, ``cached``, ``not measured``
    (``reason`` says why) or ``fell back`` (the network did not compile: ``reason``, the error)."""

    compiled: bool
    source: Literal["set", "measured", "cached", "not measured", "fell back"]
    seconds: dict[str, float] = field(default_factory=dict)
    reason: str = ""

    def metrics(self) -> dict[str, float]:
        """What the trial logs of it: ``compiled`` (1 or 0) and the measured seconds (``compile_step_seconds_eager``,
        ``compile_step_seconds_compiled``, ``compile_seconds``)."""
        names = {"eager": "compile_step_seconds_eager", "compiled": "compile_step_seconds_compiled",
                 "compiling": "compile_seconds"}
        return {"compiled": float(self.compiled),
                **{names[name]: value for name, value in self.seconds.items() if name in names}}


def decide_compile(seconds: dict[str, float], planned_steps: int, source: Literal["measured", "cached"]
                   ) -> CompileChoice:
    """Compiled where the compiled step is at least :data:`MARGIN` faster than the eager one and the time it saves
    over ``planned_steps`` exceeds the compilation's (``seconds``: ``eager``, ``compiled``, ``compiling``)."""
    eager, compiled, compiling = seconds["eager"], seconds["compiled"], seconds["compiling"]
    saved = (eager - compiled) * planned_steps
    if compiled * MARGIN > eager:
        return CompileChoice(False, source, seconds, f"the compiled step ({compiled:.3g} s) is not {MARGIN:g}x faster "
                                                      f"than the eager one ({eager:.3g} s)")
    if saved <= compiling:
        return CompileChoice(False, source, seconds, f"{planned_steps} steps save {saved:.0f} s, less than the "
                                                      f"compilation's {compiling:.0f} s")
    return CompileChoice(True, source, seconds)


def compile_cache_entry(choice: CompileChoice) -> dict[str, Any] | None:
    """What :class:`~distmis.train.choice_cache.ChoiceCache` keeps of a measured choice (its seconds, and the error
    of a compilation that failed); None for one that was set or not measured."""
    if choice.source == "measured":
        return {"seconds": choice.seconds}
    if choice.source == "fell back":
        return {"seconds": choice.seconds, "error": choice.reason}
    return None


def cached_compile(entry: dict[str, Any] | None, planned_steps: int) -> CompileChoice | None:
    """The verdict of a cached measurement (:func:`compile_cache_entry`'s) for a trial of ``planned_steps`` more
    steps (:func:`decide_compile`'s, from the cached seconds), or the cached failure; None where the entry holds
    neither."""
    if entry is None or not isinstance(entry.get("seconds"), dict):
        return None
    seconds = {str(name): float(value) for name, value in entry["seconds"].items()}
    if entry.get("error"):
        return CompileChoice(False, "fell back", seconds, str(entry["error"]))
    if {"eager", "compiled", "compiling"} <= set(seconds):
        return decide_compile(seconds, planned_steps, "cached")
    return None


class XlaProbe:
    """``compile: auto`` for a Keras trial of one replica, measured on the trial's own training steps: nothing is
    run twice and no copy of the model is made.

    The first epoch trains the traced graph; its steps but the first (the trace) give the graph's step seconds. If
    the trial's remaining planned steps at that rate reach ``min_training_seconds``, the next steps run XLA's
    compiled step (``jit_compile``): the first of them is the compilation, the next ``repeats`` its steady
    seconds (a first steady step over twice the graph's decides at once); then :func:`decide_compile` keeps XLA, or
    the graph step for the rest of the trial. Those steps train
    as any other (XLA computes the same step, its round-off aside). ``phase`` tells the trainer which step to call:
    ``graph`` or ``xla``; :meth:`observe` is given each step's seconds and the steps still planned after it.

    ``cached``: an earlier trial's measurement of the same step (:func:`compile_cache_entry`'s); the first epoch's
    end then decides from it (:func:`cached_compile`, for this trial's steps left) and nothing is measured.
    ``measured`` turns true when this probe's own verdict is in, for the trainer to cache.
    """

    def __init__(self, *, repeats: int = 3, min_training_seconds: float | None = None,
                 cached: dict[str, Any] | None = None) -> None:
        self.repeats = repeats
        self.cached = cached
        self.min_training_seconds = (COMPILE_MIN_TRAINING_SECONDS if min_training_seconds is None
                                     else min_training_seconds)
        self.phase: Literal["graph", "xla"] = "graph"
        self.choice = CompileChoice(False, "not measured", reason="not measured yet: the first epoch's steps time "
                                                                  "the traced graph")
        self._graph: list[float] = []
        self._xla: list[float] = []
        self._steps = 0
        self.done = False
        self.measured = False

    def observe(self, seconds: float, steps_left: int) -> None:
        """Take one training step's ``seconds`` (in the current ``phase``); ``steps_left``: the trial's planned
        steps after it."""
        if self.done:
            return
        self._steps += 1
        if self.phase == "graph":
            if self._steps > 1:  # the first call traced the graph
                self._graph.append(seconds)
            return
        self._xla.append(seconds)
        graph = statistics.median(self._graph)
        # a first steady XLA step twice the graph's is a verdict already (XLA's CPU step measured 16x slower)
        if len(self._xla) > self.repeats or (len(self._xla) == 2 and self._xla[1] > 2 * graph):
            steady = statistics.median(self._xla[1:])
            measured = {"eager": graph, "compiled": steady,
                        "compiling": max(self._xla[0] - steady, 0.0)}
            self.choice = decide_compile(measured, steps_left, "measured")
            self.phase = "xla" if self.choice.compiled else "graph"
            self.done = self.measured = True

    def end_epoch(self, steps_left: int) -> None:
        """After an epoch in the graph phase: measure XLA from the next step where the ``steps_left`` planned steps
        at the graph's rate reach the threshold; otherwise the graph for good."""
        if self.done or self.phase != "graph":
            return
        cached = cached_compile(self.cached, steps_left)
        if cached is not None:
            self.choice = cached
            self.phase = "xla" if cached.compiled else "graph"
            self.done = True
            return
        if not self._graph:  # an epoch of one step: its trace alone; the next epoch's steps time it
            return
        graph = statistics.median(self._graph)
        planned = graph * steps_left
        if planned < self.min_training_seconds or steps_left <= self.repeats + 1:
            self.choice = CompileChoice(False, "not measured", {"eager": graph},
                                        f"the planned training left ({steps_left} steps of {graph:.3g} s) is shorter "
                                        f"than {self.min_training_seconds:.0f} s: a compilation would not be repaid")
            self.done = True
            return
        self.phase = "xla"

    def fell_back(self, error: str) -> None:
        """XLA's compilation failed: the graph for good, and why."""
        self.choice = CompileChoice(False, "fell back", {"eager": statistics.median(self._graph)} if self._graph
                                    else {}, error)
        self.phase = "graph"
        self.done = self.measured = True
