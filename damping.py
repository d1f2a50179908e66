"""Coherence damping: the paper's intervention on a role whose successive gradients keep
pointing one way (`--coherence-damp ROLE=LAMBDA`, off by default).

At each optimizer step a role's gradient g is scaled by

    s = 1 - LAMBDA * max(0, cos(g, m)),    m <- d m + (1 - d) s g,   d = 1 - 1 / window

where m is an EMA of the role's past (scaled) gradients over `--coherence-window` optimizer
steps. A gradient that keeps pointing where the role already went is damped; the first step of
a role (no history) is not, and LAMBDA 0 leaves the update exact. It plugs into the update
through grpo's Intervention seam: it splits each optimizer step's gradient into its (role,
slot) parts as the diagnostics do (dynamics.SlotParts, summed over the ranks under torchrun),
and rebuilds .grad from the scaled parts only when some scale is not 1 (so a scale of 1 leaves
.grad exactly as the update left it).
"""
import grpo
import seeds
from dynamics import SlotParts, by_role, cosine, set_flat_grad


class CoherenceDamp(grpo.Intervention):
    """Scales each damped role's part of every optimizer step's gradient; `log` holds this
    training step's (cosine, scale) per role and optimizer step (dynamics.RoleDynamics reports
    them). Roles without a LAMBDA are left as they are."""

    def __init__(self, lambdas: dict, window: int = 10, comm=None):
        if window < 1:
            raise ValueError("coherence window must be >= 1")
        self.lambdas, self.decay, self.ema = dict(lambdas), 1.0 - 1.0 / window, {}
        self.reader, self.log = SlotParts(comm), {}

    def begin(self):
        self.log = {}

    def slot_done(self, name, role, slot, params):
        self.reader.read(role, slot, params)

    def adjust(self, name, params):
        parts = self.reader.take()
        scales = {}
        for role, g in by_role(parts).items():
            scales[role], cos = self(role, g)
            if cos is not None:
                self.log.setdefault(role, []).append((cos, scales[role]))
        if any(s != 1.0 for s in scales.values()):   # only then rebuild: scale 1 keeps .grad exact
            set_flat_grad(params, sum(v * scales[role] for (role, _), v in parts.items()))

    def __call__(self, role: str, g):
        """(scale, cosine or None) for this optimizer step's gradient `g` of `role`; updates the
        role's EMA."""
        if role not in self.lambdas:
            return 1.0, None
        m = self.ema.get(role)
        cos = cosine(g, m) if m is not None else None
        scale = self._choose(role, 1.0 - self.lambdas[role] * max(0.0, cos) if cos is not None else 1.0)
        self.ema[role] = g * scale if m is None else m.mul_(self.decay).add_(g, alpha=(1 - self.decay) * scale)
        return scale, cos

    def _choose(self, role: str, factor: float) -> float:
        """The scale applied, given the coherence factor: the factor itself."""
        return factor

    def state_dict(self) -> dict:
        return {"ema": {r: m.detach().cpu().clone() for r, m in self.ema.items()}}   # a copy: the EMA moves in place

    def load_state_dict(self, state: dict, device=None) -> None:
        self.ema = {r: m.to(device).clone() if device is not None else m.clone() for r, m in state["ema"].items()}


class PlaceboDamp(CoherenceDamp):
    """The placebo of coherence damping (`--damp-placebo`): the same scale factors in
    distribution, with no coherence signal. At each optimizer step it finds the factor
    CoherenceDamp would apply, adds it to the role's history, and applies instead one drawn
    uniformly from that history (keyed by the seed, the role and the step count, so a resumed
    run draws the same). A rescue that the placebo also gives is not the coherence mechanism."""

    def __init__(self, lambdas: dict, window: int = 10, seed: int = 0, comm=None):
        super().__init__(lambdas, window, comm)
        self.seed, self.history = seed, {}

    def _choose(self, role: str, factor: float) -> float:
        past = self.history.setdefault(role, [])
        past.append(factor)
        return past[seeds.derive(self.seed, "placebo", role, len(past)) % len(past)]

    def state_dict(self) -> dict:
        return {**super().state_dict(), "history": {r: list(h) for r, h in self.history.items()}}

    def load_state_dict(self, state: dict, device=None) -> None:
        super().load_state_dict(state, device)
        self.history = {r: list(h) for r, h in state.get("history", {}).items()}
