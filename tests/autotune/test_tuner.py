"""The tuner end to end on tiny workloads: every template config computes the right answer,
faulty candidates become error records while the session goes on, a session resumes from its
log without re-measuring, and builds apply the best records (and only the valid ones)."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core.autotune import search
from compiler_core.autotune.features import FEATURE_SET
from compiler_core.autotune.measure import MeasureOptions, Measurer
from compiler_core.autotune.records import FileLog, TuningRecord
from compiler_core.autotune.search import Tuner
from compiler_core.autotune.tasks import ALGORITHM, config_key, extract_tasks
from compiler_core.build import lower_group
from compiler_core.codegen.native import compiler_driver
from compiler_core.frontend.onnx import import_model
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.target import parse_target
from tests.conftest import FLOAT, assert_close_to_scale, make_model, pairwise_cover

RNG = np.random.default_rng(0)
W1 = RNG.standard_normal((64, 48)).astype(np.float32)
B1 = RNG.standard_normal(48).astype(np.float32)
CONV_W = (RNG.standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32)


def dense_model():
    nodes = [
        helper.make_node("Gemm", ["x", "w", "b"], ["y"]),
        helper.make_node("Relu", ["y"], ["z"]),
    ]
    return make_model(nodes, [("x", FLOAT, [6, 64])], [("z", FLOAT, [6, 48])], {"w": W1, "b": B1})


def conv_model():
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["z"]),
    ]
    return make_model(
        nodes, [("x", FLOAT, [1, 16, 6, 6])], [("z", FLOAT, [1, 16, 6, 6])], {"w": CONV_W}
    )


@pytest.fixture(scope="module")
def target():
    return parse_target("llvm")


@pytest.fixture(scope="module")
def measurer(target):
    with Measurer(target, MeasureOptions(repeats=2, min_repeat_seconds=0.001)) as m:
        yield m


def tasks_of(model):
    return extract_tasks(optimize(import_model(model)))


def test_one_measurer_checks_two_models_that_share_a_workload_against_their_own_weights(
    measurer,
):
    """Two models with the same dense workload (one key) and other weights: each one's
    candidates are checked against a reference computed on its own weights."""
    other = make_model(
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"]), helper.make_node("Relu", ["y"], ["z"])],
        [("x", FLOAT, [6, 64])],
        [("z", FLOAT, [6, 48])],
        {"w": -W1, "b": B1 + 1.0},
    )
    (first,), (second,) = tasks_of(dense_model()), tasks_of(other)
    assert first.key == second.key
    for task in (first, second):
        results = measurer.measure(task, task.space()[:2])
        assert [r.error for r in results] == ["ok", "ok"], results


def test_a_pairwise_cover_holds_every_pair_of_knob_values():
    space = [{"a": a, "b": b, "c": c} for a in range(3) for b in range(3) for c in range(2)]
    cover = pairwise_cover(space)
    assert cover[0] == space[0] and len(cover) < len(space)
    for x, y in (("a", "b"), ("a", "c"), ("b", "c")):
        assert {(c[x], c[y]) for c in cover} == {(c[x], c[y]) for c in space}


@pytest.mark.parametrize("model", [dense_model, conv_model], ids=["dense", "conv2d_nchwc"])
def test_every_pair_of_knob_values_computes_the_reference_answer(model, measurer):
    """Every pair of knob values of each template (and so every value) on a small workload:
    the whole space measured took 89 s of the suite on an AVX2 host, its pairwise cover a
    fraction of it."""
    tasks = tasks_of(model())
    assert tasks, "the model has a tunable group"
    for task in tasks:
        space = task.space()
        assert space[0] == task.default_config() and len(space) > 1
        configs = pairwise_cover(space)
        results = measurer.measure(task, configs)
        errors = [(c, r) for c, r in zip(configs, results, strict=True) if r.error != "ok"]
        assert not errors, errors[:3]
        assert all(r.costs and min(r.costs) > 0 for r in results)


FAULTY_KERNELS = {
    "out_of_bounds": "void k(float *x, float *y) { volatile float *p = 0; p[1 << 20] = 1; }",
    "forever": "void k(float *x, float *y) { volatile int i = 0; for (;;) i++; }",
    "wrong": "void k(float *x, float *y) { for (int i = 0; i < 4; i++) y[i] = x[i] + 1; }",
    "right": "void k(float *x, float *y) { for (int i = 0; i < 4; i++) y[i] = x[i]; }",
}


def faulty_library(tmp_path: Path, name: str) -> Path:
    source = tmp_path / f"{name}.c"
    source.write_text(FAULTY_KERNELS[name])
    library = tmp_path / f"{name}.so"
    command = [compiler_driver(), "-shared", "-fPIC", "-O0", "-o", str(library), str(source)]
    subprocess.run(command, check=True)
    return library


def test_faulty_candidates_are_recorded_as_errors_and_the_runner_goes_on(tmp_path, target):
    buffer = types.SimpleNamespace(shape=(4,), dtype="float32")
    func = types.SimpleNamespace(name="k", params=(buffer, buffer))
    lowered = types.SimpleNamespace(func=func, inputs=["x"], packed={}, outputs=["y"])
    options = MeasureOptions(repeats=1, min_repeat_seconds=0.0, timeout=3.0)
    with Measurer(target, options) as measurer:
        reference = tmp_path / "reference.npz"
        right = faulty_library(tmp_path, "right")
        assert measurer._run(lowered, right, save_output=reference).error == "ok"
        outcomes = {
            name: measurer._run(lowered, faulty_library(tmp_path, name), reference=reference)
            for name in ("out_of_bounds", "forever", "wrong", "right")
        }
    assert outcomes["out_of_bounds"].error == "run_error"
    assert "died" in outcomes["out_of_bounds"].detail
    assert outcomes["forever"].error == "timeout"
    assert outcomes["wrong"].error == "wrong_answer" and "differs" in outcomes["wrong"].detail
    assert outcomes["right"].error == "ok" and outcomes["right"].costs  # after two restarts


def test_a_session_resumes_from_its_log_without_measuring_again(tmp_path, target, measurer):
    tasks = tasks_of(dense_model())
    log_path = tmp_path / "tuning.jsonl"
    with FileLog(log_path) as log:
        Tuner(tasks, target, log, measurer, batch=4).run(trials=6)
    first = FileLog(log_path).records()
    assert len(first) == 6 and first[0].config == tasks[0].default_config()
    with FileLog(log_path) as log:
        tuner = Tuner(tasks, target, log, measurer, batch=4)
        assert sum(len(s.visited) for s in tuner.states) == 6
        tuner.run(trials=6)
    records = FileLog(log_path).records()
    keys = [(r.workload_key, r.config_key) for r in records]
    assert len(records) == 12 and len(set(keys)) == 12  # nothing measured twice


def test_the_best_configs_and_the_default_are_timed_again_after_the_search(
    tmp_path, target, measurer
):
    """A default timed in a busy second (its record 1000x slow) is timed again with the three
    best configs, in rounds, when the search ends: the task then counts it at its real speed.
    Re-timings are records of their own, not trials, and a task re-timed since its last
    search measurement (in this session or in the log) is not re-timed again."""
    (task,) = tasks_of(dense_model())
    with FileLog(tmp_path / "quiet.jsonl") as log:
        Tuner([task], target, log, measurer, batch=4).run(trials=8)
        measured = log.records()
    default = task.default_config()
    noisy = tmp_path / "noisy.jsonl"
    with FileLog(noisy) as log:
        for r in measured:
            slowed = dataclasses.replace(r, costs=tuple(c * 1000 for c in r.costs))
            log.append(slowed if r.config == default else r)
        tuner = Tuner([task], target, log, measurer)
        (state,) = tuner.states
        slow_default = state.default_cost
        taken = tuner.retime()
        retimed = [r for r in log.records() if r.retimed]
    assert taken == len(retimed) == search.RETIME_ROUNDS * (search.RETIME_TOP + 1)
    assert sum(r.config == default for r in retimed) == search.RETIME_ROUNDS
    assert state.default_cost < slow_default / 20  # a microsecond kernel: wide margins
    assert state.retimed and state.trials == 0 and tuner.trials == 0
    assert tuner.retime() == 0
    with FileLog(noisy) as log:
        assert Tuner([task], target, log, measurer).retime() == 0


def test_a_retiming_times_the_config_builds_applied_when_the_session_began(
    tmp_path, target, measurer
):
    """The config an earlier session chose (it won in the model) is the task's incumbent;
    its isolated timing, taken on a busier day (1000x slow), ranks it below every config
    this session measures, yet the re-timing times it beside them: an old cost does not
    compare with today's."""
    (task,) = tasks_of(dense_model())
    with FileLog(tmp_path / "earlier.jsonl") as log:
        tuner = Tuner([task], target, log, measurer, batch=4)
        assert tuner.states[0].incumbent is None  # nothing built from this log yet
        tuner.run(trials=4)
        measured = log.records()
    chosen = next(r for r in measured if r.config != task.default_config())
    path = tmp_path / "t.jsonl"
    with FileLog(path) as log:
        for r in measured:
            busy = dataclasses.replace(r, costs=tuple(c * 1000 for c in r.costs))
            log.append(busy if r is chosen else r)
        log.append(dataclasses.replace(chosen, retimed=True, in_model=True))
        tuner = Tuner([task], target, log, measurer, batch=4)
        (state,) = tuner.states
        assert state.incumbent == chosen.config and task.builds(chosen.config)
        assert not task.builds({**chosen.config, "no_such_knob": 1})
        tuner.run(trials=4, retime=True)
        retimed = [r for r in log.records() if r.retimed and not r.in_model]
    assert sum(r.config == chosen.config for r in retimed) == search.RETIME_ROUNDS
    # the three fastest, the default (unless among them) and the incumbent, each in rounds
    timed_again = {r.config_key for r in retimed}
    assert len(timed_again) in (search.RETIME_TOP + 1, search.RETIME_TOP + 2)
    assert len(retimed) == search.RETIME_ROUNDS * len(timed_again)


