"""TRAIL's length bins and Bayesian smoothing of per-step predictions (numpy only).

TRAIL ("Don't Stop Me Now: Embedding Based Scheduling for LLMs", s.3) predicts an output
length as a distribution over length bins: 10 equal bins over 0-512 tokens by default
(lengths past the last edge fall in the last bin). The prompt encoder gives the initial
distribution; at each decode step a probe over the serving model's hidden state gives a
fresh distribution over the *remaining* length, and the two are combined by a Bayesian
update so one noisy step cannot swing the estimate:

    prior     = T @ previous posterior      (T: column-stochastic bin transition matrix)
    posterior = prior * current / sum(...)  (current: the probe's softmax at this step)
    estimate  = sum(posterior * bin centres) (tokens)

That update treats every reading as independent evidence, so after n readings the
posterior weighs each of them equally and grows stiff. An optional forgetting factor
``f`` in [0, 1] tempers the carried-over belief before the new reading is folded in,

    posterior = (T @ previous)^f * current / sum(...)

so a reading k updates old weighs ``f^k`` in log space (an effective memory of about
``1 / (1 - f)`` readings). ``f = 1`` is TRAIL's update (the default); ``f = 0`` keeps only
the current reading.

What the probe predicts (``PROBE_TARGETS``) is TRAIL's remaining length by default. The
other target is the reply's *total* length ``L``: a label that does not move as the reply
grows, so a reply that will run to its token budget has one label at every step instead of
``budget - t``. Its bins are the head's, the head's distribution is the prior as it is,
``T`` is the identity (``L`` does not change), and the prediction at step ``t`` is the
remaining length of a reply that has not ended yet: ``E[L | L > t] - t``
(``remaining_given_running``).

With a token budget (replies are cut at ``max_tokens``), ``LengthBins.make(budget_bin=True)``
adds one bin ``[max_tokens, max_tokens + 1)`` after the equal ones: "runs to the budget"
becomes a class of its own, whose value is the budget, rather than a share of the widest
bin below it.

``T`` follows from the bin widths: every generated token lowers the remaining length by one,
so between two updates ``k`` tokens apart a request in bin ``i`` (width ``w_i``) moves down
one bin with probability ``min(1, k / w_i)`` and stays otherwise; bin 0 absorbs.

Pure logic: no I/O, no torch; the worker's refiner and the eval CLI both use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# TRAIL's defaults: 10 bins of equal width over [0, 512) output tokens.
DEFAULT_NUM_BINS = 10
DEFAULT_MAX_TOKENS = 512.0
BIN_SPACINGS = ("linear", "log")
# What the probe is trained to predict at each step (module doc).
PROBE_TARGETS = ("remaining", "total")
# Floor on a posterior's mass before normalising; below it the update falls back to the
# current distribution (the prior and the new evidence disagree completely).
MIN_MASS = 1e-12


@dataclass(frozen=True)
class LengthBins:
    """Bin edges over output tokens: bin ``i`` is ``[edges[i], edges[i+1])``; the last bin
    also holds every length at or past the last edge."""

    edges: tuple[float, ...]

    def __post_init__(self) -> None:
        e = np.asarray(self.edges, dtype=np.float64)
        if e.ndim != 1 or len(e) < 2 or e[0] != 0.0 or np.any(np.diff(e) <= 0):
            raise ValueError(f"bin edges must start at 0 and increase strictly: {self.edges}")

    @classmethod
    def make(cls, num_bins: int = DEFAULT_NUM_BINS, max_tokens: float = DEFAULT_MAX_TOKENS,
             spacing: str = "linear", budget_bin: bool = False) -> LengthBins:
        """``num_bins`` bins over [0, max_tokens): equal widths, or log-spaced edges from 1
        (short outputs get narrow bins; the first bin is [0, 1)); with ``budget_bin`` one
        more, ``[max_tokens, max_tokens + 1)``, for replies cut at ``max_tokens`` tokens."""
        if num_bins < 1 or max_tokens <= 1:
            raise ValueError("need num_bins >= 1 and max_tokens > 1")
        if spacing == "linear":
            edges = np.linspace(0.0, max_tokens, num_bins + 1)
        elif spacing == "log":
            edges = np.concatenate([[0.0], np.geomspace(1.0, max_tokens, num_bins)])
        else:
            raise ValueError(f"spacing must be one of {BIN_SPACINGS}, not {spacing!r}")
        if budget_bin:
            edges = np.append(edges, max_tokens + 1.0)
        return cls(tuple(float(x) for x in edges))

    @property
    def num_bins(self) -> int:
        """Number of bins."""
        return len(self.edges) - 1

    @property
    def widths(self) -> np.ndarray:
        """Width of each bin (tokens)."""
        return np.diff(np.asarray(self.edges, dtype=np.float64))

    @property
    def centres(self) -> np.ndarray:
        """Midpoint of each bin (tokens): the value a bin predicts."""
        e = np.asarray(self.edges, dtype=np.float64)
        return (e[:-1] + e[1:]) / 2.0

    def bin_of(self, lengths: np.ndarray | float) -> np.ndarray:
        """Bin index of each length (negative lengths -> bin 0, past the end -> last)."""
        inner = np.asarray(self.edges[1:-1], dtype=np.float64)
        return np.searchsorted(inner, np.asarray(lengths, dtype=np.float64), side="right")

    def to_dict(self) -> dict:
        """JSON-ready form, saved beside trained artifacts."""
        return {"edges": list(self.edges)}

    @classmethod
    def from_dict(cls, d: dict) -> LengthBins:
        """Inverse of ``to_dict``."""
        return cls(tuple(float(x) for x in d["edges"]))


def transition_matrix(bins: LengthBins, tokens_per_update: float = 1.0) -> np.ndarray:
    """Column-stochastic ``T`` (``T[j, i]`` = P(bin j after | bin i before)) for updates
    ``tokens_per_update`` generated tokens apart."""
    if tokens_per_update <= 0:
        raise ValueError("tokens_per_update must be > 0")
    n = bins.num_bins
    move = np.minimum(1.0, tokens_per_update / bins.widths)
    move[0] = 0.0  # remaining length cannot drop below bin 0
    t = np.diag(1.0 - move)
    t[np.arange(n - 1), np.arange(1, n)] = move[1:]
    return t


def bayes_update(previous: np.ndarray, current: np.ndarray, transition: np.ndarray,
                 forget: float = 1.0) -> np.ndarray:
    """TRAIL's update: posterior proportional to ``(T @ previous) * current``, normalised;
    with ``forget`` < 1 the prior is raised to that power first (see module doc).

    Works on one distribution (shape ``[bins]``) or a batch (``[n, bins]``, row-wise).
    Where prior and evidence share no mass, the posterior is ``current`` itself.
    """
    if not 0.0 <= forget <= 1.0:
        raise ValueError("forget must be in [0, 1]")
    prev = np.asarray(previous, dtype=np.float64)
    cur = np.asarray(current, dtype=np.float64)
    prior = prev @ transition.T  # row-vector form of T @ p, batch-friendly
    if forget != 1.0:
        prior = prior ** forget  # 0 ** 0 = 1: with forget 0 every bin is allowed again
    post = prior * cur
    mass = post.sum(axis=-1, keepdims=True)
    ok = mass > MIN_MASS
    cur_norm = cur / np.maximum(cur.sum(axis=-1, keepdims=True), MIN_MASS)
    return np.where(ok, post / np.where(ok, mass, 1.0), cur_norm)


def expected_length(dist: np.ndarray, bins: LengthBins) -> np.ndarray | float:
    """Prediction from a bin distribution: ``sum(dist * centres)`` (tokens)."""
    out = np.asarray(dist, dtype=np.float64) @ bins.centres
    return float(out) if np.ndim(out) == 0 else out


def remaining_given_running(dist: np.ndarray, bins: LengthBins, t: np.ndarray | float
                            ) -> np.ndarray | float:
    """Remaining tokens of a reply that has produced ``t`` tokens and not ended, from a
    distribution over its *total* length: ``E[L | L > t] - t``, each bin's mass spread
    evenly over the bin (the bin holding ``t`` keeps the share above ``t``). 0 when no
    mass lies above ``t``. One ``[bins]`` row with a scalar ``t``, or ``[n, bins]`` rows
    with ``n`` steps."""
    p = np.atleast_2d(np.asarray(dist, dtype=np.float64))
    t_col = np.asarray(t, dtype=np.float64).reshape(-1, 1)
    e = np.asarray(bins.edges, dtype=np.float64)
    lo, hi = e[:-1], e[1:]
    kept = p * np.clip((hi - t_col) / (hi - lo), 0.0, 1.0)
    mass = kept.sum(axis=-1)
    mean_above = (kept @ hi + (kept * np.maximum(lo, t_col)).sum(axis=-1)) / 2.0
    out = np.where(mass > MIN_MASS, mean_above / np.maximum(mass, MIN_MASS) - t_col[:, 0], 0.0)
    return float(out[0]) if np.ndim(dist) == 1 else out


def probe_estimate(dist: np.ndarray, bins: LengthBins, steps: np.ndarray | float,
                   target: str) -> np.ndarray | float:
    """Remaining tokens at each of ``steps`` from distributions over the ``target``'s bins."""
    if target == "remaining":
        return expected_length(dist, bins)
    if target == "total":
        return remaining_given_running(dist, bins, steps)
    raise ValueError(f"target must be one of {PROBE_TARGETS}, not {target!r}")


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax, numerically stable."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


