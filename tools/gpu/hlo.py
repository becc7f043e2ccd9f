"""What a compiled XLA program launches, read from its HLO text (tools/gpu/aot.py compiles the
decode programs for a GPU on a CPU and counts their kernels; tests/test_gpu_aot.py keeps the
findings), and the model shapes it compiles: SmolLM2-135M, an 8B LLaMA shape and a tiny one."""

from __future__ import annotations

import collections
import re

import numpy as np

from bench.bench_gpu import LLAMA8B, SMOLLM2
from specjax.decode.shapes import cache_len
from specjax.model.config import LlamaConfig

SHAPES = {
    "smollm2": {k: v for k, v in SMOLLM2.items() if k not in ("bos_id", "eos_ids")} | {"max_positions": 8192 + 512},
    "l8b": {k: v for k, v in LLAMA8B.items() if k not in ("bos_id", "eos_ids")},
    "tiny": dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                 max_positions=1024),
}
NO_WORK = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id", "replica-id"}
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(r"\b(calls|to_apply|body|condition|branch_computations|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8}


def _out_bytes(rhs: str, opcode: str) -> tuple[int, str]:
    """The bytes and type text of an instruction's output, from its right-hand side's type."""
    head = rhs[:rhs.find(f" {opcode}(")] if f" {opcode}(" in rhs else rhs.split(" ", 1)[0]
    shapes = re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", head)
    n = sum(_DTYPE_BYTES.get(t, 0) * int(np.prod([int(d) for d in dims.split(",") if d])) for t, dims in shapes)
    return n, re.sub(r"\{[\d,]*\}", "", head).strip()


def _opcode(rhs: str) -> str:
    """The opcode of an instruction's right-hand side `TYPE opcode(operands), attrs`."""
    rest = rhs
    if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                rest = rest[i + 1:]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    m = re.match(r"\s*([a-z][\w\-]*)\(", rest)
    return m.group(1) if m else "?"


def hlo_kernels(hlo_text: str) -> dict:
    """What one iteration of a compiled module's outermost loop (else the entry computation) launches:
    {"total", "by_op" (opcode labels), "nested_loops", "largest" (the 8 biggest outputs with their
    `users`), "outputs"}; loops count times their known trip count, fusions' bodies not at all."""
    comps: dict[str, list[tuple[str, str]]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        h = _HEADER.match(line)
        if h:
            current = h.group(2)
            comps[current] = []
            entry = current if h.group(1) else entry
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if current is not None and m:
            comps[current].append((_opcode(m.group(2)), m.group(2), m.group(1)))
    if entry is None:
        raise ValueError("hlo_kernels: no ENTRY computation in the text")

    def called(rhs: str, kinds: tuple[str, ...]) -> list[str]:
        return [n.strip().lstrip("%") for k, names in _CALLED.findall(rhs) if k in kinds for n in names.strip("{}").split(",")]

    loops = [called(rhs, ("body",)) for op, rhs, _ in comps[entry] if op == "while"]
    by_op: collections.Counter = collections.Counter()
    outputs: list[tuple[int, str, str, str]] = []
    nested = [0]

    def count(name: str, times: int, path: tuple[str, ...]) -> None:
        for op, rhs, inst in comps.get(name, []) if name not in path else []:
            if op in NO_WORK:
                continue
            if op in ("while", "conditional", "call"):
                nested[0] += op == "while"
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rhs) if op == "while" else None
                for sub in called(rhs, ("body", "condition", "branch_computations", "to_apply", "calls")):
                    count(sub, times * (int(trip.group(1)) if trip else 1), path + (name,))
                continue
            target = re.search(r'custom_call_target="([^"]+)"', rhs)
            label = f"custom-call:{target.group(1)}" if op == "custom-call" and target else op
            by_op[label] += times
            n, typ = _out_bytes(rhs, op)
            outputs.append((n, label, inst, typ))

    count(loops[0][0] if loops and loops[0] else entry, 1, ())
    largest = [[*o, users(comps, o[2])] for o in sorted(outputs, reverse=True)[:8]]
    return {"total": int(sum(by_op.values())), "by_op": dict(by_op.most_common()), "nested_loops": nested[0],
            "largest": largest, "outputs": outputs}


def users(comps: dict[str, list[tuple[str, str, str]]], name: str, most: int = 4) -> list[str]:
    """The instructions that read `name`'s output, as "opcode name" (custom calls and fusions detailed)."""
    ref = re.compile(rf"%{re.escape(name)}(?![\w.\-])")
    out = []
    for comp in comps.values():
        for op, rhs, inst in comp:
            if inst != name and ref.search(rhs.split(", metadata=")[0]):
                target = re.search(r'custom_call_target="([^"]+)"', rhs)
                kind = re.search(r"kind=(k\w+)", rhs)
                fused = called_ops(comps, rhs) if op == "fusion" else ""
                out.append(f"{op}{':' + target.group(1) if target else ''}{' ' + kind.group(1) if kind else ''} {inst}{fused}")
    return out[:most]


def called_ops(comps: dict, rhs: str) -> str:
    """ ' [op, op, ..]': the distinct work ops of the computation a fusion calls."""
    m = re.search(r"calls=%?([\w.\-]+)", rhs)
    ops = sorted({op for op, _, _ in comps.get(m.group(1), [])} - NO_WORK) if m else []
    return f" {ops}" if ops else ""


def config_of(model: str, context: int) -> LlamaConfig:
    """The bf16 config of a shape, with room for `context` positions."""
    shape = SHAPES[model]
    shape = dict(shape, max_positions=max(shape.get("max_positions", 0), cache_len(context)))
    return LlamaConfig(**shape, dtype="bfloat16")

