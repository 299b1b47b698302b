"""TRAIL's bins and Bayesian update against hand-computed cases (shared/trail/lengths.py)."""

from __future__ import annotations

import numpy as np
import pytest

from prefixmesh.shared.trail.lengths import (
    LengthBins,
    Smoother,
    bayes_update,
    expected_length,
    probe_estimate,
    remaining_given_running,
    softmax,
    transition_matrix,
)

TWO = LengthBins((0.0, 10.0, 20.0))  # widths 10, 10; centres 5, 15


def test_default_bins_are_trails() -> None:
    b = LengthBins.make()
    assert b.num_bins == 10
    assert b.edges[0] == 0.0 and b.edges[-1] == 512.0
    np.testing.assert_allclose(b.widths, 51.2)
    np.testing.assert_allclose(b.centres[:2], [25.6, 76.8])


def test_bin_of_clamps_at_both_ends() -> None:
    b = LengthBins.make()
    assert b.bin_of(-3).item() == 0
    assert b.bin_of(0).item() == 0
    assert b.bin_of(51.2).item() == 1  # edges belong to the bin they open
    assert b.bin_of(511.9).item() == 9
    assert b.bin_of(5000).item() == 9
    assert list(b.bin_of(np.array([10, 60, 200]))) == [0, 1, 3]


def test_log_bins() -> None:
    b = LengthBins.make(4, 1000.0, "log")
    np.testing.assert_allclose(b.edges, [0.0, 1.0, 10.0, 100.0, 1000.0])
    assert b.bin_of(5).item() == 1 and b.bin_of(50).item() == 2


@pytest.mark.parametrize("edges", [(1.0, 2.0), (0.0,), (0.0, 5.0, 5.0), (0.0, 3.0, 2.0)])
def test_bad_edges(edges: tuple[float, ...]) -> None:
    with pytest.raises(ValueError):
        LengthBins(edges)


def test_bad_spacing() -> None:
    with pytest.raises(ValueError):
        LengthBins.make(10, 512, "cubic")


def test_transition_matrix_from_widths() -> None:
    # One token per update, widths 10: leave bin 1 for bin 0 with probability 1/10.
    np.testing.assert_allclose(transition_matrix(TWO), [[1.0, 0.1], [0.0, 0.9]])
    # Four tokens per update; widths 2, 4, 8.
    t = transition_matrix(LengthBins((0.0, 2.0, 6.0, 14.0)), tokens_per_update=4)
    np.testing.assert_allclose(t, [[1.0, 1.0, 0.0], [0.0, 0.0, 0.5], [0.0, 0.0, 0.5]])
    np.testing.assert_allclose(t.sum(axis=0), 1.0)  # columns are distributions


def test_bayes_update_hand_computed() -> None:
    # prior = T @ [0.5, 0.5] = [0.55, 0.45]; * [0.2, 0.8] = [0.11, 0.36]; / 0.47.
    post = bayes_update(np.array([0.5, 0.5]), np.array([0.2, 0.8]), transition_matrix(TWO))
    np.testing.assert_allclose(post, [0.11 / 0.47, 0.36 / 0.47])
    # prediction = 5 * 0.2340 + 15 * 0.7660 = 12.6596
    assert expected_length(post, TWO) == pytest.approx(5 * 0.11 / 0.47 + 15 * 0.36 / 0.47)
    assert expected_length(post, TWO) == pytest.approx(12.659574, abs=1e-6)


def test_bayes_update_batch_matches_rows() -> None:
    t = transition_matrix(TWO)
    prev = np.array([[0.5, 0.5], [0.9, 0.1]])
    cur = np.array([[0.2, 0.8], [0.5, 0.5]])
    batch = bayes_update(prev, cur, t)
    for i in range(2):
        np.testing.assert_allclose(batch[i], bayes_update(prev[i], cur[i], t))
    # Row 2: prior [0.91, 0.09], evidence flat -> posterior = prior.
    np.testing.assert_allclose(batch[1], [0.91, 0.09])


def test_disjoint_evidence_falls_back_to_current() -> None:
    post = bayes_update(np.array([1.0, 0.0]), np.array([0.0, 2.0]), transition_matrix(TWO))
    np.testing.assert_allclose(post, [0.0, 1.0])


def test_budget_bin() -> None:
    b = LengthBins.make(10, 512, budget_bin=True)
    assert b.num_bins == 11 and b.edges[-3:] == (460.8, 512.0, 513.0)
    # A reply cut at the budget has its own bin; one token short of it does not.
    assert list(b.bin_of(np.array([511, 512]))) == [9, 10]
    assert b.centres[-1] == 512.5