def test_a_run_that_retimes_leaves_time_for_it_within_its_budget(tmp_path, target, measurer):
    (task,) = tasks_of(conv_model())[:1]
    with FileLog(tmp_path / "t.jsonl") as log:
        tuner = Tuner([task], target, log, measurer, batch=4)
        started = time.monotonic()
        tuner.run(time_budget=3.0, retime=True)
        spent = time.monotonic() - started
        records = log.records()
    assert any(r.retimed for r in records) and tuner.states[0].retimed
    assert tuner.trials == sum(not r.retimed for r in records)
    assert spent < 3.0 + 2.0  # the re-timing was planned inside the budget (one batch late)


def test_builds_apply_the_best_valid_record_only(tmp_path, target, measurer):
    model = dense_model()
    (task,) = tasks_of(model)
    log_path = tmp_path / "tuning.jsonl"
    with FileLog(log_path) as log:
        Tuner([task], target, log, measurer, batch=8).run(trials=8)
    best = FileLog(log_path).best(task.key, target.fingerprint)
    archive = compiler_core.compile(model, "llvm", tuning=str(log_path))
    (note,) = [k for k in archive.manifest["kernels"].values() if isinstance(k, dict)]
    assert note["config"] == best.config and note["workload_key"] == task.key
    x = RNG.standard_normal((6, 64)).astype(np.float32)
    np.testing.assert_allclose(
        load(archive).run({"x": x})["z"], np.maximum(x @ W1 + B1, 0), rtol=1e-4, atol=1e-5
    )
    # Records from other hardware, or from another version of the template, never apply.
    foreign = FileLog(tmp_path / "foreign.jsonl")
    for record in FileLog(log_path).records():
        foreign.append(dataclasses.replace(record, fingerprint="0" * 16))
        foreign.append(dataclasses.replace(record, template_version=99))
    archive = compiler_core.compile(model, "llvm", tuning=str(tmp_path / "foreign.jsonl"))
    assert set(archive.manifest["kernels"].values()) == {"default schedule"}
    # A faster record whose config the template refuses (a knob it does not have, as a log
    # written by another build of the template may hold) is passed over for the next best.
    edited = FileLog(tmp_path / "edited.jsonl")
    for record in FileLog(log_path).records():
        edited.append(record)
    unknown = {**best.config, "no_such_knob": 1}
    edited.append(dataclasses.replace(best, config=unknown, costs=(best.cost / 10,)))
    archive = compiler_core.compile(model, "llvm", tuning=str(tmp_path / "edited.jsonl"))
    (note,) = [k for k in archive.manifest["kernels"].values() if isinstance(k, dict)]
    assert note["config"] == best.config


