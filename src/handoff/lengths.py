"""Response lengths from a stated distribution, for benchmarks on models that rarely stop.

    dist = ResponseLengths.parse("lognormal:median=700,sigma=0.9,max=4096")
    dist.draw(seed=3, count=8)          # eight lengths, the same for the same seed
    dist.mean, dist.max                 # what the planner needs
    dist.quantiles(256)                 # 256 lengths evenly through the distribution

A random-init model almost never samples its EOS token, so every response would run to
max_tokens and the KV pool would never see a long tail. Engine benchmarks (vLLM's, SGLang's)
give each request its own output length and ignore EOS; `rollout.response_lengths` does the
same inside the real loop. Real models keep their own lengths (leave it unset).

Specs: `fixed:N`, `uniform:min=A,max=B`, `lognormal:median=M,sigma=S,max=X` (a long tail,
cut at X), all with a floor of 1 token. Pure Python: the config checks a spec without torch.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist

_NORMAL = NormalDist()
_KINDS = {"fixed": (), "uniform": ("min", "max"), "lognormal": ("median", "sigma", "max")}


@dataclass(frozen=True)
class ResponseLengths:
    kind: str
    params: tuple[tuple[str, float], ...]

    @classmethod
    def parse(cls, spec: str) -> "ResponseLengths":
        """The distribution a spec names; ValueError naming the spec and its form."""
        forms = "fixed:N, uniform:min=A,max=B or lognormal:median=M,sigma=S,max=X"
        kind, _, rest = spec.strip().partition(":")
        if kind not in _KINDS or not rest:
            raise ValueError(f"response lengths {spec!r} are not a distribution: write {forms}")
        try:
            if kind == "fixed":
                params = (("n", float(rest)),)
            else:
                pairs = dict(p.split("=", 1) for p in rest.split(","))
                params = tuple((k, float(pairs.pop(k))) for k in _KINDS[kind])
                if pairs:
                    raise KeyError(next(iter(pairs)))
        except (ValueError, KeyError):
            raise ValueError(f"response lengths {spec!r}: write {forms}") from None
        values = dict(params)
        if not all(math.isfinite(v) and v > 0 for v in values.values()):
            raise ValueError(f"response lengths {spec!r}: every number must be positive and finite")
        if kind == "uniform" and values["min"] > values["max"]:
            raise ValueError(f"response lengths {spec!r}: min is above max")
        return cls(kind, params)

    def _value(self, key: str) -> float:
        return dict(self.params)[key]

    @property
    def max(self) -> int:
        """The longest response the distribution can give."""
        return int(self._value("n") if self.kind == "fixed" else self._value("max"))

    def _from_uniform(self, u: float) -> int:
        if self.kind == "fixed":
            return self.max
        if self.kind == "uniform":
            lo, hi = self._value("min"), self._value("max")
            return max(1, min(int(lo + u * (hi - lo + 1)), int(hi)))
        z = _NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
        length = self._value("median") * math.exp(self._value("sigma") * z)
        return max(1, min(int(round(length)), self.max))

    def draw(self, *, seed: int, count: int) -> list[int]:
        """`count` lengths, a function of `seed` alone."""
        rng = random.Random(seed)
        return [self._from_uniform(rng.random()) for _ in range(count)]

    def quantiles(self, count: int, cap: int | None = None) -> tuple[int, ...]:
        """`count` lengths at evenly spaced quantiles (at most `cap`): the planner's stand-in
        for one step's responses."""
        cap = cap or self.max
        return tuple(min(self._from_uniform((i + 0.5) / count), cap) for i in range(count))

    @property
    def mean(self) -> float:
        """The mean length (the lognormal's cut at max included), from a fixed grid."""
        grid = 4096
        return sum(self._from_uniform((i + 0.5) / grid) for i in range(grid)) / grid