# Step features of the probe's input (``probe_input``; artifacts with ``step_features``):
# log(1 + t) and t / STEP_SCALE, each repeated STEP_REPEAT times so that two inputs are not
# drowned by the hidden state's hundreds at the first layer's initialisation.
STEP_SCALE = 512.0
STEP_REPEAT = 8
STEP_FEATURE_DIM = 2 * STEP_REPEAT  # columns probe_input appends


def probe_input(hidden: np.ndarray, steps: np.ndarray | int, step_features: bool) -> np.ndarray:
    """The probe's input rows: hidden states ``[rows, dim]`` (or one ``[dim]``), with the
    step features of their decode steps appended when ``step_features``."""
    hidden = np.asarray(hidden, dtype=np.float32)
    if not step_features:
        return hidden
    t = np.asarray(steps, dtype=np.float32)
    feats = np.stack([np.log1p(t), t / STEP_SCALE], -1)
    return np.concatenate([hidden, np.repeat(feats, STEP_REPEAT, -1)], -1)


class Smoother:
    """Per-request running posterior: seed it with the initial distribution, feed it each
    step's probe distribution, read the expected remaining tokens. With ``target="total"``
    the posterior is over the reply's total length (module doc)."""

    def __init__(self, bins: LengthBins, initial: np.ndarray, tokens_per_update: float = 1.0,
                 forget: float = 1.0, target: str = "remaining") -> None:
        if target not in PROBE_TARGETS:
            raise ValueError(f"target must be one of {PROBE_TARGETS}, not {target!r}")
        self.bins = bins
        self.forget = forget  # 1.0: TRAIL's update; below 1: tempered (module doc)
        self.target = target
        self.transition = (transition_matrix(bins, tokens_per_update) if target == "remaining"
                           else np.eye(bins.num_bins))  # a total length does not move
        self.posterior = np.asarray(initial, dtype=np.float64)
        if self.posterior.shape != (bins.num_bins,):
            raise ValueError("initial distribution does not match the bins")

    def update(self, current: np.ndarray, t: float = 0.0) -> float:
        """Fold in the distribution read at step ``t`` (output tokens so far); return the
        expected remaining tokens."""
        self.posterior = bayes_update(self.posterior, current, self.transition, self.forget)
        return float(probe_estimate(self.posterior, self.bins, t, self.target))