def test_remaining_given_running_hand_computed() -> None:
    # Total length uniform over [0, 20): at t = 0 the mean is 10; at t = 5 bin 0 keeps its
    # share above 5 (0.25, mean 7.5) beside bin 1 (0.5, mean 15): (1.875 + 7.5) / 0.75 =
    # 12.5, so 7.5 left; at t = 15 only [15, 20) is left: 2.5.
    flat = np.array([0.5, 0.5])
    assert remaining_given_running(flat, TWO, 0) == pytest.approx(10.0)
    assert remaining_given_running(flat, TWO, 5) == pytest.approx(7.5)
    assert remaining_given_running(flat, TWO, 15) == pytest.approx(2.5)
    # Rows with their own steps; no mass above t -> 0 (the reply should have ended).
    np.testing.assert_allclose(
        remaining_given_running(np.array([[0.5, 0.5], [1.0, 0.0]]), TWO, np.array([5, 12])),
        [7.5, 0.0])
    np.testing.assert_allclose(probe_estimate(np.array([[0.5, 0.5]]), TWO, np.array([5]),
                                              "total"), [7.5])
    assert probe_estimate(flat, TWO, 5, "remaining") == pytest.approx(10.0)  # t unused
    with pytest.raises(ValueError):
        probe_estimate(flat, TWO, 5, "tokens")


def test_smoother_over_the_total_length() -> None:
    # The total length does not move: no transition, so prior [0.5, 0.5] times evidence
    # [0.2, 0.8] is [0.2, 0.8]; at t = 12 only bin 1's part above 12 counts: 16 - 12 = 4.
    s = Smoother(TWO, np.array([0.5, 0.5]), tokens_per_update=8, target="total")
    assert s.update(np.array([0.2, 0.8]), 12) == pytest.approx(4.0)
    np.testing.assert_allclose(s.posterior, [0.2, 0.8])
    # TRAIL's remaining-length smoother moves mass down a bin instead (8/10 of bin 1).
    r = Smoother(TWO, np.array([0.5, 0.5]), tokens_per_update=8)
    r.update(np.array([0.2, 0.8]))
    np.testing.assert_allclose(r.posterior, np.array([0.9 * 0.2, 0.1 * 0.8]) / 0.26)
    with pytest.raises(ValueError):
        Smoother(TWO, np.array([0.5, 0.5]), target="tokens")


def test_smoother_moves_down_with_confident_evidence() -> None:
    s = Smoother(TWO, np.array([0.0, 1.0]))
    # Evidence for bin 0 but the prior says bin 1 with 0.9: posterior = [0.1*.9, .9*.1]/...
    est = s.update(np.array([0.9, 0.1]))
    np.testing.assert_allclose(s.posterior, [0.5, 0.5])
    assert est == pytest.approx(10.0)
    with pytest.raises(ValueError):
        Smoother(TWO, np.array([1.0, 0.0, 0.0]))


def test_softmax_rows_sum_to_one() -> None:
    p = softmax(np.array([[1000.0, 1000.0], [0.0, np.log(3.0)]]))
    np.testing.assert_allclose(p, [[0.5, 0.5], [0.25, 0.75]])


def test_bins_round_trip() -> None:
    b = LengthBins.make(6, 300, "log")
    assert LengthBins.from_dict(b.to_dict()) == b


def test_forgetting_update_hand_computed() -> None:
    # prior = T @ [0.5, 0.5] = [0.55, 0.45]; forget 0.5: sqrt -> [0.741620, 0.670820];
    # * [0.2, 0.8] = [0.148324, 0.536656]; / 0.684980 -> [0.216538, 0.783462].
    t = transition_matrix(TWO)
    post = bayes_update(np.array([0.5, 0.5]), np.array([0.2, 0.8]), t, forget=0.5)
    np.testing.assert_allclose(post, [0.216538, 0.783462], atol=1e-6)
    # TRAIL's update is forget = 1; forget = 0 keeps only the current reading.
    np.testing.assert_allclose(bayes_update(np.array([0.5, 0.5]), np.array([0.2, 0.8]), t,
                                            forget=1.0), [0.11 / 0.47, 0.36 / 0.47])
    np.testing.assert_allclose(bayes_update(np.array([0.9, 0.1]), np.array([0.2, 0.8]), t,
                                            forget=0.0), [0.2, 0.8])
    with pytest.raises(ValueError):
        bayes_update(np.array([0.5, 0.5]), np.array([0.2, 0.8]), t, forget=1.5)


def test_forgetting_smoother_follows_evidence_faster() -> None:
    # Three readings for bin 0 after a confident bin-1 start: the tempered posterior moves
    # further toward bin 0 than TRAIL's (which multiplies in the whole history).
    stiff = Smoother(TWO, np.array([0.01, 0.99]))
    loose = Smoother(TWO, np.array([0.01, 0.99]), forget=0.5)
    for _ in range(3):
        a = stiff.update(np.array([0.7, 0.3]))
        b = loose.update(np.array([0.7, 0.3]))
    assert b < a
    # By hand, first reading: prior = [0.01 + 0.099, 0.891] = [0.109, 0.891];
    # TRAIL: [0.0763, 0.2673] / 0.3436 -> estimate 5 + 10 * 0.7779 = 12.779.
    s = Smoother(TWO, np.array([0.01, 0.99]))
    assert s.update(np.array([0.7, 0.3])) == pytest.approx(5 + 10 * 0.2673 / 0.3436, abs=1e-4)