def test_the_search_measures_distinct_configs_and_keeps_the_best(tmp_path, target, measurer):
    task = tasks_of(conv_model())[0]
    with FileLog(tmp_path / "t.jsonl") as log:
        tuner = Tuner([task], target, log, measurer, batch=4, seed=1)
        tuner.run(trials=12)
        records = log.records()
    (state,) = tuner.states
    assert len({config_key(r.config) for r in records}) == len(records) == 12
    assert state.best_cost == min(r.cost for r in records if r.ok)
    assert tuner.model.trained  # retrained as measurements arrived
    assert isinstance(records[0], TuningRecord)


def test_the_model_ranks_neighbours_of_the_best_measured_configs(target, measurer, tmp_path):
    """Half of what the model ranks each batch is one knob away from the best configs
    measured so far; the rest is sampled from the whole unvisited space."""
    (task,) = tasks_of(conv_model())[:1]
    with FileLog(tmp_path / "t.jsonl") as log:
        tuner = Tuner([task], target, log, measurer, seed=3)
    (state,) = tuner.states
    space = state.space
    best = space[len(space) // 2]
    state.measured = [(2.0, space[0]), (1.0, best)]
    rest = [c for c in space if c not in (best, space[0])]
    near = [
        c for c in rest if search._one_knob_apart(c, best) or search._one_knob_apart(c, space[0])
    ]
    candidates = tuner._candidates(state, rest, search.SCORED_PER_ROUND)
    assert len(candidates) == min(search.SCORED_PER_ROUND, len(rest))
    assert len({config_key(c) for c in candidates}) == len(candidates)
    close = [c for c in candidates if c in near]
    assert len(close) >= min(len(near), int(search.SCORED_PER_ROUND * search.NEIGHBOUR_SHARE))
    assert search._one_knob_apart({"a": 1, "b": 2}, {"a": 1, "b": 3})
    assert not search._one_knob_apart({"a": 1, "b": 2}, {"a": 2, "b": 3})
    assert not search._one_knob_apart({"a": 1}, {"a": 1, "b": 3})


def test_the_scheduler_gives_the_next_batch_where_trials_save_most_model_time(
    tmp_path, target, measurer
):
    """After each task's first batch, the next goes to the task whose trials are expected to
    save the most model time: occurrences x the fall of its best cost per trial, recent (its
    last GRADIENT_WINDOW trials) and optimistic (best / trials)."""
    task = tasks_of(dense_model())[0]
    space = task.space()  # none of it visited: every state is live

    def state(costs, occurrences=1):
        """A task state after trials whose best costs (seconds) were `costs`."""
        s = search.TaskState(dataclasses.replace(task, groups=["g"] * occurrences), space)
        for cost in costs:
            s.best_cost = min(s.best_cost, cost)
            s.history.append(s.best_gflops)
            s.trials += 1
        return s

    window = search.GRADIENT_WINDOW
    stalled = state([1.0] * 2 + [0.5] * (2 * window))  # fell, then flat for 2 windows
    falling = state([1.0] * (window + 2) + [0.5] * window)  # the same fall, in its window
    assert search._gradient(falling) > search._gradient(stalled) > 0
    twice = state([1.0] * 2 + [0.5] * (2 * window), occurrences=2)
    assert search._gradient(twice) == pytest.approx(2 * search._gradient(stalled))
    fresh = state([0.5] * 2)  # as good, but two trials only: its search has barely begun
    assert search._gradient(fresh) > search._gradient(stalled)
    with FileLog(tmp_path / "t.jsonl") as log:
        tuner = Tuner([task], target, log, measurer)
    tuner.states = [stalled, falling, fresh]
    assert tuner._next_task() is max(tuner.states, key=search._gradient)
    tuner.states.append(search.TaskState(task, space))  # untouched: it goes first
    assert tuner._next_task() is tuner.states[-1]


def test_a_cold_first_batch_is_the_default_and_its_neighbours(tmp_path, target, measurer):
    """Before the model has anything to rank with, the batch is the default point and
    configs one knob away from it; the rest of the space only when those run out."""
    (task,) = tasks_of(conv_model())[:1]
    with FileLog(tmp_path / "t.jsonl") as log:
        tuner = Tuner([task], target, log, measurer, seed=4)
    (state,) = tuner.states
    default = task.default_config()
    near = [c for c in state.space if search._one_knob_apart(c, default)]
    assert not tuner.model.trained and 3 <= len(near) < len(state.space) - 1
    first = tuner._choose(state, 4)
    assert first[0] == default and all(c in near for c in first[1:])
    every = tuner._choose(state, len(near) + 3)
    assert all(c in near for c in every[1 : len(near) + 1])
    assert not any(c in near or c == default for c in every[len(near) + 1 :])


def test_a_tuner_warm_starts_from_other_workloads_records(tmp_path, target, measurer):
    """Transfer: records of another workload carry their candidates' features, so a tuner of
    a new workload trains its model on them before measuring anything; its first batch after
    the default point is then ranked, and its own records carry features in turn."""
    conv, dense = tasks_of(conv_model())[0], tasks_of(dense_model())[0]
    with FileLog(tmp_path / "t.jsonl") as log:
        Tuner([conv], target, log, measurer, batch=6, seed=2).run(trials=12)
        learned = [r for r in log.records() if r.ok]
        assert learned and all(r.features and r.feature_set == FEATURE_SET for r in learned)
        # The default's record says so: the model reads the workload's configs against it.
        assert [r.config for r in learned if r.default] == [conv.default_config()]
        warm = Tuner([dense], target, log, measurer, batch=6, seed=2)
        assert warm.model.trained and warm.transfer == (len(learned), 1)
        cold_log = FileLog(tmp_path / "cold.jsonl")
        assert not Tuner([dense], target, cold_log, measurer).model.trained
        # ... or from a log given to learn from, which it only reads.
        source_lines = (tmp_path / "t.jsonl").read_text()
        from_source = Tuner([dense], target, cold_log, measurer, transfer_from=[log])
        assert from_source.model.trained and from_source.transfer == (len(learned), 1)
        assert (tmp_path / "t.jsonl").read_text() == source_lines
        # Features of another layout (an older extractor) are not learned from.
        stale = FileLog(tmp_path / "stale.jsonl")
        stale.extend(dataclasses.replace(r, feature_set="old") for r in learned)
        assert not Tuner([dense], target, stale, measurer).model.trained
        # Nor a workload whose default was never measured: nothing to read its configs against.
        undefaulted = FileLog(tmp_path / "undefaulted.jsonl")
        undefaulted.extend(r for r in learned if not r.default)
        assert not Tuner([dense], target, undefaulted, measurer).model.trained


def test_the_model_reads_each_config_against_its_tasks_default(tmp_path, target, measurer):
    """What the cost model is fit on and ranks: a config's features less its task's
    default's, so the default's row is all zeros and one config's row differs between two
    workloads only as their programs' differences do."""
    conv = tasks_of(conv_model())[0]
    with FileLog(tmp_path / "t.jsonl") as log:
        tuner = Tuner([conv], target, log, measurer, seed=1)
    (state,) = tuner.states
    default = conv.default_config()
    assert not tuner._relative(state, default).any()
    other = next(c for c in state.space if c != default)
    expected = search.config_features(conv, other) - search.config_features(conv, default)
    np.testing.assert_allclose(tuner._relative(state, other), expected, rtol=1e-6)


def wide_conv_model():
    """conv_model's conv on a 10-pixel row: the same template, another workload."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["z"]),
    ]
    return make_model(
        nodes, [("x", FLOAT, [1, 16, 10, 10])], [("z", FLOAT, [1, 16, 10, 10])], {"w": CONV_W}
    )


def test_a_first_batch_measures_the_configs_proven_on_other_workloads(tmp_path, target, measurer):
    """Configs that ran within PROVEN_MARGIN of the best on other workloads of the template
    (mapped into this space) join a task's first batch, the one proven on most workloads
    first; a config at twice a workload's best is not proven."""
    small, wide = tasks_of(conv_model())[0], tasks_of(wide_conv_model())[0]
    assert small.template == wide.template and small.key != wide.key
    space = wide.space()
    default = wide.default_config()
    others = [c for c in space if c != default]
    favourite, runner_up, slow = others[-1], others[len(others) // 2], others[0]

    def records(task, timings):
        return [
            search.measured_record(task, config, search.Result(costs=(cost,)), measurer)
            for config, cost in timings
        ]

    with FileLog(tmp_path / "t.jsonl") as log:
        # Two other workloads (the same configs under another key count as another workload).
        log.extend(records(small, [(favourite, 1.0), (runner_up, 1.02), (slow, 2.0)]))
        other = dataclasses.replace(small, key="another-workload")
        log.extend(records(other, [(slow, 3.0), (favourite, 1.0)]))
        tuner = Tuner([wide], target, log, measurer, batch=4, seed=0)
        (state,) = tuner.states
        rest = [c for c in space if c != default]
        assert tuner._proven(state, rest) == [favourite, runner_up]
        assert tuner._choose(state, 4)[:3] == [default, favourite, runner_up]


def pointwise_conv_model(channels: int = 64, size: int = 14):
    """A 1x1 conv whose space (60 configs) is larger than what a batch ranks."""
    weight = (RNG.standard_normal((channels, channels, 1, 1)) * 0.1).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["z"])]
    shape = [1, channels, size, size]
    return make_model(nodes, [("x", FLOAT, shape)], [("z", FLOAT, shape)], {"w": weight})


