"""MTP after an image: the MTP layer of GLM-OCR or Qwen3.5 drafting a transcription
against a chat about the same image, and prefill with an image, mlx-mtp against
mlx-vlm's plain generation on the same files, in one process (one BLAS for both:
scripts/fast_blas.py).

    python scripts/image_bench.py [--family glm_ocr|qwen3_5|gemma4] [--model M]
        [--size bench|test] [--tokens 48] [--reps 3] [--json out.json]

Without ``--model`` it writes a predictable fixture of the family's layout
(`mlx_mtp.testing.fixtures`, ``predictable=True``: random weights rewired so that
the MTP layer often agrees with the trunk): ``--size bench`` a 1024-wide, 8-layer
text model with an 8-block vision tower (about 100M parameters for GLM-OCR, 120M
for Qwen3.5 with its Gated-DeltaNet layers, float32), ``test`` the test suite's.
``gemma4`` is the test suite's E2B-shaped pair (a target with per-layer inputs
and its vision tower, a centroid-head assistant; ``--size test`` only, ``--model``
then names the target and ``--draft-model`` its assistant). The image is a rendered
page of text. For each prompt (``transcribe``: "Transcribe
the page."; ``chat``: a question about the picture) it reports:

- acceptance per position and tokens per verify pass of the MTP layer at k = 3
  (heads only, the whole vocabulary), greedy;
- decode tok/s (after the first token) of mlx-mtp with its defaults (``-k auto``,
  with the draft lengths it picked), of mlx-mtp's plain decoding (``-k 0``) and of
  mlx-vlm's plain generation, and the ratio of the first to the last; the tokens of
  all are checked equal;
- prefill: seconds to the first token (image processing, vision tower and the
  prompt's prefill), mlx-mtp against mlx-vlm, the median of the timed
  repetitions (the first warms up and is not timed); mlx-mtp's kept image
  features are dropped before each run, so that its tower runs every time.

Acceptance on a random-weight fixture says that drafting after an image works and
stays exact, not how predictable a real OCR transcription is.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_blas import ensure_fast_blas  # noqa: E402

PROMPTS = {
    "transcribe": "Transcribe the page.",
    "chat": "What do you think of this picture? Tell me a story about it.",
}
SIZES = {
    "bench": dict(
        vocab_size=512, hidden=1024, layers=8, vision_width=512, vision_depth=8
    ),
    "test": {},
}
FAMILIES = {"glm_ocr": {}, "qwen3_5": {"vision": True}, "gemma4": {}}
LINES = [
    "INVOICE 2026-0417",
    "Apples, 12 kg at 3.20 = 38.40",
    "Pears, 8 kg at 2.75 = 22.00",
    "Total due: 60.40 EUR",
]


def render_page(path: Path) -> Path:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (320, 120), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(LINES):
        draw.text((8, 8 + 26 * i), line, fill="black")
    image.save(path)
    return path


def ours(model, tokenizer, prompt, image, n, **options):
    """(tokens, seconds to the first token, decode tok/s, MTP stats)."""
    from mlx_mtp.generate import stream_generate

    model.trunk.__dict__.pop("_features_kept", None)  # the image encoded each time
    tic = time.perf_counter()
    tokens, first, stats = [], None, None
    for r in stream_generate(
        model, tokenizer, prompt, images=[image], max_tokens=n, **options
    ):
        if first is None:
            first = time.perf_counter() - tic
            tic = time.perf_counter()
        tokens.append(r.token)
        stats = r.mtp
    rate = (len(tokens) - 1) / (time.perf_counter() - tic) if n > 1 else 0.0
    return tokens, first, rate, stats


def mlx_vlm(model, processor, prompt, image, n):
    """(tokens, seconds to the first token, decode tok/s) of its plain generation."""
    from mlx_vlm.generate.dispatch import stream_generate

    tic = time.perf_counter()
    tokens, first = [], None
    for r in stream_generate(
        model, processor, prompt, image=[str(image)], max_tokens=n, temperature=0.0
    ):
        if first is None:
            first = time.perf_counter() - tic
            tic = time.perf_counter()
        tokens.append(r.token)
    tokens = tokens[:n]
    rate = (len(tokens) - 1) / (time.perf_counter() - tic) if n > 1 else 0.0
    return tokens, first, rate


def gemma4_pair(tmp: Path, size: str):
    """The test suite's predictable E2B-shaped Gemma 4 pair, with its tower."""
    from mlx_mtp.testing.gemma4 import write_gemma4, write_gemma4_assistant

    if size != "test":
        raise SystemExit("--family gemma4 has the test size only: --size test")
    target = write_gemma4(
        tmp / "target", "e2b", predictable=True, vision=True, sliding_window=24
    )
    assistant = write_gemma4_assistant(
        tmp / "assistant", target, centroids=True, predictable=True
    )
    return target, assistant


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=sorted(FAMILIES), default="glm_ocr")
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--draft-model", type=Path, default=None)
    p.add_argument("--size", choices=sorted(SIZES), default="bench")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    blas = ensure_fast_blas()
    import mlx.core as mx
    from mlx_vlm import load as vlm_load
    from mlx_vlm.prompt_utils import apply_chat_template

    from mlx_mtp import load
    from mlx_mtp.images import image_messages
    from mlx_mtp.testing.fixtures import write_checkpoint

    log = lambda line: print(line, flush=True)  # noqa: E731
    log(f"BLAS: {blas}; device {mx.default_device()}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path, draft = args.model, args.draft_model
        if path is None and args.family == "gemma4":
            path, draft = gemma4_pair(tmp, args.size)
        elif path is None:
            path = write_checkpoint(
                args.family,
                tmp / "model",
                predictable=True,
                **SIZES[args.size],
                **FAMILIES[args.family],
            )
        image = render_page(tmp / "page.png")
        model, tokenizer = load(str(path), draft_model=draft and str(draft))
        vlm, processor = vlm_load(str(path), strict=False)  # it skips the MTP layer
        results = {}
        for name, question in PROMPTS.items():
            prompt = tokenizer.apply_chat_template(
                image_messages(question, 1), tokenize=False, add_generation_prompt=True
            )
            vlm_prompt = apply_chat_template(
                processor, vlm.config, question, num_images=1
            )
            heads = dict(num_draft_tokens=3, draft_source="heads", draft_vocab=None)
            runs = {"k3": [], "auto": [], "k0": [], "vlm": []}
            for rep in range(args.reps + 1):
                k3 = ours(model, tokenizer, prompt, image, args.tokens, **heads)
                auto = ours(model, tokenizer, prompt, image, args.tokens)
                k0 = ours(
                    model, tokenizer, prompt, image, args.tokens, num_draft_tokens=0
                )
                plain = mlx_vlm(vlm, processor, vlm_prompt, image, args.tokens)
                if not k3[0] == auto[0] == k0[0] == plain[0]:
                    raise SystemExit(f"{name}: the tokens differ from mlx-vlm's")
                if rep:  # the first warms up
                    for run, result in zip(runs, (k3, auto, k0, plain)):
                        runs[run].append(result)
            stats, auto_stats = runs["k3"][-1][3], runs["auto"][-1][3]
            auto_rate = statistics.median(r[2] for r in runs["auto"])
            k0_rate = statistics.median(r[2] for r in runs["k0"])
            vlm_rate = statistics.median(r[2] for r in runs["vlm"])
            ttft = statistics.median(r[1] for r in runs["auto"])
            vlm_ttft = statistics.median(r[1] for r in runs["vlm"])
            row = {
                "prompt": question,
                "acceptance_per_position": [
                    round(a, 2) for a in stats.acceptance_per_position
                ],
                "tokens_per_verify_pass": round(stats.tokens_per_round, 2),
                "decode_tok_s": {
                    "mlx_mtp_auto": auto_rate,
                    "mlx_mtp_k0": k0_rate,
                    "mlx_vlm": vlm_rate,
                },
                "decode_ratio": auto_rate / vlm_rate,
                "auto_rounds_by_k": list(auto_stats.rounds_by_k),
                "auto_accepted": [auto_stats.accepted, auto_stats.drafted],
                "first_token_s": {"mlx_mtp": ttft, "mlx_vlm": vlm_ttft},
            }
            results[name] = row
            log(
                f"{name:10} k=3: acceptance by position "
                f"{row['acceptance_per_position']}, "
                f"{row['tokens_per_verify_pass']} tokens per verify pass | decode "
                f"mlx-mtp (auto) {auto_rate:.2f} tok/s (rounds by k "
                f"{row['auto_rounds_by_k']}, accepted {auto_stats.accepted}/"
                f"{auto_stats.drafted}), mlx-mtp k=0 {k0_rate:.2f}, mlx-vlm "
                f"{vlm_rate:.2f} tok/s: {row['decode_ratio']:.2f}x | first token "
                f"{ttft:.3f} s vs "
                f"{vlm_ttft:.3f} s ({ttft / vlm_ttft:.2f}x)"
            )
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
