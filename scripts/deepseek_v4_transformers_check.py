"""DeepSeek-V4 trunk check against transformers: HF ``DeepseekV4ForCausalLM`` (float32)
versus the float64 numpy reference (``tests/numpy_deepseek_v4.py``) and mlx-mtp's
trunk, on one prompt longer than the window (several CSA and HCA blocks, the
indexer's top-k pruning).

It loads a release-layout checkpoint (DeepSeek's tensor names; default: the tiny
``deepseek_v4`` fixture written to a temporary folder) into transformers through its
own conversion mapping, with ``layer_types`` / ``compress_rates`` / ``mlp_layer_types``
set explicitly (transformers' legacy ``compress_ratios`` knows only 0, 4 and 128).
It prints max |diff| of the logits for each pair and exits 1 when one is above
``--atol`` (1e-4). mlx-mtp is skipped, with a line saying why, when it cannot load the
folder. ``--model`` takes a float checkpoint only (no fp8/fp4 weights).

torch is not a dependency of mlx-mtp; set up a separate environment:

    python -m venv /work/tvenv
    /work/tvenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    #   (or PyPI's ``torch`` where that index is unreachable)
    /work/tvenv/bin/pip install transformers==5.24.0 safetensors numpy \\
        "mlx[cpu]==0.32.4" mlx-lm==0.32.2
    /work/tvenv/bin/pip install -e . --no-deps
    /work/tvenv/bin/python scripts/deepseek_v4_transformers_check.py [--model DIR]
"""

import argparse
import json
import pathlib
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def write_fixture(out: pathlib.Path, seed: int) -> pathlib.Path:
    """The deepseek_v4 fixture: ``write_checkpoint`` once the family is registered,
    else the builder's tensors as float32 safetensors (no tokenizer)."""
    from mlx_mtp.testing import fixtures

    if "deepseek_v4" in fixtures.FAMILIES:
        return fixtures.write_checkpoint("deepseek_v4", out, seed=seed)
    from safetensors.numpy import save_file

    init = fixtures._Init(np.random.default_rng(seed))
    cfg, tensors = fixtures._deepseek_v4(init, 512)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def hf_config(config: dict):
    """A ``DeepseekV4Config`` from the release's legacy keys, layer types explicit."""
    from transformers import DeepseekV4Config

    cfg = dict(config)
    n = cfg["num_hidden_layers"]
    ratios = cfg.pop("compress_ratios")[:n]
    heavy = sorted({r for r in ratios if r not in (0, 4)})
    if len(heavy) > 1:
        raise SystemExit(f"error: more than one HCA ratio in compress_ratios: {heavy}")
    kinds = {0: "sliding_attention", 4: CSA}
    cfg["layer_types"] = [kinds.get(r, HCA) for r in ratios]
    cfg["compress_rates"] = {CSA: 4, HCA: heavy[0] if heavy else 128}
    n_hash = cfg.pop("num_hash_layers", 0)
    cfg["mlp_layer_types"] = ["hash_moe"] * n_hash + ["moe"] * (n - n_hash)
    hf = DeepseekV4Config(**cfg)
    hf._attn_implementation = "eager"
    return hf


def hf_logits(model_dir: pathlib.Path, config: dict, tokens) -> np.ndarray:
    """transformers' float32 trunk logits (n, V), no cache."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(
        model_dir,
        config=hf_config(config),
        dtype=torch.float32,
        output_loading_info=True,
    )
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"error: transformers did not load every tensor: {problems}")
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), use_cache=False)
    return out.logits[0].double().numpy()


def numpy_logits(model_dir: pathlib.Path, tokens, topk: int):
    """The float64 reference: (trunk (n, V), [mtp_j (n-1-j, V)]); says which rows
    tie at the indexer's top-k cut (where implementations may pick differently)."""
    sys.path.insert(0, str(ROOT))
    from tests.numpy_deepseek_v4 import reference_logits, topk_ties

    trace = {}
    logits = reference_logits(model_dir, tokens, trace)
    for name, scores in sorted(trace.items()):
        tied = topk_ties(scores, topk) if name.startswith("index_") else []
        if tied:
            layer = name.split("_")[1]
            print(f"note: layer {layer}: rows {tied} tie at the indexer's top-k cut")
    return logits


def mlx_logits(model_dir: pathlib.Path, tokens):
    """mlx-mtp's (trunk, [mtp_j]) logits, teacher-forced, or the reason it cannot."""
    try:
        import mlx.core as mx

        from mlx_mtp import load
        from mlx_mtp.cache import mtp_caches

        model, _ = load(str(model_dir))
        seq = mx.array(tokens)[None]
        h = model.hidden(seq)
        main = np.array(model.logits(h)[0].astype(mx.float32))
        mtp, n = [], len(tokens)
        for j in range(model.num_mtp_layers):
            h = model.mtp_forward(
                j, h[:, : n - 1 - j], seq[:, j + 1 :], mtp_caches(model)[j]
            )
            mtp.append(np.array(model.logits(h)[0].astype(mx.float32)))
        return main, mtp
    except Exception as exc:  # any failure to load or run: report and skip
        reason = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {reason[:120]}"


def compare(label: str, ours: np.ndarray, theirs: np.ndarray, atol: float) -> bool:
    """Print max |diff| (and argmax agreement); True when within ``atol``."""
    if ours.shape != theirs.shape:
        print(f"{label}: shapes differ, {ours.shape} vs {theirs.shape}")
        return False
    diff = float(np.abs(ours - theirs).max())
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    verdict = "ok" if diff <= atol else "FAIL"
    print(f"{label}: max |diff| {diff:.3e}, argmax agree {agree:.3f} [{verdict}]")
    return diff <= atol


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=pathlib.Path, help="release-layout folder")
    parser.add_argument("--tokens", type=int, default=80, help="prompt length")
    parser.add_argument("--seed", type=int, default=0, help="fixture and prompt seed")
    parser.add_argument("--atol", type=float, default=1e-4)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_fixture(pathlib.Path(tmp), args.seed)
        config = json.loads((model_dir / "config.json").read_text())
        rng = np.random.default_rng(args.seed + 1)
        tokens = rng.integers(0, config["vocab_size"], args.tokens).tolist()
        print(
            f"{model_dir}: {args.tokens} tokens, {config['num_hidden_layers']} layers"
        )

        hf = hf_logits(model_dir, config, tokens)
        ref, ref_mtp = numpy_logits(model_dir, tokens, config["index_topk"])
        ok = compare("transformers vs numpy (trunk)", hf, ref, args.atol)
        print(f"logits std: transformers {hf.std():.3f}, numpy {ref.std():.3f}")

        got = mlx_logits(model_dir, tokens)
        if isinstance(got, str):
            print(f"mlx-mtp: cannot load {model_dir} ({got}) (skipped)")
        else:
            main_mlx, mtp_mlx = got
            ok &= compare("mlx-mtp vs transformers (trunk)", main_mlx, hf, args.atol)
            ok &= compare("mlx-mtp vs numpy (trunk)", main_mlx, ref, args.atol)
            for j, (ours, theirs) in enumerate(zip(mtp_mlx, ref_mtp)):
                ok &= compare(f"mlx-mtp vs numpy (mtp.{j})", ours, theirs, args.atol)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