def test_refine_runs_one_smoother_per_request_in_step_order() -> None:
    from prefixmesh.loadgen.predictor.train import refine

    init = np.array([[0.5, 0.5], [0.0, 1.0]])
    probs = np.array([[0.2, 0.8], [0.9, 0.1], [0.9, 0.1]])
    owner = np.array([0, 1, 0])  # rows 0 and 2 are request 0's first and second readings
    steps = np.array([0, 0, 1])
    got = refine(init, probs, owner, steps, TWO, stride=1, forget=0.5)
    a = Smoother(TWO, init[0], 1, forget=0.5)
    b = Smoother(TWO, init[1], 1, forget=0.5)
    np.testing.assert_allclose(got, [a.update(probs[0]), b.update(probs[1]), a.update(probs[2])])
    # Over the total length each reading is read at its own step.
    got = refine(init, probs, owner, steps, TWO, stride=1, forget=0.5, target="total")
    a = Smoother(TWO, init[0], 1, forget=0.5, target="total")
    b = Smoother(TWO, init[1], 1, forget=0.5, target="total")
    np.testing.assert_allclose(got, [a.update(probs[0], 0), b.update(probs[1], 0),
                                     a.update(probs[2], 1)])


def test_train_epochs_argument_is_auto_or_a_positive_count() -> None:
    from prefixmesh.loadgen.predictor.train import build_parser

    parse = build_parser().parse_args
    assert parse(["train", "--out", "a"]).epochs == "auto"
    assert parse(["train", "--out", "a", "--epochs", "5"]).epochs == "5"
    for bad in ("0", "-3", "many"):
        with pytest.raises(SystemExit):
            parse(["train", "--out", "a", "--epochs", bad])


def test_generated_reply_is_cut_after_its_first_end_token() -> None:
    from prefixmesh.loadgen.predictor.data import _cut_at_end

    assert _cut_at_end([5, 6, 2, 2, 2]) == [5, 6, 2]  # <|im_end|>, then padding
    assert _cut_at_end([5, 0, 7]) == [5, 0]  # <|endoftext|>
    assert _cut_at_end([5, 6, 7]) == [5, 6, 7]  # cut by the token cap: no end token


def test_hidden_state_cache_key_tells_model_replies_apart() -> None:
    from prefixmesh.loadgen.predictor.data import Sample, _chunk_key

    share = [Sample(3, "p", [1, 2], [4, 5, 2])]
    same_lengths = [Sample(3, "p", [1, 2], [8, 9, 2], "model")]
    other_tokens = [Sample(3, "p", [1, 2], [8, 7, 2], "model")]
    key = lambda chunk: _chunk_key(chunk, [20], 8, 2048)  # noqa: E731
    assert len({key(share), key(same_lengths), key(other_tokens)}) == 3
    # ShareGPT chunks keep the key they had before replies could come from the model.
    assert key(share) == key([Sample(3, "p", [1, 2], [6, 6, 2])])


def test_remaining_median_reads_only_the_replies_still_running() -> None:
    from prefixmesh.loadgen.predictor.train import remaining_median

    lengths = np.array([10, 20, 30, 100])
    got = remaining_median(lengths, np.array([0, 15, 25, 50, 100, 15]))
    # t=0: median of all = 25; t=15: of 20,30,100 -> 30 - 15; t=25: of 30,100 -> 65 - 25;
    # t=50: of 100 -> 50; t=100: none is longer -> 0.
    np.testing.assert_allclose(got, [25, 15, 40, 50, 0, 15])


def test_probe_input_appends_repeated_step_features() -> None:
    from prefixmesh.shared.trail.lengths import STEP_REPEAT, STEP_SCALE, probe_input

    h = np.ones((3, 4))
    assert probe_input(h, np.array([0, 1, 2]), False).shape == (3, 4)
    x = probe_input(h, np.array([0, 8, 512]), True)
    assert x.shape == (3, 4 + 2 * STEP_REPEAT) and x.dtype == np.float32
    np.testing.assert_allclose(x[:, 4], np.log1p([0, 8, 512]), rtol=1e-6)
    np.testing.assert_allclose(x[:, 4 + STEP_REPEAT], np.array([0, 8, 512]) / STEP_SCALE)
    one = probe_input(np.ones(4), 8, True)  # one hidden state at one step (the worker)
    np.testing.assert_allclose(one, x[1])