@pytest.mark.parametrize("others", [search.INFORMED_WORKLOADS, search.INFORMED_WORKLOADS - 1])
def test_a_model_informed_by_many_workloads_picks_a_first_batch_from_the_whole_space(
    tmp_path, target, measurer, others
):
    """Trained on INFORMED_WORKLOADS other workloads, the model picks all of a task's first
    batch but the default: its INFORMED_PICKS top configs of the whole space (not of a sample
    of SCORED_PER_ROUND), no proven and no random ones. Trained on fewer, the first batch is
    half a batch with proven configs."""
    (task,) = tasks_of(pointwise_conv_model())
    space = task.space()
    assert len(space) > search.SCORED_PER_ROUND
    rng = random.Random(5)
    costs = {config_key(c): rng.uniform(1.0, 3.0) for c in space}  # the same on every workload
    with FileLog(tmp_path / "source.jsonl") as source:
        for k in range(others):
            other = dataclasses.replace(task, key=f"other-workload-{k}")
            source.extend(
                search.measured_record(
                    other,
                    config,
                    search.Result(costs=(costs[config_key(config)],)),
                    measurer,
                    features=search.config_features(task, config),
                )
                for config in with_default(task, space[k::3])
            )
        log = FileLog(tmp_path / "t.jsonl")
        tuner = Tuner([task], target, log, measurer, batch=8, seed=1, transfer_from=[source])
    (state,) = tuner.states
    default = task.default_config()
    batch = tuner._choose(state, tuner._batch_for(state))
    rest = [c for c in space if c != default]
    if others < search.INFORMED_WORKLOADS:
        assert not tuner._informed(state) and len(batch) == 4
        proven = tuner._proven(state, rest)
        assert proven and all(c in batch for c in proven)
        return
    assert tuner._informed(state) and len(batch) == 1 + search.INFORMED_PICKS
    scores = tuner.model.predict(np.stack([tuner._relative(state, c) for c in rest]))
    top = [rest[k] for k in np.argsort(-scores)[: search.INFORMED_PICKS]]
    assert batch == [default, *top]


