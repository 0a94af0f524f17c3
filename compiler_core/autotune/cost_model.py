"""A LightGBM cost model of the schedule space: loop-program features -> relative speed.

Trained on measured records of every task seen in a session: the target is each record's
throughput normalized by the best of its own task (so a small GEMM and a big conv train one
model), with failed configs left out (they would teach the model nothing true about speed).
Two objectives: `regression` on the normalized throughput, and `rank` (lambdarank, grouped per
task, on throughput buckets).

Once there are enough records, a share of each task's is held out: each objective boosts
until its error on them stops falling (a fixed round count over-fits a few dozen records and
under-fits thousands), the two are compared on how fast a config each one ranks first among
each task's held-out records runs, and the better one (`chosen`) is refit on every record
for its number of rounds. `objective="regression"` or `"rank"` fixes the objective instead
(`bench.search` compares the two that way).

Transfer (`learn_prior`): records of other workloads, from other models' tuning, train a prior
model first; every later fit then boosts on from the prior's scores (its predictions are the
rows' initial scores) instead of pooling the two, so that a session's own few dozen records
correct the prior where it is wrong instead of drowning among thousands of another model's
(AutoTVM's transfer learning keeps a base model the same way). Before a session has records
enough to fit, the prior ranks alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np

OBJECTIVES = ("regression", "rank")
AUTO = "auto"  # the objective that ranks the held-out records better, at every fit
RANK_LEVELS = 30  # lambdarank relevance buckets of the normalized throughput
MIN_TRAINING_RECORDS = 8
MAX_ROUNDS = 300
FIXED_ROUNDS = 80  # below MIN_HOLD_OUT_RECORDS: too few to hold any out
MIN_HOLD_OUT_RECORDS = 48
HOLD_OUT_SHARE = 0.2
STOPPING_ROUNDS = 20
PARAMS = {
    "learning_rate": 0.1,
    "num_leaves": 15,
    "min_data_in_leaf": 2,
    "feature_fraction": 0.8,
    "bagging_fraction": 0.8,
    "bagging_freq": 1,
    "verbose": -1,
    "num_threads": 1,
}
OBJECTIVE_PARAMS = {
    "regression": {"objective": "regression", "metric": "l2"},
    "rank": {
        "objective": "lambdarank",
        "label_gain": list(range(RANK_LEVELS + 1)),
        "metric": "ndcg",
        "eval_at": [5],
    },
}


class CostModel:
    def __init__(self, objective: str = AUTO, seed: int = 0):
        if objective not in (*OBJECTIVES, AUTO):
            raise ValueError(f"unknown cost model objective {objective!r}")
        self.objective = objective
        self.seed = seed
        self._booster = None
        self.chosen = None if objective == AUTO else objective  # the objective in use
        self.rounds = 0  # boosting rounds of the current model
        # Per objective compared at the last fit: the held-out records' mean speed (relative to
        # each task's fastest held-out record) of the config it ranked first.
        self.held_out_quality: dict[str, float] = {}
        self._prior: CostModel | None = None  # other workloads' model (`learn_prior`)
        self._groups: frozenset[str] = frozenset()  # the workloads of the last fit

    @property
    def trained(self) -> bool:
        return self._booster is not None or self._prior is not None

    @property
    def prior_groups(self) -> frozenset[str]:
        """The workloads the prior was fit on (none without one)."""
        return self._prior._groups if self._prior is not None else frozenset()

    def learn_prior(
        self, features: np.ndarray, throughput: np.ndarray, groups: Sequence[str]
    ) -> bool:
        """Fit the prior on other workloads' records (see the module's doc): it ranks until
        `fit` has rows enough, and every later fit boosts on from its scores, with its
        objective. Returns False (no prior) when there is too little to learn from."""
        prior = CostModel(self.objective, self.seed)
        if not prior.fit(features, throughput, groups):
            return False
        self._prior, self.chosen = prior, prior.chosen
        self._booster, self.rounds = None, 0
        return True

    def fit(self, features: np.ndarray, throughput: np.ndarray, groups: Sequence[str]) -> bool:
        """Train on (features, throughput) rows, `groups` naming each row's task (on top of
        the prior, if there is one). Returns False (and keeps the previous model) when there
        is too little to learn from."""
        features = np.asarray(features, np.float32)
        labels = _normalized(np.asarray(throughput, np.float64), list(groups))
        if len(labels) < MIN_TRAINING_RECORDS or np.ptp(labels) == 0:
            return False
        groups = np.asarray(groups)
        if self._prior is not None:  # the prior's scores are in its objective's units
            candidates = (self._prior.chosen,)
            initial = self._prior.predict(features)
        else:
            candidates = OBJECTIVES if self.objective == AUTO else (self.objective,)
            initial = None  # LightGBM then starts regression from the labels' mean
        held = _held_out_rows(groups, self.seed)
        if len(labels) >= MIN_HOLD_OUT_RECORDS and held.any():
            trials = {
                o: self._held_out_trial(o, features, labels, groups, initial, held)
                for o in candidates
            }
            self.held_out_quality = {o: quality for o, (_, quality) in trials.items()}
            objective = max(candidates, key=lambda o: trials[o][1])  # a tie keeps the first
            rounds = trials[objective][0]
        else:
            objective, rounds = self.chosen or candidates[0], FIXED_ROUNDS
        self._booster = self._train(objective, features, labels, groups, initial, rounds)
        self.chosen, self.rounds = objective, rounds
        self._groups = frozenset(groups.tolist())
        return True

    def _held_out_trial(
        self,
        objective: str,
        features: np.ndarray,
        labels: np.ndarray,
        groups: np.ndarray,
        initial: np.ndarray | None,
        held: np.ndarray,
    ) -> tuple[int, float]:
        """(rounds, quality) of `objective` trained on the rows not `held`, boosting on from
        their `initial` scores: the boosting round where its error on the held rows stopped
        falling, and how fast the held row it ranks first in each task runs (1: the task's
        fastest held row), averaged over tasks."""
        import lightgbm as lgb

        def part(rows):
            return None if initial is None else initial[rows]

        valid = _dataset(objective, features[held], labels[held], groups[held], part(held))
        booster = self._train(
            objective,
            features[~held],
            labels[~held],
            groups[~held],
            part(~held),
            MAX_ROUNDS,
            valid_sets=[valid],
            callbacks=[lgb.early_stopping(STOPPING_ROUNDS, verbose=False)],
        )
        scores = booster.predict(features[held], num_iteration=booster.best_iteration)
        if initial is not None:
            scores = scores + initial[held]
        return max(booster.best_iteration, 1), _top_pick_quality(scores, labels[held], groups[held])

    def _train(self, objective, features, labels, groups, initial, rounds, **options):
        import lightgbm as lgb

        params = PARAMS | OBJECTIVE_PARAMS[objective] | {"seed": self.seed}
        data = _dataset(objective, features, labels, groups, initial)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return lgb.train(params, data, rounds, **options)

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Scores, higher = faster (comparable within one task): the prior's, plus what the
        fit on the session's records adds."""
        if not self.trained:
            raise RuntimeError("the cost model is not trained")
        features = np.asarray(features, np.float32)
        scores = self._prior.predict(features) if self._prior is not None else 0.0
        if self._booster is not None:
            scores = scores + self._booster.predict(features)
        return np.asarray(scores, np.float64)


