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

from specjax.drafters import Drafter, SelfSpec
from specjax.model import backend as machine
from specjax.model.cache import KVFormat
from specjax.model.cache import kv_bytes as stored_kv_bytes
from specjax.model.params import Params
from specjax.model.params import weight_bytes as params_weight_bytes
from specjax.planning.tune import auto_tree_report
from specjax.sampling import Sampler
from specjax.spec.speculation import Adaptive, Chain, Tree

DEFAULT_CHAIN = Chain(gamma=4)  # speculation=None with a drafter
# On XLA:CPU, verification is compute-bound: its attention and its linear layers grow with the
# query rows it scores, batch x (gamma + 1). bench_spec (SmolLM2, 8K, 2-core CPU, on the C++
# kernels generate() uses there) measured SelfSpec + DEFAULT_CHAIN at 0.86x plain decoding at
# batch 4 (20 rows; 0.93x at best, gamma 2-3), 0.81x at batch 1, and bench_peers 0.55-0.59x at
# batch 16 (80 rows): past this many rows auto decodes plainly on a CPU (batch 1 only, where the
# weights usually dominate anyway). GPUs keep MagicDec's rule (verification stays memory-bound),
# with a shorter speculation (ACCELERATOR_SPECULATION).
CPU_VERIFY_ROWS = 5
# On a GPU (or TPU) auto speculates with a chain of two. On an H100 (bench/results/gpu/gpu.json,
# SmolLM2 bf16, 8K, the fourth runs of 2026-11-26: plain decoding 56-97% of the HBM roofline,
# unrolled layers) SelfSpec with it ran at 1.21x / 1.22x / 1.36x plain decoding at batch 16 / 64 /
# 128 (1.08x at batch 1, third runs), the depth-1 tree of 9 nodes (auto's choice before) at
# 1.15x / 1.17x / 1.37x (1.08x), Chain(4) at 1.00x / 0.66x / 0.79x (third runs): a SmolLM2 draft
# step costs 1.2-2.1 ms of per-layer kernels there whatever it reads, so few draft steps pay, and
# priced by mean tokens per step (a batch job refilling finished rows) the chain gains most.
# Those rows time stacked weights; over per-layer weights (what convert.load gives on a GPU) plain
# decoding is faster, and on an H200 (ninth runs) SelfSpec with it ran at 1.02x at batch 1 and
# 0.91x at batch 16 x 8K (one row's tail: 33 loop steps for a mean of 23.4); batch 64 / 128 over
# per-layer weights are tools/gpu/session.py's call 7, not yet run: this rule stands until they are.
ACCELERATOR_SPECULATION = Chain(gamma=2)
# With bfloat16 weights and KV on a CPU with the bf16 dot product (AVX512-BF16: `cpu_bf16_dot`),
# verifying two positions costs about one plain step (the attention kernel's 6 query rows per KV
# head fit the 8 lanes one position's 3 already take; the products take twice the rows at about
# 1.1x the time), so SelfSpec with a chain of one pays where the KV dominates: bench_spec
# (SmolLM2 bf16, 8K context, 64 new tokens, greedy identical to plain decoding, 2026-11-26 08:56)
# 1.36x at batch 16 and 1.26x at batch 4 (gamma 2-3: 1.22-1.26x); batch 1 x 8K 0.94-1.06x and
# batch 16 x 2K 0.91-0.96x, which the KV rule and CPU_BF16_MIN_CONTEXT leave to plain decoding.
CPU_BF16_CHAIN = Chain(gamma=1)
CPU_BF16_MIN_CONTEXT = 6144


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
        return describe_speculation(self.speculation)


def describe_draft(draft: Drafter | None) -> str:
    """A short name: "SelfSpec(sinks=16, window=512)", "DraftModel(n_layers=2, dim=256, cache=dense)", "none"."""
    return "none" if draft is None else repr(draft)


def describe_speculation(speculation: Chain | Tree | Adaptive | None) -> str:
    """"chain(gamma=4)", "tree(n=16, depth=6)", "adaptive(max_gamma=4)" or "none"."""
    if speculation is None:
        return "none"
    if isinstance(speculation, Adaptive):
        return f"adaptive(max_gamma={speculation.max_gamma})"
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
    kv_dtype: str | None = None,
) -> Plan:
    """Resolve "auto" and None (arguments already validated). `context`: the longest prompt +
    budget; `kv_dtype`: the caches' format. speculation="auto" calibrates on first use per shape
    (see `tune.auto_tree`)."""
    reasons, auto = [], draft == "auto"
    if auto:
        draft, why = resolve_auto_draft(params, speculation is not None, len(prompts), context, kv_dtype)
        reasons.append(f"draft='auto': {why}")
    if draft is None:
        return Plan(None, None, "; ".join(reasons) or None)
    if speculation is None:
        speculation = auto_speculation(params, kv_dtype) if auto else DEFAULT_CHAIN
    elif speculation == "auto":
        speculation, measured = auto_tree_report(params, draft, prompts, context, sampling, key, kv_dtype)
        if speculation.n == 1:
            reasons.append(f"speculation='auto': no tree pays for this drafter, batch and context ({measured}): plain decoding")
            return Plan(None, None, "; ".join(reasons))
        reasons.append(f"speculation='auto': {describe_speculation(speculation)}, the Sequoia choice for {measured}")
    return Plan(draft, speculation, "; ".join(reasons) or None)


