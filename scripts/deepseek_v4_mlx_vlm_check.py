"""DeepSeek-V4 MTP layer check against mlx-vlm's V4 MTP drafter: teacher-forced
draft logits of mlx-mtp's ``MTPLayer`` and of mlx-vlm's ``DeepseekV4MTPDraftModel``,
fed the same trunk states, equal within ``--atol`` (1e-4, float32) and with the same
argmax on every row.

Both drafters read one trunk pass: mlx-mtp's, over a prompt of ``--tokens`` (80)
random tokens, longer than the fixture's window (8) and several compression blocks.
(mlx-vlm's trunk is not compared: its ``_overlap_compress_kv`` gives the first block
of each call no overlap with the block before, unlike DeepSeek's reference.) Row i is
the trunk's last-layer streams at position i, before ``hc_head``, with token t_{i+1}.
mlx-vlm's drafter is built the way a user builds it:
its ``split_deepseek_v4_mtp`` writes a drafter folder from the checkpoint's ``mtp.*``
tensors (its sanitize: names, expert stacking, scales) and ``load_drafter`` loads it
(strict), bound to mlx-mtp's trunk (its ``embed_tokens`` and ``lm_head``). mlx-vlm
accepts compress ratios 0, 4 and 128 only: it reads the checkpoint through a folder
of links whose ``config.json`` says 128 wherever the checkpoint has another HCA ratio
(the fixture's 16). Its MTP block is built with ``compress_ratios=[0]`` either way.

Three passes per checkpoint, each a row of the table:

- ``one pass``: every row in one call (mlx-mtp ``mtp_forward``; mlx-vlm
  ``_forward_hidden``, the body of its ``_forward_tokens``);
- ``chunks of N``: the rows in calls of ``--chunk`` rows, through each side's own
  sliding-window cache (mlx-mtp ``WindowCache``, mlx-vlm ``RotatingKVCache``);
- ``mlx-vlm as is``: mlx-vlm's public ``prefill_from_target_hidden`` (its prompt pass).

mlx-mtp zeroes the embedding of the row at position 0 (DeepSeek's and vLLM's
convention); mlx-vlm does not. The first two passes zero it on mlx-vlm's side too, so
every row is compared. In the third the rows within the window of row 0 (0 .. window
- 1) differ by convention and are reported, not checked; the later rows, and the seed
token mlx-vlm drafts from the last row, are checked. Exits 1 on any mismatch.

Setup: mlx-vlm is not a dependency of mlx-mtp. With ``--no-deps`` it needs only
Pillow beyond what mlx-mtp's environment has (mlx, mlx-lm, transformers,
safetensors); a folder outside the environment is enough:

    pip install --no-deps --target /tmp/mlx-vlm mlx-vlm==0.6.15 pillow
    python scripts/deepseek_v4_mlx_vlm_check.py --mlx-vlm /tmp/mlx-vlm

``--mlx-vlm`` is any folder holding the ``mlx_vlm`` package (a git checkout too;
Pillow then comes from the environment or ``PYTHONPATH``); without it the installed
mlx-vlm is used. Checked with 0.6.15 and with ``Blaizzy/mlx-vlm@9b13f52`` (the same
drafter, V4 block and hyper-connection code), on the CPU: there mlx-vlm's
hyper-connections run its pure-MLX ops; on a Mac's GPU, its fused Metal kernel.

By default the tiny ``deepseek_v4`` fixture is written for each ``--seeds`` and
``--fixtures`` (plain: a random MTP layer; predictable: one that often agrees with the
trunk); ``--model DIR`` checks a release-layout folder instead.
"""

import argparse
import json
import pathlib
import sys
import tempfile
from typing import NamedTuple, Optional

import numpy as np

MLX_VLM_RATIOS = (0, 4, 128)


class Rows(NamedTuple):
    """One drafter's teacher-forced outputs: logits ``(L, V)``, streams
    ``(L, hc, D)``."""

    logits: np.ndarray
    streams: np.ndarray


def import_mlx_vlm(path: Optional[pathlib.Path]):
    """mlx-vlm's splitter and drafter loader (from ``path`` when given)."""
    if path is not None:
        if not (path / "mlx_vlm").is_dir():
            raise SystemExit(f"error: {path} holds no mlx_vlm package")
        sys.path.insert(0, str(path))
    try:
        import mlx_vlm
        from mlx_vlm.speculative.drafters import load_drafter
        from mlx_vlm.speculative.drafters.deepseek_v4_mtp.split import (
            split_deepseek_v4_mtp,
        )
    except ImportError as exc:
        raise SystemExit(f"error: cannot import mlx-vlm's V4 MTP drafter: {exc}")
    print(f"mlx-vlm {mlx_vlm.__version__} from {pathlib.Path(mlx_vlm.__file__).parent}")
    return split_deepseek_v4_mtp, load_drafter


