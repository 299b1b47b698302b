"""Cost-model profiles: the published fits, evaluated as docs/design.md section 9 states."""

import pytest

from prefixmesh.shared.costmodel import CostModel, available_profiles


def test_all_four_profiles_ship() -> None:
    assert set(available_profiles()) >= {"mistral-7b-a6000", "mistral-7b-a100",
                                         "llama3-70b-h100-tp2", "llama3-70b-a100-tp2"}


def test_a6000_large_batch_matches_the_fit() -> None:
    m = CostModel.load("mistral-7b-a6000")
    n, ctx = 1000, 1000
    expected_ms = (0.10842571 * n + 4.2098 + 0.32) / 0.9
    assert m.step_time([(n, ctx)]) == pytest.approx(expected_ms / 1000)


def test_a6000_attention_and_long_prompt_terms() -> None:
    m = CostModel.load("mistral-7b-a6000")
    e, s = 2048, 4096  # e*s > 1024^2: the quadratic term applies
    linear = 0.10842571 * e + 4.2098
    attention = 1.86e-4 * s + 0.159
    quad = 1.13e-3 * e + 1.75e-3 * s + 2.19e-6 * e * s
    assert m.step_time([(e, s)]) == pytest.approx((linear + attention + quad) / 0.9 / 1000)


def test_a6000_step_time_never_decreases_with_batch_tokens() -> None:
    m = CostModel.load("mistral-7b-a6000")
    times = [m.step_time([(n, 512)]) for n in range(1, 1200)]
    assert all(b >= a for a, b in zip(times, times[1:]))


def test_decode_step_grows_with_batch_context() -> None:
    m = CostModel.load("mistral-7b-a6000")
    small = m.step_time([(1, 1000)] * 32)
    big = m.step_time([(1, 8000)] * 32)
    assert big > small


def test_per_request_profile_charges_constant_once() -> None:
    m = CostModel.load("llama3-70b-h100-tp2")
    one = m.step_time([(1, 1000)])
    two = m.step_time([(1, 1000), (1, 1000)])
    assert one == pytest.approx((18.667 + 0.0799 + 2.685e-3 * 1000 + 7.443e-7 * 1000) / 1000)
    assert two - one < one / 2


def test_prefill_time_is_chunked_and_cached_tokens_save_time() -> None:
    m = CostModel.load("mistral-7b-a6000")
    assert m.prefill_time(0) == 0.0
    full = m.prefill_time(4000)
    assert full > m.prefill_time(2000) > 0
    assert m.prefill_time(4000 - 3000, cached_tokens=3000) < full


def test_marginal_decode_time_is_far_below_sequential() -> None:
    m = CostModel.load("mistral-7b-a6000")
    assert m.marginal_decode_time(2000) < m.decode_time(2000) / 10


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="mistral-7b-a6000"):
        CostModel.load("nope")


@pytest.mark.parametrize("profile", available_profiles())
def test_decodes_in_aggregate_cost_the_same_as_listed(profile: str) -> None:
    m = CostModel.load(profile)
    decodes = [(1, s) for s in (17, 300, 4_000, 90_000)]
    prefills = [(512, 2_048), (1_500, 1_500)]
    ctx = sum(s for _, s in decodes)
    for rest in ([], prefills):
        listed = m.step_time(decodes + rest)
        assert m.step_time(rest, len(decodes), ctx) == pytest.approx(listed, rel=1e-12)
    assert m.step_time([], 0, 0) == 0.0
