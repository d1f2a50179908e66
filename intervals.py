"""What a handful of runs can say: estimates with their standard error, degrees of freedom and
a t-based 95% interval, and how a number of runs is written.

    e = intervals.paired({0: 51.2, 1: 48.0}, {0: 40.1, 1: 45.3})   # A minus B over shared seeds
    e = intervals.welch([51.2, 48.0, 49.9], [40.1, 45.3])          # unpaired
    e = intervals.across([e_model0, e_model1, e_model2])           # the mean of per-model effects
    e.text()      # '+6.3 ± 2.1 (95% CI [-2.8, +15.4], n = 3, df 2)'
    e.verdict()   # 'the interval holds 0: not told apart (an effect up to 15.4 points could hide)'

Choices (each unit-tested on hand-computed cases in tests/test_intervals.py):
- One sample or paired differences: the mean, its standard error s / sqrt(n), df = n - 1.
  Pairing (by seed, or by toy model and seed) removes how far the units lie apart, where the
  arms of a unit share its toy model, problems and step-0 samples.
- Unpaired: Welch's difference of means, se = sqrt(s_a^2/n_a + s_b^2/n_b), Welch-Satterthwaite
  degrees of freedom.
- Across toy models: the mean of the per-model effects, each model weighing the same. Its
  variance carries each model's own error through, sum(se_m^2) / M^2, plus the spread of the
  true effects between models, tau^2 / M, with tau^2 = max(0, var(effects) - mean(se_m^2))
  (the moment estimate: the effects' sample variance holds both). Three per-model means that
  happen to agree therefore do not make a small error. Degrees of freedom by Satterthwaite
  over those parts (each model's own df, M - 1 for tau^2). A model with a single unit has no
  error of its own, so there is no across-model estimate.
- The 95% interval is mean ± t(0.975, df) x se, with Student's t for fractional df (an
  incomplete-beta CDF inverted by bisection): at df 2, twice the standard error is an interval
  of about 82%, not 95%.
- n = 1 is written as a single run and n = 2 as its two values, with no error, and an arm of
  an unpaired contrast needs 3 units too: two values give a standard error of half their gap
  on one degree of freedom, where the 95% interval is 12.7 standard errors wide each way. (The
  error of a 2-unit model still enters an across-model estimate, with its one df.)
- Two arms differ only when the 95% interval excludes 0; otherwise the verdict gives the
  interval's reach from 0, the largest effect the runs could have missed.
- Several contrasts read at once: each interval holds its own 95%, not the family's; `holm`
  says which of a family's contrasts still exclude 0 at a family-wise 5% (Holm's step-down on
  the t tests' two-sided p values).
"""
import math
from dataclasses import dataclass, field

LEVEL = 0.95


# ----------------------------------------------------------------------------- Student's t

def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, f = 1e-300, 1.0
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1 + num * d
            d = 1 / (d if abs(d) > tiny else tiny)
            c = 1 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1) < 1e-15:
            break
    return f


def betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function, for 0 <= x <= 1."""
    if x <= 0 or x >= 1:
        return 0.0 if x <= 0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):      # the fraction converges fast on this side
        return front * _betacf(a, b, x) / a
    return 1 - front * _betacf(b, a, 1 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df (> 0, not necessarily whole) degrees of freedom."""
    tail = 0.5 * betainc(df / 2, 0.5, df / (df + t * t))
    return 1 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with t_cdf(t, df) = p (0 < p < 1), by bisection."""
    if df == math.inf:
        df = 1e12
    lo, hi = -1.0, 1.0
    while t_cdf(lo, df) > p:
        lo *= 2
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
        if hi - lo < 1e-12 * max(1.0, abs(mid)):
            break
    return (lo + hi) / 2


# ----------------------------------------------------------------------------- estimates

@dataclass
class Estimate:
    """A mean over `n` units with its standard error and degrees of freedom (None where the
    units cannot give one), and the units' own values (how n = 1 and n = 2 are written)."""
    mean: float
    se: float | None
    df: float | None
    n: int
    values: list = field(default_factory=list)
    ns: tuple = ()      # an unpaired contrast's two arms' units

    def ci(self, level: float = LEVEL):
        """(lo, hi); None without an error, or with fewer than 3 units (in an arm)."""
        if self.se is None or not self.df or (min(self.ns) if self.ns else self.n) < 3:
            return None
        h = t_quantile(0.5 + level / 2, self.df) * self.se
        return self.mean - h, self.mean + h

    def excludes_zero(self) -> bool | None:
        """None where there is no interval to judge: no error, too few units, or units that all
        agree (a zero-width interval is no evidence of a difference)."""
        c = self.ci()
        return None if c is None or self.se == 0 else (c[0] > 0 or c[1] < 0)

    def text(self, digits: int = 1, sign: bool = True) -> str:
        f = f"{'+' if sign else ''}.{digits}f"
        n = f"n = {self.ns[0]} and {self.ns[1]}" if self.ns else f"n = {self.n}"
        if self.ns and (self.se is None or min(self.ns) < 3):
            return f"{self.mean:{f}} ({n}: too few for an interval)"
        if self.n == 1 or (self.se is None and len(self.values) == 1):
            return f"{self.mean:{f}} (a single run)"
        if self.n == 2 and len(self.values) == 2:
            return f"{self.mean:{f}} (n = 2: {self.values[0]:{f}}, {self.values[1]:{f}})"
        c = self.ci()
        if c is None:
            return f"{self.mean:{f}} ({n}, no error)"
        if self.se == 0:
            return f"{self.mean:{f}} ({n}, all equal: no spread to give an interval)"
        df = f"{self.df:.0f}" if abs(self.df - round(self.df)) < 0.05 else f"{self.df:.1f}"
        return f"{self.mean:{f}} ± {self.se:.{digits}f} (95% CI [{c[0]:{f}}, {c[1]:{f}}], {n}, df {df})"

    def p(self) -> float | None:
        """Two-sided p of the mean against 0 under the t the interval uses; None where there is no
        interval (ci is None, or units that all agree)."""
        if self.ci() is None or self.se == 0:
            return None
        return 2 * (1 - t_cdf(abs(self.mean) / self.se, self.df))

    def verdict(self, unit: str = "points") -> str:
        """Whether the interval tells the two arms apart, and the largest effect it leaves open."""
        c = self.ci()
        if c is None:
            return "too few units for an interval: not told apart"
        if self.se == 0:
            return f"{self.mean:+.1f} {unit} with no spread among the units: no interval, so not told apart by one"
        if self.excludes_zero():
            return "the interval excludes 0: the arms differ"
        return f"the interval holds 0: not told apart (an effect up to {max(abs(c[0]), abs(c[1])):.1f} {unit} could hide)"


def sample(xs: list) -> Estimate | None:
    """The mean of the values that are there, se s / sqrt(n), df n - 1; None if none are."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    n, m = len(xs), sum(xs) / len(xs)
    if n < 2:
        return Estimate(m, None, None, n, xs)
    return Estimate(m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n), n - 1, n, xs)


def paired(a: dict, b: dict) -> Estimate | None:
    """a minus b over the units both hold ({unit: value}, None values left out)."""
    units = sorted(k for k in set(a) & set(b) if a[k] is not None and b[k] is not None)
    return sample([a[k] - b[k] for k in units])


def welch(a: list, b: list) -> Estimate | None:
    """mean(a) minus mean(b), unpaired: Welch's se and degrees of freedom."""
    ea, eb = sample(a), sample(b)
    if ea is None or eb is None:
        return None
    d, ns = ea.mean - eb.mean, (ea.n, eb.n)
    if ea.se is None or eb.se is None:
        return Estimate(d, None, None, ea.n + eb.n, ns=ns)
    va, vb = ea.se ** 2, eb.se ** 2
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / ea.df + vb ** 2 / eb.df) if va + vb > 0 else ea.df + eb.df
    return Estimate(d, se, df, ea.n + eb.n, ns=ns)


def across(per_model: list) -> Estimate | None:
    """The mean of per-model effects (Estimates) with the error described in the module's
    choices; None for fewer than 2 models, or a model without an error of its own."""
    if len(per_model) < 2 or any(e is None or e.se is None for e in per_model):
        return None
    M = len(per_model)
    means = [e.mean for e in per_model]
    mean = sum(means) / M
    spread = sum((x - mean) ** 2 for x in means) / (M - 1)
    tau2 = max(0.0, spread - sum(e.se ** 2 for e in per_model) / M)
    parts = [(e.se ** 2 / M ** 2, e.df) for e in per_model] + ([(tau2 / M, M - 1)] if tau2 > 0 else [])
    var = sum(v for v, _ in parts)
    df = var ** 2 / sum(v ** 2 / d for v, d in parts) if var > 0 else None
    return Estimate(mean, math.sqrt(var), df, sum(e.n for e in per_model))


def holm(ps: list, alpha: float = 1 - LEVEL) -> list:
    """Holm's step-down over a family of p values (None: no test): which keep a family-wise error
    of `alpha`. Sorted ascending, the k-th smallest (k from 0) is kept while p <= alpha / (m - k),
    m the number of tests; the first that fails stops the rest. Any dependence between the tests
    is allowed."""
    tested = sorted((p, i) for i, p in enumerate(ps) if p is not None)
    keep, m = [False] * len(ps), len(tested)
    for k, (p, i) in enumerate(tested):
        if p > alpha / (m - k):
            break
        keep[i] = True
    return keep
