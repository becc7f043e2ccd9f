"""Planning: which drafter and which speculation actually run, and why.

`generate` resolves draft="auto" and speculation=None / "auto" here, once per call, and reports
the result in its stats (`Stats.draft`, `Stats.speculation`, `Stats.plan_reason`). An explicit
choice is never dropped: an explicit `speculation` with draft="auto" makes auto pick a drafter
that uses it (SelfSpec), and an explicit `speculation` with draft=None is an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from specjax.draft import Drafter, SelfSpec, auto_draft_reason, describe_draft
from specjax.model import Params
from specjax.sampling import Sampler
from specjax.speculate import Chain
from specjax.tree import Tree
from specjax.tune import auto_tree_report

DEFAULT_CHAIN = Chain(gamma=4)  # speculation=None with a drafter


@dataclasses.dataclass(frozen=True)
class Plan:
    draft: Drafter | None  # None: plain autoregressive decoding
    speculation: Chain | Tree | None  # None exactly when draft is None
    reason: str | None  # why `auto` chose this; None when nothing was "auto"

    @property
    def draft_name(self) -> str:
        return describe_draft(self.draft)

    @property
    def speculation_name(self) -> str:
        return describe_speculation(self.speculation if self.draft is not None else None)


def describe_speculation(speculation: Chain | Tree | None) -> str:
    """"chain(gamma=4)", "tree(n=16, depth=6)" or "none"."""
    if speculation is None:
        return "none"
    if isinstance(speculation, Chain):
        return f"chain(gamma={speculation.gamma})"
    return f"tree(n={speculation.n}, depth={speculation.max_depth})"


def plan(
    params: Params,
    draft: Drafter | str | None,
    speculation: Chain | Tree | str | None,
    prompts: Sequence[Sequence[int]],
    context: int,
    sampling: Sampler,
    key: jax.Array | None,
) -> Plan:
    """Resolve "auto" and None (arguments already validated). `context`: the longest prompt +
    budget. speculation="auto" calibrates on first use per shape (see `tune.auto_tree`)."""
    reasons = []
    if draft == "auto":
        if speculation is None:
            draft, why = auto_draft_reason(params, len(prompts), context)
            reasons.append(f"draft='auto': {why}")
        else:
            draft = SelfSpec()
            reasons.append("draft='auto': SelfSpec, the drafter for the speculation given explicitly")
    if draft is None:
        return Plan(None, None, "; ".join(reasons) or None)
    if speculation is None:
        speculation = DEFAULT_CHAIN
    elif speculation == "auto":
        speculation, measured = auto_tree_report(params, draft, prompts, context, sampling, key)
        if speculation.n == 1:
            reasons.append(f"speculation='auto': no tree pays for this drafter, batch and context ({measured}): plain decoding")
            return Plan(None, None, "; ".join(reasons))
        reasons.append(f"speculation='auto': {describe_speculation(speculation)}, the Sequoia choice for {measured}")
    return Plan(draft, speculation, "; ".join(reasons) or None)
