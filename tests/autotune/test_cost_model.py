"""The cost model on synthetic records: it learns an order that holds across tasks, stops
boosting where held-out records stop improving, and keeps the objective that ranks them
better."""

from __future__ import annotations

import numpy as np
import pytest

from compiler_core.autotune import cost_model
from compiler_core.autotune.cost_model import CostModel, top_k_recall


def records(tasks: int, per_task: int, noise: float, seed: int = 0):
    """Rows of `tasks` tasks whose throughput rises with feature 0 (each task at its own
    scale) and ignores the other features, with multiplicative noise."""
    rng = np.random.default_rng(seed)
    features = rng.uniform(0, 4, (tasks * per_task, 6)).astype(np.float32)
    scale = np.repeat(rng.uniform(1, 100, tasks), per_task)
    throughput = scale * (1 + features[:, 0]) * np.exp(noise * rng.standard_normal(len(scale)))
    groups = [f"task{k}" for k in range(tasks) for _ in range(per_task)]
    return features, throughput, groups


def test_it_learns_an_order_that_holds_on_an_unseen_task():
    features, throughput, groups = records(6, 20, noise=0.02)
    model = CostModel()
    assert model.fit(features, throughput, groups)
    assert model.trained and model.chosen in cost_model.OBJECTIVES
    unseen, speed, _ = records(1, 30, noise=0.0, seed=1)
    scores = model.predict(unseen)
    assert np.corrcoef(np.argsort(np.argsort(scores)), np.argsort(np.argsort(speed)))[0, 1] > 0.9
    assert top_k_recall(scores, speed, 5) >= 0.6


def test_the_objective_kept_is_the_one_that_ranked_the_held_out_records_better():
    features, throughput, groups = records(6, 20, noise=0.1)
    model = CostModel(seed=3)
    model.fit(features, throughput, groups)
    quality = model.held_out_quality
    assert set(quality) == set(cost_model.OBJECTIVES)
    assert model.chosen == max(cost_model.OBJECTIVES, key=lambda o: quality[o])
    assert all(0 < q <= 1 for q in quality.values())


def test_boosting_stops_where_held_out_records_stop_improving():
    noise_only = records(6, 20, noise=0.0)
    rng = np.random.default_rng(5)
    shuffled = rng.permutation(noise_only[1])  # throughput unrelated to the features
    model = CostModel("regression")
    model.fit(noise_only[0], shuffled, noise_only[2])
    assert 1 <= model.rounds < cost_model.MAX_ROUNDS // 2
    learnable = CostModel("regression")
    learnable.fit(*records(6, 20, noise=0.0))
    assert learnable.rounds > model.rounds


def test_few_records_train_a_fixed_number_of_rounds_and_too_few_none():
    features, throughput, groups = records(2, 10, noise=0.05)
    model = CostModel("rank")
    assert len(groups) < cost_model.MIN_HOLD_OUT_RECORDS
    assert model.fit(features, throughput, groups)
    assert model.chosen == "rank" and model.rounds == cost_model.FIXED_ROUNDS
    assert model.held_out_quality == {}
    few = CostModel()
    assert not few.fit(features[:4], throughput[:4], groups[:4])
    assert not few.trained
    with pytest.raises(RuntimeError, match="not trained"):
        few.predict(features)
    same = CostModel()
    assert not same.fit(features, np.ones(len(groups)), groups)  # nothing to tell apart


def test_an_unknown_objective_is_refused():
    with pytest.raises(ValueError, match="unknown cost model objective"):
        CostModel("mse")


def test_a_prior_ranks_alone_until_the_session_fits_and_the_session_corrects_it():
    """Other workloads' records (speed rising with feature 0) train the prior; this
    session's workload runs faster as feature 1 rises instead. The prior's order holds
    before the session has records; a fit on 40 of them, boosted on from the prior's scores,
    ranks the workload's unmeasured configs by feature 1."""
    model = CostModel(seed=2)
    assert model.learn_prior(*records(6, 30, noise=0.02))
    assert model.trained and model.prior_groups == {f"task{k}" for k in range(6)}
    rng = np.random.default_rng(7)
    features = rng.uniform(0, 4, (80, 6)).astype(np.float32)
    speed = 1 + features[:, 1]
    by_prior = model.predict(features)
    assert _spearman(by_prior, 1 + features[:, 0]) > 0.9
    assert model.fit(features[:40], speed[:40], ["session"] * 40)
    assert _spearman(model.predict(features[40:]), speed[40:]) > 0.7
    assert model.chosen == model._prior.chosen  # its scores are the prior's units


def test_too_few_records_make_no_prior():
    features, throughput, groups = records(1, 4, noise=0.0)
    model = CostModel()
    assert not model.learn_prior(features, throughput, groups)
    assert not model.trained and model.prior_groups == frozenset()


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(np.argsort(np.argsort(a)), np.argsort(np.argsort(b)))[0, 1])