def _dataset(
    objective: str,
    features: np.ndarray,
    labels: np.ndarray,
    groups: np.ndarray,
    initial: np.ndarray | None,
):
    """LightGBM's view of the rows: throughput labels for regression, relevance buckets in
    contiguous per-task groups for lambdarank; boosting starts from the `initial` scores
    (the prior's) when given."""
    import lightgbm as lgb

    if objective != "rank":
        return lgb.Dataset(features, labels, init_score=initial)
    order = np.argsort(groups, kind="stable")
    sizes = np.unique(groups[order], return_counts=True)[1]
    relevance = np.round(labels[order] * RANK_LEVELS).astype(int)
    return lgb.Dataset(
        features[order],
        relevance,
        group=sizes,
        init_score=None if initial is None else initial[order],
    )


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


def _top_pick_quality(scores: np.ndarray, labels: np.ndarray, groups: np.ndarray) -> float:
    """Mean over groups of the label of the row scored highest, relative to the group's best
    label (the search measures a model's top picks: how fast they run is what counts)."""
    values = []
    for group in np.unique(groups):
        rows = np.flatnonzero(groups == group)
        best = labels[rows].max()
        if len(rows) > 1 and best > 0:
            values.append(labels[rows[np.argmax(scores[rows])]] / best)
    return float(np.mean(values)) if values else 0.0


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
