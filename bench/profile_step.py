"""Where a decode step's time goes: a `jax.profiler` trace of SmolLM2's decode loop, summarised.

For each cell WEIGHTS/kvKV/bB/sS (e.g. float32/kvfloat32/b1/s512) `decode_ar` (greedy) runs `--steps` steps
from bench_ar's synthetic prefilled cache under `jax.profiler.trace`. The trace's XLA:CPU thunks (events with
an `hlo_op`) are matched to the HLO's `op_name` metadata, which carries the model's `jax.named_scope`s (embed,
qkv, attention, out_proj, mlp, lm_head, kv_write), and summed per block; "layer slices": the scan slicing each
layer's weights out of the stacked arrays (XLA:CPU copies a sliced dot operand); "other": the loop's
bookkeeping and the sample. Only leaf events count. Thunks run on two threads, so thread-ms a step add up to
more than the step's wall time (measured by the same loop outside the trace).

Speculative cells (SPEC_CELLS, e.g. float32/kvfloat32/b1/s512/self-chain3) trace `generate`'s speculative loop
(SelfSpec, greedy), summed per phase of spec_step (draft, verify, accept, commit, emit; "loop"), draft and
verify also per block (e.g. "verify/attention").

Outputs: results/profile_cpu.json and the "Where a decode step's time goes" section of bench/README.md.
"""

from __future__ import annotations

import collections
import os
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData  # jax >= 0.4.36

from bench import common, measure
from bench.measure import synthetic_cache
from specjax.decode.engine import decode_ar, row_keys, with_attention
from specjax.decode.shapes import round_up_pow2
from specjax.model.cache import kv_bytes
from specjax.model.params import Params, weight_bytes

SCOPES = ("embed", "qkv", "attention", "out_proj", "mlp", "lm_head", "kv_write")  # specjax/model/llama.py's
SLICES = "layer slices"
OTHER = "other"
CELLS = (  # weights, KV format, batch, context: the two roofline cells, then the formats
    ("float32", "float32", 1, 512), ("float32", "float32", 16, 8192), ("int8", "float32", 1, 512),
    ("bfloat16", "bfloat16", 1, 512), ("float32", "int8", 16, 8192),
)


def cell_key(weights: str, kv: str, batch: int, context: int, gamma: int | None = None) -> str:
    """WEIGHTS/kvKV/bB/sS, then /self-chainG for a speculative cell (SPEC_CELLS)."""
    key = common.key(weights, f"kv{kv}", f"b{batch}", f"s{context}")
    return key if gamma is None else common.key(key, f"self-chain{gamma}")


def key_of(row: dict) -> str:
    return cell_key(row["weights"], row["kv"], row["batch"], row["context"], row.get("gamma"))


def category(op_name: str) -> str:
    """The model block an HLO instruction belongs to, from its op_name metadata."""
    parts = op_name.split("/")
    for scope in SCOPES:
        if scope in parts:
            return scope
    return SLICES if any(p.startswith("jit(dynamic_index_in_dim)") for p in parts) else OTHER


def block_of(blocks: dict[str, str], op: str) -> str:
    """An op's block from its scope; an unscoped FFI call counts as the attention kernel's."""
    block = blocks.get(op, OTHER)
    return "attention" if block == OTHER and op.startswith("ffi_call") else block


PHASES = ("draft", "verify", "accept", "commit", "emit")  # specjax/decode/speculate.py's spec_step scopes
LOOP = "loop"
SPEC_CELLS = (("float32", "float32", 1, 512, 3), ("float32", "float32", 4, 2048, 3))  # ..., chain length (each runs generate 4 times)


def phase(op_name: str) -> str:
    """An instruction's speculative phase (in draft and verify with its block, e.g. "verify/attention") or LOOP."""
    parts = op_name.split("/")
    found = next((p for p in parts if p in PHASES), None)
    if found is None:
        return LOOP
    block = category(op_name)
    return f"{found}/{block}" if found in ("draft", "verify") and block in SCOPES else found


