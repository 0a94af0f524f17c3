"""A LightGBM cost model of the schedule space: loop-program features -> relative speed.

Trained on measured records of every task seen in a session: the target is each record's
throughput normalized by the best of its own task (so a small GEMM and a big conv train one
model), with failed configs left out (they would teach the model nothing true about speed).
Two objectives: `regression` on the normalized throughput, and `rank` (lambdarank, grouped per
task, on throughput buckets). `bench.search` reports the top-k recall of both on held-out
records; the tuner uses regression, which ranked as well or better there. Once there are
enough records, a share of each task's is held out to stop the boosting where the held-out
error stops falling (a fixed round count over-fits a few dozen records and under-fits
thousands), and the model is then refit on every record for that many rounds.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

RANK_LEVELS = 30  # lambdarank relevance buckets of the normalized throughput
MIN_TRAINING_RECORDS = 8
MAX_ROUNDS = 300
FIXED_ROUNDS = 80  # below MIN_HOLD_OUT_RECORDS: too few to hold any out
MIN_HOLD_OUT_RECORDS = 48
HOLD_OUT_SHARE = 0.2
STOPPING_ROUNDS = 20


class CostModel:
    def __init__(self, objective: str = "regression", seed: int = 0):
        if objective not in ("regression", "rank"):
            raise ValueError(f"unknown cost model objective {objective!r}")
        self.objective = objective
        self.seed = seed
        self._booster = None
        self.rounds = 0  # boosting rounds of the current model

    @property
    def trained(self) -> bool:
        return self._booster is not None

    def fit(self, features: np.ndarray, throughput: np.ndarray, groups: Sequence[str]) -> bool:
        """Train on (features, throughput) rows, `groups` naming each row's task. Returns
        False (and keeps the previous model) when there is too little to learn from."""
        import lightgbm as lgb

        features = np.asarray(features, np.float32)
        labels = _normalized(np.asarray(throughput, np.float64), list(groups))
        if len(labels) < MIN_TRAINING_RECORDS or np.ptp(labels) == 0:
            return False
        params = {
            "learning_rate": 0.1,
            "num_leaves": 15,
            "min_data_in_leaf": 2,
            "feature_fraction": 0.8,
            "bagging_fraction": 0.8,
            "bagging_freq": 1,
            "verbose": -1,
            "seed": self.seed,
            "num_threads": 1,
        }
        if self.objective == "rank":
            params |= {
                "objective": "lambdarank",
                "label_gain": list(range(RANK_LEVELS + 1)),
                "metric": "ndcg",
                "eval_at": [5],
            }
        else:
            params |= {"objective": "regression", "metric": "l2"}
        groups = np.asarray(groups)
        rounds = self._stopping_round(params, features, labels, groups)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._booster = lgb.train(params, self._dataset(features, labels, groups), rounds)
        self.rounds = rounds
        return True

    def _dataset(self, features: np.ndarray, labels: np.ndarray, groups: np.ndarray):
        import lightgbm as lgb

        if self.objective != "rank":
            return lgb.Dataset(features, labels)
        order = np.argsort(groups, kind="stable")
        sizes = np.unique(groups[order], return_counts=True)[1]
        relevance = np.round(labels[order] * RANK_LEVELS).astype(int)
        return lgb.Dataset(features[order], relevance, group=sizes)

    def _stopping_round(
        self, params: dict, features: np.ndarray, labels: np.ndarray, groups: np.ndarray
    ) -> int:
        """Boosting rounds at which the error on held-out records stopped falling (each
        task's records split alike, so every task is seen in both parts); FIXED_ROUNDS when
        there are too few records to hold any out."""
        import lightgbm as lgb

        held = _held_out_rows(groups, self.seed)
        if len(labels) < MIN_HOLD_OUT_RECORDS or not held.any():
            return FIXED_ROUNDS
        train = self._dataset(features[~held], labels[~held], groups[~held])
        valid = self._dataset(features[held], labels[held], groups[held])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            booster = lgb.train(
                params,
                train,
                MAX_ROUNDS,
                valid_sets=[valid],
                callbacks=[lgb.early_stopping(STOPPING_ROUNDS, verbose=False)],
            )
        return max(booster.best_iteration, 1)

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Scores, higher = faster (comparable within one task)."""
        if self._booster is None:
            raise RuntimeError("the cost model is not trained")
        return self._booster.predict(np.asarray(features, np.float32))


def _held_out_rows(groups: np.ndarray, seed: int) -> np.ndarray:
    """A mask of HOLD_OUT_SHARE of each group's rows, chosen at random (groups of fewer than
    five rows are left whole: their one held-out row would say little)."""
    rng = np.random.default_rng(seed)
    held = np.zeros(len(groups), bool)
    for group in np.unique(groups):
        rows = np.flatnonzero(groups == group)
        count = int(len(rows) * HOLD_OUT_SHARE)
        if count:
            held[rng.choice(rows, count, replace=False)] = True
    return held


def _normalized(throughput: np.ndarray, groups: list[str]) -> np.ndarray:
    labels = np.zeros_like(throughput)
    for group in set(groups):
        rows = np.array([g == group for g in groups])
        best = throughput[rows].max()
        labels[rows] = throughput[rows] / best if best > 0 else 0.0
    return labels


def top_k_recall(scores: np.ndarray, throughput: np.ndarray, k: int = 5) -> float:
    """Of the k truly fastest configs, the share the model also ranks in its top k."""
    k = min(k, len(scores))
    if k == 0:
        return 0.0
    predicted = set(np.argsort(-scores)[:k])
    actual = set(np.argsort(-throughput)[:k])
    return len(predicted & actual) / k
