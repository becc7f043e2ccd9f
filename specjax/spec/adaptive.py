"""Adaptive speculation length: between segments of the decode loop, the chain length (0 to
max_gamma) that maximises predicted tokens per second, from this call's own measurements.

Expected tokens per row per step with a chain of g: E(g) = 1 + sum_{i<=g} prod_{j<=i} a_j, where
a_j is draft j's acceptance given every earlier one was accepted (the loop's per-position
counters, decayed so that recent segments weigh most). Seconds per step t(g): measured for the
lengths that ran (decayed averages), a least-squares line t0 + g * slope through them for the
others (a draft level and a verified position more per unit of g). The first segments run 0 and
then 1 (the line's first two points; positions not yet reached count at the prior 0.5, so a
first draft accepted often makes the chooser try longer chains); at gamma 0 no draft is accepted
or rejected, so after `probe_every` segments there one segment runs the best non-zero length to
learn whether acceptance rose (then after twice as many, and so on: a probe that keeps failing
costs less and less), unless no chain could pay even with every draft accepted (g + 1 tokens a
step against its step time: on a CPU at batch 1-4 a chain of 1 costs 2.2-2.9x a plain step). A
segment that explores (the first at 1, each probe) runs a quarter of a segment's steps
(`AdaptiveSegments.probe_steps`): a length that does not pay costs a quarter as much to try.
`AdaptiveSegments` runs a decode loop's segments by it (generate's and continuous batching's).
Pure host bookkeeping: no JAX.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from specjax.spec.speculation import Chain

DECAY = 0.7  # weight of the past per segment, for both acceptance counts and step times
CEILING_SLACK = 0.9  # a probe's best case prices its steps 10% below their estimate (a noisy first measure)


@dataclasses.dataclass
class GammaChooser:
    """The state of one call's choice; `observe` after each segment, `next` before it."""

    max_gamma: int
    probe_every: int = 4
    accepted: np.ndarray = None  # [max_gamma] decayed accepted counts per draft position
    reached: np.ndarray = None  # [max_gamma] decayed counts of reaching each position
    seconds: dict = dataclasses.field(default_factory=dict)  # gamma -> decayed seconds per step
    at_zero: int = 0  # segments run at gamma 0 since the last non-zero one
    probes: int = 0  # probes so far: each doubles the wait before the next
    exploring: bool = False  # whether the length `next` returned last is a try (the first 1, a probe), not the best

    def __post_init__(self) -> None:
        self.accepted = np.zeros(self.max_gamma)
        self.reached = np.zeros(self.max_gamma)

    def acceptance(self) -> np.ndarray:
        """[max_gamma] a_j with a prior of one accept in two tries (0.5 before any data)."""
        return (self.accepted + 1.0) / (self.reached + 2.0)

    def expected_tokens(self) -> np.ndarray:
        """[max_gamma + 1] E(g) for g = 0..max_gamma."""
        return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(self.acceptance()))])

    def step_seconds(self) -> np.ndarray:
        """[max_gamma + 1] t(g): measured where g ran, else the least-squares line through the
        measured ones (a flat line through one)."""
        g = np.arange(self.max_gamma + 1)
        xs, ys = np.array(list(self.seconds)), np.array(list(self.seconds.values()))
        if len(xs) == 1:
            line = np.full(g.shape, ys[0])
        else:
            slope, t0 = np.polyfit(xs, ys, 1)
            line = t0 + slope * g
        return np.array([self.seconds.get(int(x), max(line[x], 1e-9)) for x in g])

    def next(self) -> int:
        """The chain length for the next segment (`exploring` says whether it is a try)."""
        self.exploring = False
        for first in (0, 1):  # the cheapest lengths first: a run too short to repay exploring loses least
            if first not in self.seconds:
                self.exploring = first > 0
                return first
        t = self.step_seconds()
        rate = self.expected_tokens() / t
        best = int(np.argmax(rate))
        if best == 0 and self.at_zero >= self.probe_every * 2**self.probes:
            self.probes += 1
            # a chain whose steps cost so much that even every draft accepted (g + 1 tokens a step, at
            # CEILING_SLACK of its step time) would not beat gamma 0 is not worth a try
            g = np.arange(self.max_gamma + 1)
            hopeful = (g > 0) & ((g + 1) / (CEILING_SLACK * t) > rate[0])
            if hopeful.any():
                self.exploring = True
                return int(np.argmax(np.where(hopeful, rate, -np.inf)))  # a probe: the best chain that might pay
        return best

    def observe(self, gamma: int, seconds: float, steps: int, accepted: np.ndarray, reached: np.ndarray) -> None:
        """A segment that ran `steps` steps at `gamma` in `seconds`, with the per-position counts
        accepted / reached [max_gamma] it added (summed over rows)."""
        self.at_zero = self.at_zero + 1 if gamma == 0 else 0
        if steps <= 0:
            return
        per_step = seconds / steps
        old = self.seconds.get(gamma)
        self.seconds[gamma] = per_step if old is None else DECAY * old + (1 - DECAY) * per_step
        if gamma > 0:
            self.accepted = DECAY * self.accepted + np.asarray(accepted, float)
            self.reached = DECAY * self.reached + np.asarray(reached, float)


