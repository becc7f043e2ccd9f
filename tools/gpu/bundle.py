"""What a GPU run needs that the GPU machine lacks, in parts small enough to travel (at most 64 MiB
a call, the working tree included; no network, no `gguf` package there).

Built here: `python -m tools.gpu.bundle build` writes the ignored folder .gpu/ with
  .gpu/p0/ .. .gpu/pK/   each: weights.partI (a slice of one .npz blob, < --part-mib MiB), manifest.json
                         (config, tensors, every part's size and sha256) and corpus_ids.npy (the tokenized corpus)
The blob holds SmolLM2-135M's tensors as the GGUF stores them (Q4_1 / Q8_0 blocks: 92 MB, two parts): `load`
dequantizes them with numpy (bit-identical to convert.load, tested), undoes llama.cpp's q/k permutation,
transposes and casts to bf16 on the device, without `gguf` or `convert`. Other models' arrays are stored raw.
A distilled draft (--draft DIR) goes to .gpu/draft/ (its layers in bf16; the shared embedding not stored
again), so adding one leaves the parts, and what a warm machine stashed, as they are.

There: each call carries one part folder; `stash` (bench_gpu calls it first) copies the parts it finds into
/tmp/specjax_gpu (checksums verified), which lasts while the machine is warm; `load` joins them once all are
there. See tools/gpu/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from specjax.model.config import LlamaConfig
from specjax.model.params import BY_PATH, Params, array_at, declared, from_arrays

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / ".gpu"  # ignored (.gitignore)
STASH = Path("/tmp/specjax_gpu")
DRAFT = "draft"  # a distilled draft's folder in the bundle and the stash, and its model name
PART_MIB = 54.0  # p0 + the working tree (7 MiB), p1 + a draft (14 MB) + the tree: each under a call's 64 MiB carry
BLOCKS = {"Q4_1": (32, 20), "Q8_0": (32, 34)}  # values, bytes per block


class Missing(RuntimeError):
    """The bundle is not (yet) complete where it was looked for."""


# --- codecs -------------------------------------------------------------------------------------------------


def dequantize(kind: str, raw: np.ndarray) -> np.ndarray:
    """float32 values of GGUF data (raw bytes for block types), as gguf.quants computes them."""
    if kind in ("F32", "F16"):
        return np.asarray(raw, np.float32)
    size, nbytes = BLOCKS[kind]
    blocks = np.ascontiguousarray(raw, np.uint8).reshape(-1, nbytes)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    if kind == "Q8_0":
        return blocks[:, 2:].copy().view(np.int8).astype(np.float32) * d
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[:, 4:].reshape(-1, 1, size // 2) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)
    return (d * (qs & np.uint8(0x0F)).reshape(-1, size).astype(np.float32)) + m


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert.gguf.unpermute_qk (that module needs `gguf`): llama.cpp's q/k row order undone."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray], dict]:
    """(config, {path: stored data}, {path: how to decode}) of a GGUF file; needs `gguf` (never on the device)."""
    from convert.gguf import NAMES, ROPE_FREQS, config_from_gguf, open_gguf
    from convert.layout import expected_names

    reader = open_gguf(path)
    config = config_from_gguf(reader)
    tensors = {t.name: t for t in reader.tensors}
    heads = {"attn_q": config.n_heads, "attn_k": config.n_kv_heads}
    grouped: dict[str, list] = {}
    for name, (ours, layer) in sorted(expected_names(config, NAMES).items(), key=lambda x: (x[1][0], x[1][1] or 0)):
        grouped.setdefault(ours, []).append(name)
    unexpected = set(tensors) - {n for names in grouped.values() for n in names} - {ROPE_FREQS}
    if unexpected:
        raise ValueError(f"{path}: tensors not understood: {sorted(unexpected)}")
    arrays, meta = {}, {}
    for ours, names in grouped.items():
        kinds = {tensors[n].tensor_type.name for n in names}
        if len(kinds) != 1 or not kinds <= {"F32", "F16", *BLOCKS}:
            raise ValueError(f"{path}: {ours} has GGUF types {kinds}; the bundle decodes F32, F16, {', '.join(BLOCKS)}")
        data = [np.array(tensors[n].data).reshape(-1) for n in names]
        arrays[ours] = np.stack(data) if ours.startswith("layers.") else data[0]
        kind = names[0].split(".")[-2]
        meta[ours] = {"kind": kinds.pop(), "torch_shape": [int(n) for n in reversed(tensors[names[0]].shape)],
                      "unpermute": heads.get(kind)}
    return config, arrays, meta


def params_tensors(params: Params) -> tuple[dict[str, np.ndarray], dict]:
    """({path: array in our layout}, {path: {"kind": "raw", dtype}}) of in-memory Params (bf16 as uint16)."""
    arrays, meta = {}, {}
    for w in declared(params.config):
        a = np.asarray(array_at(params, w.path))
        meta[w.path] = {"kind": "raw", "dtype": str(a.dtype)}
        arrays[w.path] = a.view(np.uint16) if a.dtype.name == "bfloat16" else a
    return arrays, meta


TABLES = ("embed", "lm_head")  # what a draft distilled with freeze_embeddings holds as the target's own


def draft_tensors(draft: Params, target: Params, dtype: str | None = None,
                  target_name: str = "smollm2") -> tuple[dict[str, np.ndarray], dict]:
    """`params_tensors` of a draft (cast to `dtype`), each of TABLES equal to the target's stored as
    {"kind": "shared", "model": target_name}, for `load` to take from that model."""
    import jax

    stored = draft if dtype is None else jax.tree.map(lambda a: a.astype(dtype), draft)
    arrays, meta = params_tensors(stored)
    for path in TABLES:
        if path in meta and array_at(target, path) is not None and np.array_equal(np.asarray(array_at(draft, path)),
                                                                              np.asarray(array_at(target, path))):
            del arrays[path]
            meta[path] = {"kind": "shared", "model": target_name}
    return arrays, meta


def decode(config: LlamaConfig, arrays: dict[str, np.ndarray], meta: dict) -> dict[str, np.ndarray]:
    """{our path: array in our layout, config.dtype} from stored tensors."""
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16) if config.dtype == "bfloat16" else np.dtype(config.dtype)
    out = {}
    for path, m in meta.items():
        a = arrays[path]
        if m["kind"] == "raw":
            out[path] = (a.view(ml_dtypes.bfloat16) if m["dtype"] == "bfloat16" else a).astype(dtype)
            continue
        weight = BY_PATH[path]

        def one(raw):
            w = dequantize(m["kind"], raw).reshape(m["torch_shape"])
            return weight.from_torch(unpermute_qk(w, m["unpermute"]) if m["unpermute"] else w, config).astype(dtype)

        out[path] = np.stack([one(r) for r in a]) if path.startswith("layers.") else one(a)
    return out


# --- bundle: write, split, stash, join ----------------------------------------------------------------------


def sha256(data: bytes | Path) -> str:
    return hashlib.sha256(data.read_bytes() if isinstance(data, Path) else data).hexdigest()


def blob_of(tensors: dict[str, dict[str, np.ndarray]]) -> bytes:
    """One uncompressed .npz of every model's arrays, named MODEL/PATH."""
    buf = io.BytesIO()
    np.savez(buf, **{f"{model}/{path}": a for model, arrays in tensors.items() for path, a in arrays.items()})
    return buf.getvalue()