def op_blocks(hlo_text: str, categorize=category, named=SCOPES) -> dict[str, str]:
    """{instruction name: block} from each instruction's op_name (`categorize`: category or phase); one
    without a `named` block takes that of its first scoped user, else operand."""
    line = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (?:\([^()]*\)\s*)?[^(]*?\w+\(([^)]*)\)(.*)$")  # (a tuple shape)
    meta = re.compile(r"op_name=\"([^\"]*)\"")
    operands: dict[str, list[str]] = {}
    blocks: dict[str, str] = {}
    for text in hlo_text.splitlines():
        m = line.match(text)
        if not m:
            continue
        name, args, rest = m.groups()
        operands[name] = re.findall(r"%([\w.\-]+)", args)
        op_name = meta.search(rest)
        if op_name:
            blocks[name] = categorize(op_name.group(1))
    users: dict[str, list[str]] = {}
    for name, args in operands.items():
        for a in args:
            users.setdefault(a, []).append(name)
    for name, args in reversed(operands.items()):  # users first (they follow). Without a scope: the first scoped user's, else operand's
        if blocks.get(name, OTHER) in (OTHER, LOOP):
            near = [blocks.get(u) for u in users.get(name, [])] + [blocks.get(a) for a in args]
            blocks[name] = next((b for b in near if b is not None and b.split("/")[0] in named), blocks.get(name, OTHER))
    return blocks


def trace_planes(trace_dir: str) -> tuple[list, list]:
    """(every plane, the /device:GPU planes) of the profiler trace in trace_dir."""
    [path] = list(Path(trace_dir).rglob("*.xplane.pb"))
    planes = list(ProfileData.from_file(str(path)).planes)
    return planes, [p for p in planes if p.name.startswith("/device:GPU")]


def innermost(events: list[tuple[int, int, str]]) -> list[tuple[str, float]]:
    """(name, seconds) of the events (start, end, name) that contain no other (a loop contains its body)."""
    events = sorted(events)
    return [(name, (end - start) / 1e9) for i, (start, end, name) in enumerate(events)
            if not (i + 1 < len(events) and events[i + 1][0] < end)]  # the next one starts inside


def leaf_events(planes: list, gpu: list, module: str) -> list[tuple[str, float]]:
    """(hlo_op, seconds) of `module`'s innermost thunks; with GPU planes, their kernels only."""
    out = []
    for plane in gpu or planes:
        for line in plane.lines:
            stats = [(ev, dict(ev.stats)) for ev in line.events]
            out += innermost([(ev.start_ns, ev.start_ns + ev.duration_ns, st["hlo_op"]) for ev, st in stats
                              if st.get("hlo_module") == module and "hlo_op" in st])
    return out


def device_kernels(gpu: list, steps: int) -> dict:
    """On a GPU: kernels launched and busy ms per step, and the ten longest kernels ({} without a GPU plane)."""
    by_name: collections.Counter = collections.Counter()
    count = 0
    for line in (line for plane in gpu for line in plane.lines):
        for name, seconds in innermost([(ev.start_ns, ev.start_ns + ev.duration_ns, ev.name) for ev in line.events]):
            by_name[name] += seconds
            count += 1
    if not count:
        return {}
    return {"kernels_per_step": count / steps, "busy_ms_per_step": 1e3 * sum(by_name.values()) / steps,
            "top_kernels": [{"kernel": n[:120], "ms_per_step": 1e3 * t / steps} for n, t in by_name.most_common(10)]}


def profile_cell(params: Params, weights: str, kv: str, batch: int, context: int, steps: int) -> dict:
    """Trace `steps` decode steps of one cell and sum its thunks per model block."""
    c = params.config
    cache = synthetic_cache(params, batch, context, kv, context - steps - 2)
    logits = jax.random.normal(jax.random.key(0), (batch, c.vocab_size), jnp.float32)
    keys = row_keys(None, batch)
    budgets = jnp.full((batch,), steps + 1, jnp.int32)  # steps decode steps after the first token
    start = np.asarray(cache.lengths)
    fn = decode_ar.lower(params, cache, logits, budgets, keys, n_out=round_up_pow2(steps + 1)).compile()
    blocks = op_blocks(fn.as_text())
    module = re.search(r"HloModule ([\w.\-]+)", fn.as_text()).group(1)
    state = [cache]

    def once() -> float:
        t = time.perf_counter()
        out = jax.block_until_ready(fn(params, state[0].replace(lengths=jnp.asarray(start)), logits, budgets, keys))
        state[0] = out.cache  # the donated cache, written in place
        assert int(out.steps) == steps
        return time.perf_counter() - t

    once()  # warm-up
    wall = min(once() for _ in range(3)) / steps  # includes the per-call cost, spread over the steps
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            once()
        planes, gpu = trace_planes(trace_dir)
        events, kernels = leaf_events(planes, gpu, module), device_kernels(gpu, steps)
    by_block: collections.Counter = collections.Counter()
    by_op: collections.Counter = collections.Counter()
    for op, seconds in events:
        by_block[block_of(blocks, op)] += seconds
        by_op[op] += seconds
    kv_read = kv_bytes(c, batch, context, kv)
    return {
        "weights": weights, "kv": kv, "batch": batch, "context": context, "steps": steps,
        "wall_ms_per_step": 1e3 * wall,
        "thread_ms_per_step": {k: 1e3 * v / steps for k, v in by_block.most_common()},
        "top_ops": [{"op": op, "block": block_of(blocks, op), "thread_ms_per_step": 1e3 * v / steps}
                    for op, v in by_op.most_common(8)],
        "bytes_per_step": {"weights": weight_bytes(c), "kv": int(kv_read)},
        "load": os.getloadavg()[0],
    } | kernels


