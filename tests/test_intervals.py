"""intervals.py on small hand-computed cases: t quantiles from the tables, paired, Welch and
across-model estimates, and how n = 1 and n = 2 are written."""
import math

import pytest

import intervals as I


@pytest.mark.parametrize("df,want", [(1, 12.7062), (2, 4.3027), (3, 3.1824), (6, 2.4469), (30, 2.0423),
                                     (math.inf, 1.9600)])
def test_t_quantile_matches_the_tables(df, want):
    assert I.t_quantile(0.975, df) == pytest.approx(want, abs=1e-4)


def test_t_cdf_is_symmetric_and_gives_the_two_sided_p_of_two_standard_errors_at_df_2():
    assert I.t_cdf(0.0, 3) == pytest.approx(0.5)
    assert I.t_cdf(-1.3, 4.5) == pytest.approx(1 - I.t_cdf(1.3, 4.5))
    # at df 2 an effect of twice its standard error is p = 1 - 2/sqrt(6) = 0.1835 two-sided
    assert 2 * (1 - I.t_cdf(2.0, 2)) == pytest.approx(1 - 2 / math.sqrt(6), abs=1e-9)
    # df 1 is the Cauchy distribution: P(T <= 1) = 3/4
    assert I.t_cdf(1.0, 1) == pytest.approx(0.75, abs=1e-12)


def test_paired_is_the_one_sample_estimate_of_the_differences_over_shared_units():
    e = I.paired({0: 1.0, 1: 2.0, 2: 4.0, 3: 9.0}, {0: 0.0, 1: 0.0, 2: 1.0})   # unit 3 has no partner
    # differences 1, 2, 3: mean 2, s = 1, se = 1/sqrt(3), df 2
    assert (e.mean, e.n, e.df) == (2.0, 3, 2)
    assert e.se == pytest.approx(1 / math.sqrt(3))
    lo, hi = e.ci()
    assert hi - 2.0 == pytest.approx(4.302653 / math.sqrt(3), abs=1e-5)
    assert lo < 0 < hi and not e.excludes_zero()
    assert e.text() == "+2.0 ± 0.6 (95% CI [-0.5, +4.5], n = 3, df 2)"
    assert e.verdict() == "the interval holds 0: not told apart (an effect up to 4.5 points could hide)"


def test_units_that_all_agree_give_no_interval_and_no_verdict_of_a_difference():
    # three seeds that each differ by exactly +20: the t interval has zero width, which is not
    # evidence that the arms differ, only that these units did not vary
    e = I.paired({0: 30.0, 1: 40.0, 2: 50.0}, {0: 10.0, 1: 20.0, 2: 30.0})
    assert (e.mean, e.se) == (20.0, 0.0) and e.excludes_zero() is None
    assert e.text() == "+20.0 (n = 3, all equal: no spread to give an interval)"
    assert e.verdict() == "+20.0 points with no spread among the units: no interval, so not told apart by one"
    assert "differ" not in I.sample([0.0, 0.0, 0.0]).verdict()
    # two arms that are each constant: the same, unpaired
    assert I.welch([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]).verdict().startswith("-1.0 points with no spread")


def test_welch_uses_each_arms_own_variance_and_satterthwaite_df():
    e = I.welch([1.0, 2.0, 3.0], [4.0, 5.0, 7.0, 9.0])
    # var(a)/3 = 1/3, var(b)/4 = (59/12)/4 = 59/48; se = sqrt(75/48) = 1.25;
    # df = (75/48)^2 / ((1/3)^2/2 + (59/48)^2/3)
    assert e.mean == pytest.approx(2.0 - 6.25)
    assert e.se == pytest.approx(1.25)
    assert e.df == pytest.approx((75 / 48) ** 2 / ((1 / 9) / 2 + (59 / 48) ** 2 / 3))
    assert e.ns == (3, 4) and "n = 3 and 4" in e.text()
    assert e.excludes_zero() and e.verdict() == "the interval excludes 0: the arms differ"


def test_across_models_carries_each_models_error_when_the_model_means_agree():
    # three per-model effects that happen to agree: the spread of their means alone would give
    # se 1.1; carrying the models' own errors through gives sqrt(4.3^2 + 4.3^2 + 10^2) / 3
    per = [I.Estimate(-19.3, 4.3, 2, 3), I.Estimate(-20.3, 4.3, 1, 2), I.Estimate(-22.9, 10.0, 1, 2)]
    e = I.across(per)
    assert e.mean == pytest.approx(-62.5 / 3)
    assert e.se == pytest.approx(math.sqrt(4.3 ** 2 + 4.3 ** 2 + 100) / 3)
    v = [4.3 ** 2 / 9, 4.3 ** 2 / 9, 100 / 9]
    assert e.df == pytest.approx(sum(v) ** 2 / (v[0] ** 2 / 2 + v[1] ** 2 + v[2] ** 2))
    assert e.n == 7


def test_across_models_adds_the_spread_between_models_when_it_exceeds_their_errors():
    per = [I.Estimate(0.0, 1.0, 4, 5), I.Estimate(10.0, 1.0, 4, 5)]
    e = I.across(per)
    # var of the means 50, mean se^2 1: tau^2 = 49; var = (1 + 1)/4 + 49/2
    assert e.se == pytest.approx(math.sqrt(0.5 + 24.5))
    assert e.df == pytest.approx(25.0 ** 2 / (2 * 0.25 ** 2 / 4 + 24.5 ** 2 / 1))


def test_across_needs_an_error_in_every_model():
    assert I.across([I.Estimate(1.0, 0.5, 2, 3), I.Estimate(2.0, None, None, 1, [2.0])]) is None
    assert I.across([I.Estimate(1.0, 0.5, 2, 3)]) is None


def test_one_and_two_units_are_written_without_an_error():
    assert I.sample([3.0]).text() == "+3.0 (a single run)"
    two = I.sample([3.0, 5.0])
    assert two.text() == "+4.0 (n = 2: +3.0, +5.0)"
    assert "±" not in two.text()
    assert I.welch([1.0], [4.0, 5.0]).text() == "-3.5 (n = 1 and 2: too few for an interval)"
    assert I.welch([1.0, 2.0], [4.0, 5.0, 7.0]).ci() is None              # an arm of 2: no interval either
    assert I.welch([1.0, 2.0], [4.0, 5.0, 7.0]).verdict() == "too few units for an interval: not told apart"
    assert I.sample([None, None]) is None


def test_holm_steps_down_through_a_familys_p_values():
    """Four tests at a family-wise 5%: 0.01 <= 0.05/4 = 0.0125 is kept; then 0.02 > 0.05/3 = 0.0167
    stops the step-down, so 0.03 is not kept although it would pass 0.05/2 on its own."""
    assert I.holm([0.03, 0.01, 0.02, None, 0.5]) == [False, True, False, False, False]
    assert I.holm([0.001, 0.012, 0.024]) == [True, True, True]       # 0.05/3, 0.05/2, 0.05/1
    assert I.holm([]) == []


def test_p_is_the_two_sided_t_p_of_the_interval_and_none_without_one():
    e = I.sample([1.0, 2.0, 3.0])                     # mean 2, se 1/sqrt(3), df 2
    t = 2 / (1 / math.sqrt(3))
    # df 2: P(|T| > t) = 1 - t / sqrt(t^2 + 2), closed form
    assert e.p() == pytest.approx(1 - t / math.sqrt(t * t + 2), rel=1e-9)
    assert I.sample([1.0, 1.0, 1.0]).p() is None and I.sample([1.0, 2.0]).p() is None