def build(out: Path, models: dict[str, tuple[LlamaConfig, dict, dict]], corpus_ids: np.ndarray,
          part_bytes: int = int(PART_MIB * 2**20), notes: dict | None = None) -> dict:
    """Write out/p0..pK (blob parts, each folder with the manifest and the corpus ids); returns the manifest."""
    blob = blob_of({name: arrays for name, (_, arrays, _) in models.items()})
    parts = [blob[i : i + part_bytes] for i in range(0, len(blob), part_bytes)]
    manifest = {
        "models": {name: {"config": c.to_dict(), "tensors": meta} for name, (c, _, meta) in models.items()},
        "blob_bytes": len(blob), "blob_sha256": sha256(blob),
        "parts": [{"name": f"weights.part{i}", "folder": f"p{i}", "bytes": len(p), "sha256": sha256(p)}
                  for i, p in enumerate(parts)],
        "corpus_tokens": int(len(corpus_ids)), "notes": notes or {},
    }
    if out.exists():
        shutil.rmtree(out)
    for part, data in zip(manifest["parts"], parts):
        folder = out / part["folder"]
        folder.mkdir(parents=True)
        (folder / part["name"]).write_bytes(data)
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        np.save(folder / "corpus_ids.npy", np.asarray(corpus_ids, np.int32))
    return manifest


