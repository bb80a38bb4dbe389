"""compile: auto's verdicts from measured seconds (distmis.train.compile_choice), on a fake clock: the torch trainer's
decide_compile and the Keras trainer's XlaProbe, which measures XLA on the trial's own steps or decides from an earlier
trial's measurement in the cache."""

from __future__ import annotations

from distmis.train.compile_choice import (
    CompileChoice, XlaProbe, cached_compile, compile_cache_entry, decide_compile,
)


def test_decide_compile_takes_a_faster_step_whose_saving_repays_the_compilation():
    seconds = {"eager": 1.0, "compiled": 0.5, "compiling": 30.0}
    assert decide_compile(seconds, 100, "measured") == CompileChoice(True, "measured", seconds)
    assert not decide_compile(seconds, 50, "measured").compiled  # saves 25 s of a 30 s compilation
    slower = {"eager": 1.0, "compiled": 0.99, "compiling": 0.0}
    assert "not 1.05x faster" in decide_compile(slower, 10_000, "cached").reason


def run(probe: XlaProbe, epochs: list[list[float]], steps_per_epoch: int, total_epochs: int) -> list[str]:
    """Steps of the given seconds through ``probe`` as a trainer calls it; the phase each step ran in."""
    phases = []
    for epoch, steps in enumerate(epochs, start=1):
        later = steps_per_epoch * (total_epochs - epoch)
        for step, seconds in enumerate(steps):
            phases.append(probe.phase)
            probe.observe(seconds, later + steps_per_epoch - step - 1)
        probe.end_epoch(later)
    return phases


def test_a_short_trial_is_not_measured_and_keeps_its_graph():
    probe = XlaProbe()
    phases = run(probe, [[3.0, 0.1, 0.1, 0.1]], steps_per_epoch=4, total_epochs=10)  # 36 steps of 0.1 s left
    assert phases == ["graph"] * 4 and probe.done and probe.phase == "graph"
    assert probe.choice.source == "not measured" and not probe.choice.compiled
    assert probe.choice.seconds == {"eager": 0.1} and "shorter than 600 s" in probe.choice.reason


def test_a_long_trial_measures_xla_on_its_next_steps_and_keeps_the_faster():
    faster = XlaProbe()  # 1000 epochs of 10 steps of 1 s: XLA's steps of 0.5 s after a 20 s compilation
    phases = run(faster, [[5.0] + [1.0] * 9, [20.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]],
                 steps_per_epoch=10, total_epochs=1000)
    assert phases == ["graph"] * 10 + ["xla"] * 10  # the first epoch times the graph, the rest run XLA
    assert faster.choice == CompileChoice(True, "measured", {"eager": 1.0, "compiled": 0.5, "compiling": 20.0})

    slower = XlaProbe()  # XLA's CPU step 16x slower: decided on its first steady step, the graph again
    phases = run(slower, [[5.0] + [1.0] * 9, [40.0, 16.0, 1.0, 1.0]], steps_per_epoch=10, total_epochs=1000)
    assert phases == ["graph"] * 10 + ["xla", "xla", "graph", "graph"]
    assert slower.choice.source == "measured" and not slower.choice.compiled
    assert slower.choice.seconds == {"eager": 1.0, "compiled": 16.0, "compiling": 24.0}


def test_an_xla_compilation_that_fails_leaves_the_graph_and_says_why():
    probe = XlaProbe(min_training_seconds=1.0)
    run(probe, [[2.0, 0.5, 0.5]], steps_per_epoch=3, total_epochs=10)
    assert probe.phase == "xla" and not probe.done
    probe.fell_back("InvalidArgumentError: no XLA kernel")
    assert probe.phase == "graph" and probe.done
    assert probe.choice == CompileChoice(False, "fell back", {"eager": 0.5}, "InvalidArgumentError: no XLA kernel")
    probe.observe(9.0, 10)  # nothing changes after a verdict
    assert probe.choice.source == "fell back"


def test_an_epoch_of_its_trace_alone_waits_for_the_next_epochs_steps():
    probe = XlaProbe(min_training_seconds=1.0)
    probe.observe(4.0, 1000)  # an epoch of one step: the trace, nothing timed yet
    probe.end_epoch(1000)
    assert probe.phase == "graph" and not probe.done
    probe.observe(0.2, 999)  # the next epoch's step times the graph
    probe.end_epoch(999)
    assert probe.phase == "xla"


def test_a_measured_verdict_is_cached_and_decides_the_next_trial_for_its_own_steps_without_measuring():
    first = XlaProbe()
    run(first, [[5.0] + [1.0] * 9, [20.5] + [0.5] * 9], steps_per_epoch=10, total_epochs=1000)
    assert first.measured and first.choice.compiled
    entry = compile_cache_entry(first.choice)
    assert entry == {"seconds": {"eager": 1.0, "compiled": 0.5, "compiling": 20.0}}

    long_trial = XlaProbe(cached=entry)  # XLA from its second epoch on, never measured again
    phases = run(long_trial, [[5.0] + [1.0] * 9, [20.5] + [0.5] * 9], steps_per_epoch=10, total_epochs=1000)
    assert phases == ["graph"] * 10 + ["xla"] * 10 and long_trial.done and not long_trial.measured
    assert long_trial.choice == CompileChoice(True, "cached", entry["seconds"])
    # a trial with 30 steps left saves 15 s, less than the 20 s compilation: the graph, below any threshold too
    short_trial = XlaProbe(cached=entry, min_training_seconds=0.0)
    phases = run(short_trial, [[5.0] + [1.0] * 9, [1.0] * 10], steps_per_epoch=10, total_epochs=4)
    assert phases == ["graph"] * 20 and short_trial.choice.source == "cached" and not short_trial.choice.compiled
    assert "save 15 s, less than the compilation's 20 s" in short_trial.choice.reason


def test_a_cached_failure_keeps_the_graph_and_an_entry_of_another_kind_is_measured_again():
    failed = XlaProbe(min_training_seconds=1.0)
    run(failed, [[2.0, 0.5, 0.5]], steps_per_epoch=3, total_epochs=10)
    failed.fell_back("InvalidArgumentError: no XLA kernel")
    entry = compile_cache_entry(failed.choice)
    assert entry == {"seconds": {"eager": 0.5}, "error": "InvalidArgumentError: no XLA kernel"}
    again = XlaProbe(cached=entry, min_training_seconds=1.0)
    assert run(again, [[2.0, 0.5, 0.5], [0.5] * 3], steps_per_epoch=3, total_epochs=10) == ["graph"] * 6
    assert again.choice == failed.choice and not again.measured  # no XLA step tried
    assert compile_cache_entry(CompileChoice(False, "not measured", {"eager": 0.5}, "short")) is None
    assert compile_cache_entry(CompileChoice(True, "set")) is None
    for unusable in (None, {}, {"seconds": {"eager": 1.0}}, {"seconds": "1.0"}):
        assert cached_compile(unusable, 100) is None, unusable
    probe = XlaProbe(cached={"seconds": {"eager": 1.0}}, min_training_seconds=1.0)  # measured as if none
    run(probe, [[2.0, 0.5, 0.5]], steps_per_epoch=3, total_epochs=10)
    assert probe.phase == "xla"