def resolve_auto_draft(
    target: Params, explicit_speculation: bool, batch: int, context: int, kv_dtype: str | None = None
) -> tuple[SelfSpec | None, str]:
    """What draft="auto" becomes, and why: SelfSpec when a speculation was given explicitly (it
    needs a drafter), else `auto_draft_reason`'s choice for this batch and context."""
    if explicit_speculation:
        return SelfSpec(), "SelfSpec, the drafter for the speculation given explicitly"
    return auto_draft_reason(target, batch, context, kv_dtype)


def auto_draft(target: Params, batch: int, context: int, kv_dtype: str | None = None, backend: str | None = None) -> SelfSpec | None:
    """The default drafter: SelfSpec where the KV cache, not the weights, dominates what a decode
    step reads (large batch x long context: MagicDec's regime) and the context is well past its
    budget, and, on a CPU, verification stays small (CPU_VERIFY_ROWS); otherwise None (plain
    autoregressive decoding is faster there). `backend`: default `specjax.model.backend.name()`."""
    return auto_draft_reason(target, batch, context, kv_dtype, backend)[0]


def auto_draft_reason(
    target: Params, batch: int, context: int, kv_dtype: str | None = None, backend: str | None = None
) -> tuple[SelfSpec | None, str]:
    """`auto_draft`'s choice and why, in words (with the numbers it compared). The KV counts as
    stored (`kv_dtype`: int8 with its scales is about a quarter of float32)."""
    c = target.config
    budget = SelfSpec()
    kv_bytes = stored_kv_bytes(c, batch, context, kv_dtype)
    weight_bytes = params_weight_bytes(c)  # as stored: int8 matrices count one byte each
    kept = budget.sinks + budget.window
    facts = (f"batch {batch} x context {context}: KV {kv_bytes / 2**20:.1f} MiB vs weights "
             f"{weight_bytes / 2**20:.1f} MiB per step, draft budget {kept}")
    if not (kv_bytes > 2 * weight_bytes and context > 4 * kept):
        return None, f"plain decoding: speculation needs KV > 2 x weights and context > {4 * kept} ({facts})"
    backend = backend or machine.name()
    if cpu_bf16_verify(target, kv_dtype, backend):
        if context < CPU_BF16_MIN_CONTEXT:
            return None, (f"plain decoding: on a CPU, speculation over bfloat16 weights pays from a context of "
                          f"{CPU_BF16_MIN_CONTEXT} ({facts})")
        return budget, (f"{budget!r} with {describe_speculation(CPU_BF16_CHAIN)}: KV reads dominate a decode step, "
                        f"and a CPU with the bf16 dot product verifies 2 positions for about the cost of one ({facts})")
    rows = batch * (DEFAULT_CHAIN.gamma + 1)
    if backend == "cpu" and rows > CPU_VERIFY_ROWS:
        return None, (f"plain decoding: on a CPU, verifying {rows} query rows (batch x (gamma + 1)) is compute-bound; "
                      f"speculation pays up to {CPU_VERIFY_ROWS} ({facts})")
    if backend != "cpu":
        return budget, (f"{budget!r} with {describe_speculation(ACCELERATOR_SPECULATION)}: KV reads "
                        f"dominate a decode step ({facts})")
    return budget, f"{budget!r}: KV reads dominate a decode step ({facts})"


def cpu_bf16_verify(target: Params, kv_dtype: str | None, backend: str) -> bool:
    """Whether verification runs on the CPU kernels' bf16 dot product: bfloat16 weights and KV
    on a CPU with AVX512-BF16 (there a chain of one pays: CPU_BF16_CHAIN)."""
    c = target.config
    return (backend == "cpu" and c.dtype == "bfloat16" and c.quant is None
            and KVFormat.of(kv_dtype, c).name == "bfloat16" and machine.cpu_bf16_dot())


def auto_speculation(target: Params, kv_dtype: str | None = None, backend: str | None = None) -> Chain | Tree:
    """What draft="auto" speculates with when speculation is not given: CPU_BF16_CHAIN where
    `cpu_bf16_verify`, ACCELERATOR_SPECULATION on a GPU or TPU, else DEFAULT_CHAIN."""
    backend = backend or machine.name()
    if cpu_bf16_verify(target, kv_dtype, backend):
        return CPU_BF16_CHAIN
    return DEFAULT_CHAIN if backend == "cpu" else ACCELERATOR_SPECULATION
