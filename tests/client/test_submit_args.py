"""`kiln submit`'s argument parsing and plain progress lines, without a server."""

from __future__ import annotations

import pytest

from api.client import Event, parse_sse
from api.submit import UsageError, build_parser, describe_event, parse_duration, tuning_request


@pytest.mark.parametrize(
    "text,seconds",
    [("90", 90), ("20s", 20), ("10m", 600), ("1h30m", 5400), ("1.5m", 90), ("2d", 172800)],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "ten", "10x", "0s", "m10", "-5s"])
def test_bad_durations(text):
    with pytest.raises(UsageError):
        parse_duration(text)


def test_tune_and_trials_make_the_tuning_request():
    parse = build_parser().parse_args
    assert tuning_request(parse(["m.onnx"])) is None
    assert tuning_request(parse(["m.onnx", "--tune", "10m"])) == {"time_budget": 600}
    both = parse(["m.onnx", "--tune", "20s", "--trials", "6"])
    assert tuning_request(both) == {"time_budget": 20, "trials": 6}
    with pytest.raises(UsageError):
        tuning_request(parse(["m.onnx", "--trials", "0"]))


def test_plain_lines():
    tuning = Event(
        "7",
        "tuning",
        {"task": 1, "workload": "dense", "trials": 12, "best_gflops": 3.456, "tasks_done": 1,
         "tasks_total": 2, "estimated_ms": 0.5},
    )  # fmt: skip
    assert describe_event(tuning) == (
        "tuning task 1 (dense): 12 trials, best 3.46 GFLOP/s; 1/2 tasks done, estimated 0.5 ms"
    )
    assert describe_event(Event("2", "stage", {"stage": "importing"})) == "stage importing"
    checked = Event(
        "8",
        "in_model",
        {"checked": 2, "kept_default": [
            {"task": 0, "workload": "conv", "tuned_ms": 0.7, "default_ms": 0.5}]},
    )  # fmt: skip
    assert describe_event(checked) == (
        "checked in the model: 2 tuned tasks, 1 keep their default; task 0 tuned 0.7 ms, "
        "default 0.5 ms"
    )
    rechecked = Event("8", "in_model", {"checked": 3, "kept_default": [], "kept_previous": [2]})
    assert describe_event(rechecked) == (
        "checked in the model: 3 tuned tasks, 0 keep their default, 1 keep their earlier choice"
    )
    failed = Event("9", "failed", {"error": "node 'n1': operator X.Y"})
    assert describe_event(failed) == "failed: node 'n1': operator X.Y"


def test_sse_parsing_keeps_only_complete_events():
    lines = [
        ": keep-alive",
        "",
        "id: 1",
        "event: stage",
        'data: {"type": "stage", "stage": "importing"}',
        "",
        "id: 2",
        "event: done",
        'data: {"type": "do',  # cut: no closing blank line
    ]
    assert list(parse_sse(iter(lines))) == [
        Event("1", "stage", {"type": "stage", "stage": "importing"})
    ]