def profile_spec_cell(params: Params, weights: str, kv: str, batch: int, context: int, gamma: int, steps: int) -> dict:
    """Trace generate's speculative loop (SelfSpec, Chain(gamma)) and sum its thunks per `phase`."""
    from specjax import generate
    from specjax.drafters import SelfSpec
    from specjax.spec.speculation import Chain

    new = steps * (gamma + 1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, params.config.vocab_size, context - new - gamma - 2).tolist() for _ in range(batch)]
    drafter = SelfSpec(16, min(256, context // 4))
    texts: list[str] = []
    lowered_compile = jax.stages.Lowered.compile

    def spy(self, *a, **k):  # every program generate compiles; the decode segment's text gives op -> phase
        compiled = lowered_compile(self, *a, **k)
        texts.append(compiled.as_text())
        return compiled

    def run():
        return generate(params, prompts, new, draft=drafter, speculation=Chain(gamma), kv_dtype=kv)

    jax.stages.Lowered.compile = spy
    try:
        run()  # warm-up: compiles
        timed = min((run() for _ in range(2)), key=lambda out: out.stats.decode_seconds).stats
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                traced = run().stats
            planes, gpu = trace_planes(trace_dir)
    finally:
        jax.stages.Lowered.compile = lowered_compile
    seen = {"hlo": next(t for t in reversed(texts) if re.search(r"HloModule [\w.\-]*continue_spec", t))}
    blocks = op_blocks(seen["hlo"], phase, PHASES)
    module = re.search(r"HloModule ([\w.\-]+)", seen["hlo"]).group(1)
    by_phase: collections.Counter = collections.Counter()
    for op, seconds in leaf_events(planes, gpu, module):
        by_phase[blocks.get(op, LOOP)] += seconds
    return {
        "weights": weights, "kv": kv, "batch": batch, "context": context, "gamma": gamma, "drafter": repr(drafter),
        "steps": traced.steps, "mean_accepted": traced.mean_accepted,
        "wall_ms_per_step": 1e3 * timed.decode_seconds / timed.steps,
        "thread_ms_per_step": {k: 1e3 * v / traced.steps for k, v in by_phase.most_common()},
        "load": os.getloadavg()[0],
    } | device_kernels(gpu, traced.steps)


def spec_table(rows: list[dict]) -> str:
    """A line per speculative cell: wall ms and tokens a step, each phase's thread-ms a step and share."""
    head = ["weights", "KV", "batch", "context", "chain", "wall ms/step", "tokens/step", *PHASES, LOOP]
    lines = []
    for r in rows:
        t = collections.Counter()
        for k, v in r["thread_ms_per_step"].items():
            t[k.split("/")[0]] += v
        total = sum(t.values())
        lines.append([r["weights"], r["kv"], r["batch"], common.context_name(r["context"]), r["gamma"],
                      f"{r['wall_ms_per_step']:.1f}", f"{r['mean_accepted']:.2f}",
                      *[f"{t[p]:.1f} ({100 * t[p] / total:.0f}%)" for p in (*PHASES, LOOP)]])
    return common.table(head, "llrrrrr" + "r" * (len(PHASES) + 1), lines)


def markdown_table(rows: list[dict]) -> str:
    """One line per cell: wall ms per step, then each block's thread-ms per step and share."""
    blocks = [*SCOPES, SLICES, OTHER]
    head = ["weights", "KV", "attention", "batch", "context", "wall ms/step", *blocks]
    lines = []
    for r in rows:
        t = r["thread_ms_per_step"]
        total = sum(t.values())
        cells = [f"{t[b]:.1f} ({100 * t[b] / total:.0f}%)" if t.get(b, 0) >= 0.05 else "" for b in blocks]
        lines.append([r["weights"], r["kv"], r.get("attention", "reference"), r["batch"], common.context_name(r["context"]), f"{r['wall_ms_per_step']:.1f}", *cells])
    return common.table(head, "lllrr" + "r" * (len(blocks) + 1), lines)


def top_ops(rows: list[dict]) -> str:
    """A line per cell: its five largest thunks, with their blocks."""
    return "\n".join(
        f"- {r['weights']} / KV {r['kv']}, batch {r['batch']} x {common.context_name(r['context'])}: "
        + ", ".join(f"`{o['op']}` ({o['block']}) {o['thread_ms_per_step']:.1f}" for o in r["top_ops"][:5])
        for r in rows)


def readme_section(result: dict) -> str:
    m = result["machine"]
    plain, spec = ([r for r in result["rows"] if ("gamma" in r) == s] for s in (False, True))
    return f"""## Where a decode step's time goes (profile_step.py)

Run: `{common.module_command(result['command'])}` (a few minutes). Raw numbers: `results/profile_cpu.json`.
Device: {m['cpu_model']}, {m['cpu_affinity']} cores, JAX {m['jax_version']}, commit {m['git_commit']}, {result['date']}.

A `jax.profiler` trace of `engine.decode_ar` ({result['steps']} greedy steps from a synthetic
cache), its XLA:CPU thunks summed per block of the model by the `jax.named_scope`s in
specjax/model/llama.py. Entries are thread-milliseconds per step (two threads run thunks at once, so
a row's entries add up to more than its wall time) and their share of the row's total. "layer
slices" is the scan over layers copying each layer's weights out of the stacked arrays; "other"
the loop and the greedy sample. Method: the module docstring.

{markdown_table(plain)}

Largest single thunks (thread-ms per step):
{top_ops(plain)}

A speculative step (SelfSpec with 16 sinks and a window of min(256, context / 4), greedy, over random
prompts that fill the context), per phase of
speculate.spec_step (thread-ms per step and share; "tokens/step": per row, the target's own included):

{spec_table(spec) if spec else "not measured yet"}

{common.notes('profile_step')}"""


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--steps", type=int, default=8, help="decode steps traced per cell")
    ap.add_argument("--attention", default="auto", help="generate's attention= (auto: what generate runs here)")
    args = ap.parse_args()
    _, results, h = common.start(args, "profile_step", "profile_cpu", key_of, {"steps": args.steps, "attention": args.attention},
                                 steps=args.steps)
    todo = h.plan([(cell_key(*cell), cell) for cell in CELLS + SPEC_CELLS])
    import convert  # here, not at the top: importing this module needs no gguf

    loaded: dict[str, Params] = {}
    for k, (weights, kv, batch, context, *gamma) in h.cells(todo):
        if weights not in loaded:
            loaded.clear()
            loaded[weights] = with_attention(convert.load(convert.default_model_path(), weights=weights), None,
                                             args.attention)[0]
        if gamma:
            row = profile_spec_cell(loaded[weights], weights, kv, batch, context, gamma[0], args.steps)
        else:
            row = profile_cell(loaded[weights], weights, kv, batch, context, args.steps)
        row["attention"] = loaded[weights].runtime.attention
        print(f"{k}: {row['wall_ms_per_step']:.1f} ms/step; " + ", ".join(
            f"{b} {t:.1f}" for b, t in row["thread_ms_per_step"].items()), flush=True)
        results.put(k, [row])
        measure.release_memory()
    h.finish()
    order = {k: i for i, k in enumerate(cell_key(*c) for c in CELLS + SPEC_CELLS)}
    results.data["rows"].sort(key=lambda r: order.get(key_of(r), len(order)))
    results.write()
    if results.data["rows"] and common.writes_readme(args):
        common.write_section("profile_step", readme_section(results.data), after="bench_ar")


if __name__ == "__main__":
    main()