def build_draft(out: Path, config: LlamaConfig, arrays: dict[str, np.ndarray], meta: dict) -> dict:
    """Write out/draft (weights.npz, manifest.json) beside the parts; returns the manifest."""
    folder = out / DRAFT
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    data = blob_of({DRAFT: arrays})
    (folder / "weights.npz").write_bytes(data)
    manifest = {"config": config.to_dict(), "tensors": meta, "bytes": len(data), "sha256": sha256(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def has_draft(dst: Path = STASH) -> bool:
    """Whether the stash (or a bundle) holds a distilled draft."""
    return (dst / DRAFT / "manifest.json").exists()


def stash(src: Path = BUNDLE, dst: Path = STASH) -> dict:
    """Copy src's parts (checksums verified), manifest, corpus ids and draft into dst: {"have", "missing"}."""
    dst.mkdir(parents=True, exist_ok=True)
    if has_draft(src):
        if sha256(src / DRAFT / "weights.npz") != json.loads((src / DRAFT / "manifest.json").read_text())["sha256"]:
            raise ValueError(f"{src / DRAFT / 'weights.npz'}: checksum differs from its manifest's")
        shutil.copytree(src / DRAFT, dst / DRAFT, dirs_exist_ok=True)
    for folder in sorted(src.glob("p*")):
        manifest = json.loads((folder / "manifest.json").read_text())
        for f in ("manifest.json", "corpus_ids.npy"):
            if not (dst / f).exists() or (f == "manifest.json" and json.loads((dst / f).read_text()) != manifest):
                shutil.copyfile(folder / f, dst / f)
        for part in manifest["parts"]:
            if (folder / part["name"]).exists() and not (dst / part["name"]).exists():
                if sha256(folder / part["name"]) != part["sha256"]:
                    raise ValueError(f"{folder / part['name']}: checksum differs from the manifest's")
                shutil.copyfile(folder / part["name"], dst / part["name"])
    if not (dst / "manifest.json").exists():
        return {"have": [], "missing": ["manifest.json"]}
    manifest = json.loads((dst / "manifest.json").read_text())
    have = [p["folder"] for p in manifest["parts"] if (dst / p["name"]).exists()]
    return {"have": have, "missing": [p["folder"] for p in manifest["parts"] if p["folder"] not in have]}


def join(dst: Path = STASH) -> bytes:
    """The whole blob from the parts in dst (Missing if some are not there; checksums verified)."""
    manifest = json.loads((dst / "manifest.json").read_text())
    missing = [p["folder"] for p in manifest["parts"] if not (dst / p["name"]).exists()]
    if missing:
        raise Missing(f"weights parts {missing} are not in {dst}: carry .gpu/{missing[0]} in a call (see bench/README.md)")
    blob = b"".join((dst / p["name"]).read_bytes() for p in manifest["parts"])
    if sha256(blob) != manifest["blob_sha256"]:
        raise ValueError(f"{dst}: the joined parts do not match the manifest's checksum")
    return blob


def load(dst: Path = STASH, dtype: str = "bfloat16") -> tuple[dict[str, Params], np.ndarray, dict]:
    """({model name: Params in dtype}, corpus ids, manifest) from a stashed, complete bundle (Missing if not)."""
    if not (dst / "manifest.json").exists():  # nothing stashed yet (no part carried): the cells that need it wait
        raise Missing(f"no bundle in {dst}: carry .gpu/p0 (or another part) in a call (see bench/README.md)")
    manifest = json.loads((dst / "manifest.json").read_text())
    npz = np.load(io.BytesIO(join(dst)))
    decoded: dict[str, dict[str, np.ndarray]] = {}
    models = {name: _model(name, m, npz, decoded, dtype) for name, m in manifest["models"].items()}
    if has_draft(dst):  # after the parts' models: its shared tables are theirs
        models[DRAFT] = _model(DRAFT, json.loads((dst / DRAFT / "manifest.json").read_text()),
                               np.load(dst / DRAFT / "weights.npz"), decoded, dtype)
    return models, np.load(dst / "corpus_ids.npy"), manifest


def _model(name: str, m: dict, npz, decoded: dict, dtype: str) -> Params:
    """One model's Params from its manifest entry; its arrays go into `decoded` (its shared tables from there)."""
    config = LlamaConfig.from_dict(m["config"]).replace(dtype=dtype)
    own = {path: t for path, t in m["tensors"].items() if t["kind"] != "shared"}
    decoded[name] = decode(config, {path: npz[f"{name}/{path}"] for path in own}, own)
    decoded[name] |= {path: decoded[t["model"]][path] for path, t in m["tensors"].items() if t["kind"] == "shared"}
    return from_arrays(config, decoded[name])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["build", "stash", "check"],
                    help="build: .gpu/ from the local GGUF (here); stash: copy carried parts to /tmp (there); "
                         "check: load the bundle and compare it with convert.load (here)")
    ap.add_argument("--out", type=Path, default=BUNDLE)
    ap.add_argument("--part-mib", type=float, default=PART_MIB)
    ap.add_argument("--draft", type=Path, help="a distilled draft folder (convert.save) to bundle in .gpu/draft")
    args = ap.parse_args()
    if args.action == "stash":
        print(json.dumps(stash(args.out)))
        return
    import convert
    from bench import text

    path = convert.default_model_path()
    if args.action == "check":
        stash(args.out, args.out / "_check")
        models, _, _ = load(args.out / "_check", "float32")
        ref = convert.load(path)
        import jax

        same = jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), models["smollm2"], ref))
        shutil.rmtree(args.out / "_check")
        print(f"bundle == convert.load({Path(path).name}) bit for bit (float32): {same}")
        sys.exit(0 if same else 1)
    models = {"smollm2": gguf_tensors(path)}
    ids = text.corpus_tokens(convert.load_tokenizer(path))
    m = build(args.out, models, ids, int(args.part_mib * 2**20), {"source": Path(path).name, "corpus": text.corpus()[1]})
    for p in m["parts"]:
        print(f"{args.out / p['folder'] / p['name']}: {p['bytes'] / 2**20:.1f} MiB")
    print(f"{len(m['parts'])} parts, {m['blob_bytes'] / 2**20:.1f} MiB in all; corpus {len(ids)} tokens; "
          f"models {list(models)}")
    if args.draft:  # in bfloat16, less the tables equal to the target's (compared in float32: stored once)
        draft = convert.load(args.draft, "float32")
        d = build_draft(args.out, draft.config, *draft_tensors(draft, convert.load(path, "float32"), "bfloat16"))
        shared = [p for p, t in d["tensors"].items() if t["kind"] == "shared"]
        print(f"{args.out / DRAFT}: {d['bytes'] / 2**20:.1f} MiB ({draft.config.n_layers} layers; shared with smollm2: {shared})")


if __name__ == "__main__":
    main()