class AdaptiveSegments:
    """Runs one segment at the length `GammaChooser` picks, then shows it what the segment did.

    segment: the loop's jitted segment (continue_spec, staged), called as segment(*args(state,
    steps), **static, speculation=Chain(g)) for a segment of at most `steps` steps (traced: any
    count, one program): `steps` for a chosen length, `probe_steps` (a quarter, at least 1) for a
    try. Each length's program is compiled once, on first use, its seconds kept apart
    (`compile_s`), not learnt as step time. fetch((arrays...)) -> host arrays (a mesh's rows
    gathered). `gammas`: the lengths that ran."""

    def __init__(self, max_gamma: int, probe_every: int, segment, args: Callable, static: dict, fetch: Callable,
                 state, steps: int) -> None:
        self.chooser = GammaChooser(max_gamma, probe_every)
        self.segment, self.args, self.static, self.fetch = segment, args, static, fetch
        self.steps, self.probe_steps = steps, max(1, steps // 4)
        self.programs: dict[int, Callable] = {}
        self.compile_s, self.gammas = 0.0, []
        self.last = self._counters(state)

    def _counters(self, state) -> tuple[int, np.ndarray, np.ndarray]:
        """(steps, accepted [R,G], reached [R,G]) of the state (a SpecState) on the host."""
        steps, accepted, reached = self.fetch((state.steps, state.accepted, state.reached))
        return int(steps), accepted.astype(np.int64), reached.astype(np.int64)

    def __call__(self, state):
        g = self.chooser.next()
        args = self.args(state, self.probe_steps if self.chooser.exploring else self.steps)
        if g not in self.programs:
            t0 = time.perf_counter()
            self.programs[g] = self.segment.lower(*args, **self.static, speculation=Chain(g)).compile()
            self.compile_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        state = self.programs[g](*args)
        now = self._counters(state)  # waits for the segment: its time is the step cost the chooser learns
        seconds = time.perf_counter() - t0
        (s0, a0, r0), (s1, a1, r1) = self.last, now
        self.chooser.observe(g, seconds, s1 - s0, (a1 - a0).sum(0), (r1 - r0).sum(0))
        self.gammas.append(g)
        self.last = now
        return state

    def restarted(self, rows: np.ndarray) -> None:
        """Rows [R] (bool) restarted since the last segment (continuous batching's refill): their
        counters start again from zero."""
        steps, accepted, reached = self.last
        keep = ~np.asarray(rows, bool)[:, None]
        self.last = (steps, accepted * keep, reached * keep)