def with_default(task, configs: list[dict]) -> list[dict]:
    """`configs` and the task's default (a workload's records are read against it)."""
    default = task.default_config()
    return [default, *(c for c in configs if c != default)]


def source_of(task, path, measurer, workloads: int, template: str) -> FileLog:
    """A log to learn from: `workloads` other workloads of `template`, each with a third of
    the task's space (and its default) measured, their features the task's."""
    space = task.space()
    source = FileLog(path)
    for k in range(workloads):
        other = dataclasses.replace(task, key=f"other-workload-{k}")
        source.extend(
            dataclasses.replace(
                search.measured_record(
                    other,
                    config,
                    search.Result(costs=(1.0 + 0.01 * n,)),
                    measurer,
                    features=search.config_features(task, config),
                ),
                template=template,
            )
            for n, config in enumerate(with_default(task, space[k::3]))
        )
    return source


def test_workloads_of_another_template_do_not_inform_a_first_batch(tmp_path, target, measurer):
    """A model fit on workloads of other templates only ranks a task's space no better than
    blind: its first batch is a cold one (a whole batch, the default and its neighbours),
    not the model's picks. One workload of the task's template and the model picks in half
    a batch; INFORMED_WORKLOADS of them and it picks all of it (see the test above)."""
    (task,) = tasks_of(pointwise_conv_model())
    many = search.INFORMED_WORKLOADS + 2
    with source_of(task, tmp_path / "other.jsonl", measurer, many, "another_template") as other:
        tuner = Tuner(
            [task], target, FileLog(tmp_path / "t.jsonl"), measurer, transfer_from=[other]
        )
    (state,) = tuner.states
    assert tuner.model.trained and not tuner._knows_template(state)
    firsts = tuner._first_points(state)
    assert tuner._batch_for(state) == tuner.batch + len(firsts)
    default = task.default_config()
    batch = tuner._choose(state, 4 + len(firsts))
    assert batch[0] == default and batch[1 : 1 + len(firsts)] == firsts
    assert all(search._one_knob_apart(c, default) for c in batch[1 + len(firsts) :])
    with source_of(task, tmp_path / "same.jsonl", measurer, 1, task.template) as same:
        tuner = Tuner([task], target, FileLog(tmp_path / "u.jsonl"), measurer, transfer_from=[same])
    (state,) = tuner.states
    assert tuner._knows_template(state) and not tuner._informed(state)
    assert tuner._batch_for(state) == tuner.batch // 2 + len(tuner._first_points(state))


