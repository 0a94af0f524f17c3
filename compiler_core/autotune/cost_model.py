"""A LightGBM cost model of the schedule space: loop-program features -> relative speed.

Trained on measured records of every task seen in a session: the target is each record's
throughput normalized by the best of its own task (so a small GEMM and a big conv train one
model), with failed configs left out (they would teach the model nothing true about speed).
Two objectives: `regression` on the normalized throughput, and `rank` (lambdarank, grouped per
task, on throughput buckets). `evaluate` reports top-k recall on held-out records so the two can
be compared.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

RANK_LEVELS = 30  # lambdarank relevance buckets of the normalized throughput
MIN_TRAINING_RECORDS = 8


class CostModel:
    def __init__(self, objective: str = "regression", seed: int = 0):
        if objective not in ("regression", "rank"):
            raise ValueError(f"unknown cost model objective {objective!r}")
        self.objective = objective
        self.seed = seed
        self._booster = None

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
            order = np.argsort(np.asarray(groups), kind="stable")
            features, labels = features[order], labels[order]
            sizes = np.unique(np.asarray(groups)[order], return_counts=True)[1]
            params |= {"objective": "lambdarank", "label_gain": list(range(RANK_LEVELS + 1))}
            data = lgb.Dataset(features, np.round(labels * RANK_LEVELS).astype(int), group=sizes)
        else:
            params |= {"objective": "regression"}
            data = lgb.Dataset(features, labels)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._booster = lgb.train(params, data, num_boost_round=80)
        return True

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Scores, higher = faster (comparable within one task)."""
        if self._booster is None:
            raise RuntimeError("the cost model is not trained")
        return self._booster.predict(np.asarray(features, np.float32))


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
