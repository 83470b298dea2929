"""Peak memory of ``mlx-mtp convert`` relative to the checkpoint's size.

Writes a synthetic Hugging Face checkpoint in MiMo's layout (Qwen2 trunk + MTP layers
at ``model.mtp_layers.{j}``; random bfloat16 weights, --params of them, in --shards
shards), then converts it in a fresh process (4-bit trunk, 8-bit heads by default) and
reports that process's peak resident memory next to the checkpoint size:

    python scripts/convert_memory.py [--params 500e6] [--shards 5] [--keep DIR]
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from mlx_mtp.models import get_family

LAYOUT = get_family({"model_type": "mimo"}).LAYOUT

CHILD = """
import json, resource, sys, time
from mlx_mtp.convert import convert
tic = time.perf_counter()
convert(sys.argv[1], sys.argv[2], quantize=True, q_bits=4, progress=False,
        shard_gb=float(sys.argv[3]))
import mlx.core as mx
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": time.perf_counter() - tic, "peak_rss_bytes": rss,
                  "mlx_peak_bytes": mx.get_peak_memory()}))
"""
BASELINE = """
import json, resource
import mlx.core as mx, mlx_lm, mlx_mtp, convert
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"peak_rss_bytes": rss}))
"""


def write_checkpoint(out: Path, params: float, shards: int) -> int:
    """A MiMo-layout checkpoint of about ``params`` parameters; returns its size."""
    import mlx.core as mx

    hidden, inter, vocab, heads, kv = 1024, 2816, 32000, 16, 4
    per_layer = 4 * hidden * hidden // heads * (heads + kv) // 2 + 3 * hidden * inter
    layers = max(2, int((params - 2 * vocab * hidden) // per_layer))
    hd = hidden // heads
    config = {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "mimo",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }

    def layer(prefix):
        t = {f"{prefix}input_layernorm.weight": (hidden,)}
        for name, dim in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd)):
            t[f"{prefix}self_attn.{name}_proj.weight"] = (dim, hidden)
            t[f"{prefix}self_attn.{name}_proj.bias"] = (dim,)
        t[f"{prefix}self_attn.o_proj.weight"] = (hidden, heads * hd)
        t[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
        t[f"{prefix}mlp.gate_proj.weight"] = (inter, hidden)
        t[f"{prefix}mlp.up_proj.weight"] = (inter, hidden)
        t[f"{prefix}mlp.down_proj.weight"] = (hidden, inter)
        return t

    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update(layer(f"model.layers.{i}."))
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    m = LAYOUT.prefix(config, 0)  # MiMo's MTP layer
    for name in ("enorm", "hnorm", "norm"):
        shapes[f"{m}{LAYOUT.name(name)}.weight"] = (hidden,)
    shapes[f"{m}{LAYOUT.name('eh_proj')}.weight"] = (hidden, 2 * hidden)
    shapes.update(layer(m))
    keys = list(shapes)
    per = -(-len(keys) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for k in keys[s * per : (s + 1) * per]:
            shape = shapes[k]
            if k.endswith("norm.weight"):
                part[k] = mx.ones(shape, dtype=mx.bfloat16)
            else:
                part[k] = (0.02 * mx.random.normal(shape)).astype(mx.bfloat16)
            weight_map[k] = name
        mx.save_safetensors(str(out / name), part, metadata={"format": "pt"})
        total += sum(v.nbytes for v in part.values())
        del part
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return total


def run(code: str, *args) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=500e6)
    p.add_argument("--shards", type=int, default=5)
    p.add_argument("--out-shard-gb", type=float, default=5.0)
    p.add_argument("--keep", type=Path, default=None, help="Write the files here.")
    args = p.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="convert-memory-"))
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    size = write_checkpoint(src, args.params, args.shards)
    base = run(BASELINE)["peak_rss_bytes"]
    result = run(CHILD, src, root / "mlx", args.out_shard_gb)
    peak = result["peak_rss_bytes"]
    out_size = sum(f.stat().st_size for f in (root / "mlx").glob("*.safetensors"))
    gib = 1 << 30
    print(f"checkpoint: {size / gib:.2f} GiB bfloat16 in {args.shards} shards")
    print(f"output:     {out_size / gib:.2f} GiB (4-bit trunk, 8-bit heads)")
    print(
        f"peak RSS of the converting process: {peak / gib:.2f} GiB "
        f"({peak / size:.2f}x the checkpoint; imports alone {base / gib:.2f} GiB), "
        f"{result['seconds']:.0f} s"
    )
    mlx_peak = result["mlx_peak_bytes"]
    print(
        f"peak MLX allocation: {mlx_peak / gib:.2f} GiB ({mlx_peak / size:.2f}x the "
        "checkpoint; the RSS high-water mark is set by the imports, not the conversion)"
    )
    if args.keep is None:
        import shutil

        shutil.rmtree(root)


if __name__ == "__main__":
    main()