def test_a_proven_config_is_mapped_to_the_nearest_config_of_the_space():
    space = [{"tile": 7, "order": "ij", "blocks": 1}, {"tile": 14, "order": "ji", "blocks": 1}]
    kinds = search._kinds(space)
    project = search._project
    assert project({"tile": 28, "order": "ji", "blocks": 1}, kinds) == space[1]
    assert project({"tile": 10, "order": "ij", "blocks": 1}, kinds) == space[0]
    # A nearest value the space rules out (no 14-pixel tile in ij order): one knob away.
    assert project({"tile": 14, "order": "ij", "blocks": 1}, kinds) == space[0]
    # Not from this kind of layer: a name the space lacks, a knob it fixes, another knob set.
    assert project({"tile": 7, "order": "ik", "blocks": 1}, kinds) is None
    assert project({"tile": 7, "order": "ij", "blocks": 2}, kinds) is None
    assert project({"tile": 7, "order": "ij"}, kinds) is None
    # Each algorithm has its own knobs, and a workload with one algorithm is another kind of
    # layer than one that chooses (a 1x1 conv and a 3x3 one).
    winograd = {ALGORITHM: "winograd4", "tile": 4, "order": "ij", "blocks": 1}
    direct = [{ALGORITHM: "direct", **config} for config in space]
    kinds = search._kinds([*direct, winograd, {**winograd, "tile": 16}])
    assert project({**direct[0], "tile": 8}, kinds) == direct[0]
    assert project({**winograd, "tile": 8}, kinds) == winograd
    assert project({ALGORITHM: "winograd2", **space[0]}, kinds) is None
    assert project(space[0], kinds) is None


def test_candidates_time_with_a_cache_flush_before_every_pass(target):
    """`flush_bytes`: a scratch write before each timed pass (not timed itself); the
    candidates are still checked and timed."""
    (task,) = tasks_of(dense_model())
    options = MeasureOptions(repeats=2, min_repeat_seconds=0.001, flush_bytes=1 << 20)
    with Measurer(target, options) as flushed:
        (result,) = flushed.measure(task, [task.default_config()])
    assert result.error == "ok" and len(result.costs) == 2 and min(result.costs) > 0