def mlx_vlm_view(model_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A folder of links to ``model_dir``'s files whose ``config.json`` has only the
    compress ratios mlx-vlm accepts (any other HCA ratio reads 128)."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    ratios = config.get("compress_ratios", [])
    config["compress_ratios"] = [r if r in MLX_VLM_RATIOS else 128 for r in ratios]
    if config["compress_ratios"] != ratios:
        print(f"note: mlx-vlm reads compress_ratios {config['compress_ratios']}")
    (out / "config.json").write_text(json.dumps(config))
    return out


def mlx_vlm_drafter(model_dir, work: pathlib.Path, trunk, vlm):
    """mlx-vlm's drafter for ``model_dir``'s ``mtp.*``, bound to ``trunk``."""
    split, load_drafter = vlm
    view = mlx_vlm_view(model_dir, work / "mlx_vlm_view")
    split(str(view), str(work / "mlx_vlm_drafter"))
    drafter, kind = load_drafter(str(work / "mlx_vlm_drafter"))
    if kind != "mtp":
        raise SystemExit(f"error: mlx-vlm loaded a {kind!r} drafter, not 'mtp'")
    return drafter.bind(trunk)


def _np(x) -> np.ndarray:
    import mlx.core as mx

    return np.array(x.astype(mx.float32)[0], dtype=np.float64)


def mlx_mtp_rows(model, packed, seq, chunk: int) -> Rows:
    """mlx-mtp's MTP layer over rows ``(packed[i], seq[i + 1])``, ``chunk`` rows a
    call through its cache."""
    import mlx.core as mx

    from mlx_mtp.cache import mtp_caches

    cache, n = mtp_caches(model)[0], seq.shape[1] - 1
    outs = []
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        outs.append(model.mtp_forward(0, packed[:, a:b], seq[:, a + 1 : b + 1], cache))
    out = mx.concatenate(outs, axis=1)
    hc, D = model.args.hc_mult, model.args.hidden_size
    streams = out[..., : hc * D].reshape(*out.shape[:2], hc, D)
    return Rows(_np(model.logits(out)), _np(streams))


def mlx_vlm_rows(drafter, trunk, streams, seq, chunk: int) -> Rows:
    """mlx-vlm's drafter over the same rows, ``chunk`` rows a call as its
    ``_forward_tokens`` does them, with the embedding at position 0 zeroed."""
    import mlx.core as mx

    drafter.reset(trunk)
    drafter._next_position = 0
    logits, out_streams, n = [], [], seq.shape[1] - 1
    for a in range(0, n, chunk):
        tokens = seq[:, a + 1 : a + 1 + chunk]
        e = drafter._input_embed(tokens)
        if a == 0:
            e = mx.where((mx.arange(e.shape[1]) > 0)[None, :, None], e, 0)
        normed, pre_hc = drafter._forward_hidden(
            e, streams[:, a : a + tokens.shape[1]], tokens, drafter._cache
        )
        drafter._next_position += tokens.shape[1]
        logits.append(drafter._lm_head_fn(normed))
        out_streams.append(pre_hc)
    cat = mx.concatenate
    return Rows(_np(cat(logits, axis=1)), _np(cat(out_streams, axis=1)))


def mlx_vlm_prefill(drafter, trunk, streams, seq):
    """mlx-vlm's own prompt pass (``prefill_from_target_hidden``, greedy, the last
    token as its bonus): its rows and the seed token it drafts from."""
    recorded = []
    forward = drafter._forward_tokens

    def record(*args, **kwargs):
        out = forward(*args, **kwargs)
        recorded.append(out)
        return out

    drafter.reset(trunk)
    drafter._forward_tokens = record
    try:
        n = seq.shape[1] - 1
        drafter.prefill_from_target_hidden(
            seq[:, :n], streams[:, :n], int(seq[0, n].item()), None, greedy=True
        )
    finally:
        del drafter._forward_tokens
    ((normed, pre_hc),) = recorded
    rows = Rows(_np(drafter._lm_head_fn(normed)), _np(pre_hc))
    return rows, int(drafter._seed_token.reshape(-1)[0].item())


def compare(
    label: str, ours: Rows, theirs: Rows, rows: slice, atol: Optional[float]
) -> bool:
    """Print one table row for ``rows``; True when the logits agree within ``atol``
    and the argmax is equal on every row (always, with no ``atol``: a row for
    information)."""
    a, b = ours.logits[rows], theirs.logits[rows]
    logit_diff = float(np.abs(a - b).max())
    stream_diff = float(np.abs(ours.streams[rows] - theirs.streams[rows]).max())
    equal = int((a.argmax(-1) == b.argmax(-1)).sum())
    if atol is None:
        ok, verdict = True, "info"
    else:
        ok = logit_diff <= atol and equal == len(a)
        verdict = "ok" if ok else "FAIL"
    first, last = range(len(ours.logits))[rows][0], range(len(ours.logits))[rows][-1]
    print(
        f"  {label:<26} {first:>3}-{last:<3} {logit_diff:>11.2e} {stream_diff:>11.2e}"
        f" {equal:>4}/{len(a):<4} {verdict}"
    )
    return ok


def check(model_dir: pathlib.Path, work: pathlib.Path, seed: int, args, vlm) -> bool:
    """Every pass on one checkpoint; True when all agree."""
    import mlx.core as mx

    from mlx_mtp import load

    model, _ = load(str(model_dir))
    trunk, window = model.trunk, model.mtp.layers[0].window
    drafter = mlx_vlm_drafter(model_dir, work, trunk, vlm)
    rng = np.random.default_rng(seed + 1)
    seq = mx.array(rng.integers(0, model.args.vocab_size, args.tokens))[None]
    packed = model.hidden(seq)
    hc, D = model.args.hc_mult, model.args.hidden_size
    streams = packed[..., : hc * D].reshape(1, seq.shape[1], hc, D)

    whole, later = slice(None), slice(window, None)
    ok = True
    for chunk in (seq.shape[1], args.chunk):
        ours = mlx_mtp_rows(model, packed, seq, chunk)
        theirs = mlx_vlm_rows(drafter, trunk, streams, seq, chunk)
        label = "one pass" if chunk == seq.shape[1] else f"chunks of {chunk}"
        ok &= compare(label + ", row 0 zeroed", ours, theirs, whole, args.atol)
    ours = mlx_mtp_rows(model, packed, seq, seq.shape[1])
    theirs, seed_token = mlx_vlm_prefill(drafter, trunk, streams, seq)
    compare("mlx-vlm as is", ours, theirs, slice(0, window), None)
    ok &= compare("mlx-vlm as is", ours, theirs, later, args.atol)
    if seed_token != int(ours.logits[-1].argmax()):
        print(
            f"  FAIL: mlx-vlm's seed token {seed_token}, mlx-mtp's last row's argmax "
            f"{int(ours.logits[-1].argmax())}"
        )
        ok = False
    return ok


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=pathlib.Path, help="release-layout folder")
    parser.add_argument("--mlx-vlm", type=pathlib.Path, help="folder with mlx_vlm/")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument(
        "--fixtures",
        nargs="+",
        default=["plain", "predictable"],
        choices=["plain", "predictable"],
    )
    parser.add_argument("--tokens", type=int, default=80, help="prompt length")
    parser.add_argument("--chunk", type=int, default=3, help="rows per cached call")
    parser.add_argument("--atol", type=float, default=1e-4)
    args = parser.parse_args(argv)
    vlm = import_mlx_vlm(args.mlx_vlm)

    from mlx_mtp.testing.fixtures import write_checkpoint

    print(
        "mlx-mtp zeroes the embedding at position 0, mlx-vlm does not: the 'row 0 "
        "zeroed'\npasses zero it for mlx-vlm too; 'mlx-vlm as is' checks the rows "
        "past row 0's window"
    )
    print(f"  {'pass':<26} {'rows':<7} {'max|logit|':>11} {'max|stream|':>11} argmax")
    runs = (
        [(None, s) for s in args.seeds]
        if args.model
        else [(f, s) for f in args.fixtures for s in args.seeds]
    )
    ok = True
    for fixture, seed in runs:
        with tempfile.TemporaryDirectory() as tmp:
            work = pathlib.Path(tmp)
            model_dir = args.model or write_checkpoint(
                "deepseek_v4",
                work / "model",
                seed=seed,
                predictable=fixture == "predictable",
            )
            print(f"{fixture or model_dir}, seed {seed}:")
            ok &= check(model_dir, work, seed, args, vlm)
    print("all rows agree" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