def test_kiln_tune_then_compile_with_the_log(tmp_path):
    model = tmp_path / "dense.onnx"
    model.write_bytes(dense_model().SerializeToString())
    log = tmp_path / "tuning.jsonl"
    kiln = str(Path(sys.executable).parent / "kiln")
    tune = subprocess.run(
        [kiln, "tune", str(model), "--trials", "5", "--log", str(log)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert tune.returncode == 0, tune.stderr
    records = FileLog(log).records()
    retimings = sum(r.retimed and not r.in_model for r in records)
    in_model = sum(r.in_model for r in records)
    assert "1 tuning tasks" in tune.stdout and len(records) - retimings - in_model == 5
    assert f"best configs and default: {retimings} runs" in tune.stdout
    # The tuned task timed in the model, tuned and untuned; unless the default won alone.
    assert in_model in (0, 2) and ("checked in the model: 1 tuned tasks" in tune.stdout) == (
        in_model == 2
    )
    build = subprocess.run(
        [kiln, "compile", str(model), "--tuning", str(log), "-o", str(tmp_path / "m.kiln")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert build.returncode == 0 and "tuned kernels: 1 of" in build.stdout
    no_budget = subprocess.run([kiln, "tune", str(model), "--log", str(log)], capture_output=True)
    assert no_budget.returncode == 2 and b"--trials" in no_budget.stderr
    bad_size = subprocess.run(
        [kiln, "tune", str(model), "--trials", "1", "--log", str(log), "--cache-flush", "lots"],
        capture_output=True,
    )  # fmt: skip
    assert bad_size.returncode == 2 and b"expected e.g. 2M" in bad_size.stderr
    missing = tmp_path / "missing.jsonl"
    no_source = subprocess.run(
        [kiln, "tune", str(model), "--trials", "1", "--log", str(log), "--transfer-from",
         str(missing)],
        capture_output=True,
    )  # fmt: skip
    assert no_source.returncode == 2 and b"no such tuning log" in no_source.stderr
    assert not missing.exists() and len(log.read_text().splitlines()) == len(records)
    # --trials 0 measures nothing: the curves of what the log holds
    curves = tmp_path / "curves.png"
    plot = subprocess.run(
        [kiln, "tune", str(model), "--trials", "0", "--log", str(log), "--plot", str(curves)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert plot.returncode == 0, plot.stderr
    assert "resuming: 5 configs" in plot.stdout  # ... and re-timed already: nothing more
    assert len(log.read_text().splitlines()) == len(records)
    # --export-best onto the log itself: the one best record of its one workload.
    compact = subprocess.run(
        [kiln, "tune", str(model), "--trials", "0", "--log", str(log), "--export-best", str(log)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert compact.returncode == 0, compact.stderr
    assert f"best records: 1 of {len(records)}" in compact.stdout
    assert len(log.read_text().splitlines()) == 1
    assert curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and curves.stat().st_size > 10_000
    # A log to learn from whose workloads' defaults were never measured teaches nothing: said.
    (best,) = FileLog(log).records()
    undefaulted = FileLog(tmp_path / "undefaulted.jsonl")
    undefaulted.extend([dataclasses.replace(best, default=False)])
    cold = subprocess.run(
        [kiln, "tune", str(model), "--trials", "0", "--log", str(tmp_path / "fresh.jsonl"),
         "--transfer-from", str(undefaulted.path)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert cold.returncode == 0, cold.stderr
    assert "warm start: none" in cold.stdout


# --- the algorithm knob: a 3x3 conv's direct and Winograd forms --------------------------------

WINOGRAD_W = (RNG.standard_normal((32, 32, 3, 3)) * 0.05).astype(np.float32)


def winograd_model():
    """Conv 3x3 (32 -> 32 channels, 12x12) -> Relu, twice: convs that can run direct or as
    Winograd F(2x2) or F(4x4); untuned, F(2x2) (36 tiles of 2x2, 9 of 4x4), or F(4x4) where
    the FMAs run at half width (Zen 1)."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["z"]),
    ]
    shape = [1, 32, 12, 12]
    return make_model(nodes, [("x", FLOAT, shape)], [("z", FLOAT, shape)], {"w": WINOGRAD_W})


def test_the_algorithm_is_a_knob_whose_every_value_computes_the_reference(measurer):
    (task,) = tasks_of(winograd_model())  # both convs share the workload
    assert sorted(task.variants) == ["direct", "winograd2", "winograd4"]
    space = task.space()
    untuned = "winograd4" if parse_target("llvm").fma_lanes < 8 else "winograd2"
    assert space[0] == task.default_config() and space[0][ALGORITHM] == untuned
    by_algorithm = {a: [c for c in space if c[ALGORITHM] == a] for a in task.variants}
    assert all(by_algorithm.values())
    # The default, then each algorithm's first two configs: all verified against the
    # default's output on the same weights (the Winograd forms pack theirs transformed).
    sample = [space[0], *(c for configs in by_algorithm.values() for c in configs[:2])]
    results = measurer.measure(task, sample)
    assert [r.error for r in results] == ["ok"] * len(sample), results


def test_a_first_batch_measures_each_other_algorithms_default(tmp_path, target, measurer):
    """A task of several algorithms measures, beside its default, each other algorithm at its
    own template's defaults in its first batch (cold or warm); no later batch is widened."""
    (task,) = tasks_of(winograd_model())
    with FileLog(tmp_path / "t.jsonl") as log:
        tuner = Tuner([task], target, log, measurer, seed=1)
    (state,) = tuner.states
    default = task.default_config()
    others = [
        {ALGORITHM: algorithm, **variant.tunable.default_config()}
        for algorithm, variant in task.variants.items()
        if algorithm != default[ALGORITHM]
    ]
    assert len(others) == 2 and all(c in state.space for c in others)
    assert tuner._batch_for(state) == tuner.batch + 2
    first = tuner._choose(state, tuner._batch_for(state))
    assert first[:3] == [default, *others] and len(first) == tuner.batch + 2
    tuner.run(trials=len(first))
    assert state.trials == len(first)
    assert tuner._first_points(state) == [] and tuner._batch_for(state) == tuner.batch


def test_a_first_batch_measures_each_loop_order_near_each_algorithms_default(
    tmp_path, target, measurer
):
    """The dense template's loop order is a pivot: a GEMM task's first batch measures, for
    each algorithm, the other order at the config nearest that algorithm's default. Packed
    A's default packs a tile at a time in the `ij` order, which `ji` does not allow: its `ji`
    point packs at the root and changes nothing else."""
    from tests.kernels.test_packed_a import gemm_model

    (task,) = [t for t in tasks_of(gemm_model(96, 256, 64)) if t.template == "dense"]
    assert "packed_a" in task.algorithms
    with FileLog(tmp_path / "t.jsonl") as log:
        tuner = Tuner([task], target, log, measurer, seed=1)
    (state,) = tuner.states
    points = tuner._first_points(state)
    assert all(p in state.space for p in points) and task.default_config() not in points
    for algorithm in task.algorithms:
        own = task.algorithm_default(algorithm)
        (flipped,) = [p for p in points if p[ALGORITHM] == algorithm and p != own]
        assert flipped["order"] != own["order"]
        changed = {k for k in own if own[k] != flipped[k]}
        expected = {"order", "pack_a_at"} if own.get("pack_a_at") == "tile" else {"order"}
        assert changed == expected, (algorithm, own, flipped)
    assert len(points) == 2 * len(task.algorithms) - 1  # the default itself is not a point
    assert tuner._batch_for(state) == tuner.batch + len(points)
    first = tuner._choose(state, tuner._batch_for(state))
    assert first[0] == task.default_config() and first[1 : 1 + len(points)] == points
    results = measurer.measure(task, points)
    assert [r.error for r in results] == ["ok"] * len(points), results


@pytest.mark.parametrize("algorithm", ["direct", "winograd4"])
def test_builds_run_the_algorithm_of_the_best_record(tmp_path, target, measurer, algorithm):
    model = winograd_model()
    (task,) = tasks_of(model)
    config = next(c for c in task.space() if c[ALGORITHM] == algorithm)
    (result,) = measurer.measure(task, [config])
    with FileLog(tmp_path / "t.jsonl") as log:
        log.append(
            TuningRecord(
                workload_key=task.key, workload=task.workload, target=str(target),
                fingerprint=target.fingerprint, template=task.template,
                template_version=task.template_version, config=config, costs=result.costs,
                error="ok", error_detail="", flops=task.flops, compiler_version="test",
                timestamp=0.0,
            )
        )  # fmt: skip
    archive = compiler_core.compile(model, "llvm", tuning=str(tmp_path / "t.jsonl"))
    notes = [k for k in archive.manifest["kernels"].values() if isinstance(k, dict)]
    assert len(notes) == 2 and all(n["config"][ALGORITHM] == algorithm for n in notes)
    graph = optimize(import_model(model))
    choices = {g.name: task.choices(config) for g in graph.groups if g.name in task.groups}
    stages = [
        s.name
        for index, group in enumerate(graph.groups)
        for s in lower_group(graph, group, index, target, choices.get(group.name)).stages
    ]
    assert any(name.startswith("wgin") for name in stages) == (algorithm != "direct")
    x = RNG.standard_normal((1, 32, 12, 12)).astype(np.float32)
    expected = ort_output(model, {"x": x})
    assert_close_to_scale(load(archive).run({"x": x})["z"], expected)


def ort_output(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["z"], feeds)[0]


def test_tuned_tasks_are_timed_in_the_model_tuned_and_untuned(tmp_path, target, measurer):
    """After a search, each task whose best config is not its default is timed inside the
    whole model with that config and with its default: two in-model records per task, which
    then decide the task's best (here whichever ran faster in the model)."""
    from compiler_core.autotune.in_model import check_in_model
    from compiler_core.autotune.measure import Result
    from compiler_core.autotune.search import measured_record

    model = conv_model()
    graph = optimize(import_model(model))
    tasks = extract_tasks(graph, target)
    log = FileLog(tmp_path / "t.jsonl")
    task = tasks[0]
    other = next(c for c in task.space() if c != task.default_config())
    # A search that found `other` far faster than the default, alone.
    for config, cost in ((task.default_config(), 1e-3), (other, 1e-6)):
        log.append(measured_record(task, config, Result((cost,)), measurer))
    timings = check_in_model(graph, target, tasks, log, measurer, rounds=2)
    (timing,) = timings
    assert timing.task is task and timing.tuned_config == other
    assert len(timing.tuned) == len(timing.default) == 2 and min(timing.tuned) > 0
    in_model = [r for r in log.records() if r.in_model]
    assert [r.config for r in in_model] == [other, task.default_config()]
    assert all(r.retimed and r.flops == task.flops for r in in_model)
    faster = task.default_config() if timing.kept_default else other
    assert log.best(task.key, measurer.fingerprint).config == faster
    # Checked again with nothing new: nothing to time. A newer search measurement hands the
    # choice back to the isolated timings, and the next check times the task again.
    assert check_in_model(graph, target, tasks, log, measurer, rounds=1) == []
    log.append(measured_record(task, task.space()[-1], Result((2e-6,)), measurer))
    assert len(check_in_model(graph, target, tasks, log, measurer, rounds=1)) == 1


def test_a_re_tune_times_what_builds_applied_before_it_in_the_model(tmp_path, target, measurer):
    """After a later search, the in-model check times the earlier check's winner beside the
    new search's best and the default: their in-model records then decide, so a config that
    ran faster alone, on another day, does not displace it unchecked. A config of an older
    template version is not timed."""
    from compiler_core.autotune.in_model import check_in_model
    from compiler_core.autotune.measure import Result
    from compiler_core.autotune.search import measured_record

    graph = optimize(import_model(conv_model()))
    tasks = extract_tasks(graph, target)
    task, default = tasks[0], tasks[0].default_config()
    earlier, newer = [c for c in task.space() if c != default][:2]
    log = FileLog(tmp_path / "t.jsonl")

    def timed(config, cost, **flags):
        return dataclasses.replace(
            measured_record(task, config, Result((cost,)), measurer), **flags
        )

    log.extend([timed(default, 1e-3), timed(earlier, 1e-4)])  # the earlier search
    checked = {"retimed": True, "in_model": True}
    log.extend([timed(earlier, 1e-4, **checked), timed(default, 1e-3, **checked)])
    log.append(timed(newer, 1e-6))  # a later search, alone, on another day
    (timing,) = check_in_model(graph, target, tasks, log, measurer, rounds=1)
    assert timing.tuned_config == newer and timing.alternatives[0][0] == earlier == timing.previous
    rechecked = [r.config for r in log.records()[5:]]
    assert rechecked[:3] == [newer, default, earlier]
    best = log.best(task.key, measurer.fingerprint)
    assert best.in_model and best.config in (newer, default, earlier)
    assert timing.kept_previous == (best.config == earlier)
    # The same history under an older template version names no earlier choice.
    old = FileLog(tmp_path / "old.jsonl")
    old.extend(
        dataclasses.replace(r, template_version=task.template_version - 1)
        for r in log.records()[:4]
    )
    old.append(timed(newer, 1e-6))
    (timing,) = check_in_model(graph, target, tasks, old, measurer, rounds=1)
    assert timing.previous is None and all(c != earlier for c, _ in timing.alternatives)


def test_a_re_tune_whose_best_alone_is_the_default_still_times_the_earlier_choice(
    tmp_path, target, measurer
):
    """A later search that finds the default fastest alone has not shown that the earlier
    choice, which beat the default in the model, runs slower there: the task is checked
    again, the default timed once (in the tuned build), the earlier choice beside it."""
    from compiler_core.autotune.in_model import check_in_model
    from compiler_core.autotune.measure import Result
    from compiler_core.autotune.search import measured_record

    graph = optimize(import_model(conv_model()))
    tasks = extract_tasks(graph, target)
    task, default = tasks[0], tasks[0].default_config()
    earlier = next(c for c in task.space() if c != default)
    log = FileLog(tmp_path / "t.jsonl")

    def timed(config, cost, **flags):
        return dataclasses.replace(
            measured_record(task, config, Result((cost,)), measurer), **flags
        )

    checked = {"retimed": True, "in_model": True}
    log.extend([timed(earlier, 1e-4, **checked), timed(default, 1e-3, **checked)])
    log.extend([timed(default, 1e-7), timed(earlier, 1e-3)])  # alone, today: the default
    assert log.best(task.key, measurer.fingerprint).config == default
    (timing,) = check_in_model(graph, target, tasks, log, measurer, rounds=1)
    assert timing.tuned_config == default and timing.previous == earlier
    rechecked = [r.config for r in log.records()[4:]]
    assert rechecked == [default, earlier]  # the default once
    best = log.best(task.key, measurer.fingerprint).config
    assert timing.kept_default == (best == default) and timing.kept_previous == (best == earlier)
