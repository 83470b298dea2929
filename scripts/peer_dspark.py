"""mlx-mtp's DSpark drafter against mlx-vlm's and mlx-dspark's on the same files: a
peer check, outside the default suite.

    python scripts/peer_dspark.py [--vlm DIR] [--dspark DIR]
        [--target PATH --drafter PATH] [--tokens 24] [--tolerance 1e-4]

The peers are installed apart, so that their dependencies stay out of this
environment (mlx-dspark imports mlx-vlm: give both for it):

    pip install --no-deps --target VLM mlx-vlm==0.7.10
    pip install --target VLM pillow
    pip install --no-deps --target DSPARK mlx-dspark==0.20.3
    PYTHONPATH=VLM python scripts/peer_dspark.py --vlm VLM --dspark DSPARK

Without ``--target``/``--drafter`` it writes the tiny fixtures of the test suite
(`mlx_mtp.testing.dspark`: a Qwen3 target and a predictable drafter) to a temporary
folder, in the spelling each peer reads: the nested ``dflash_config`` one for
mlx-vlm, DeepSpec's top-level one for mlx-dspark.

Teacher-forced on every row of the target's own greedy continuation of a prompt: for
each position n, the block after the context rows 0..n-1 with anchor t_n, both
drafters' slot logits with the Markov correction of the true previous token (t_n,
then t_{n+1}, ...), each drafter reading the same packed taps of the target. The
peers are given the target's embedding and head where the folder has none (mlx-vlm's
``bind`` asks for a target of its own with speculative rollback), and mlx-dspark
loads in float (its loader quantizes to 4 bits by default). Prints, per peer, the
largest difference and whether every slot's argmax agrees; exits 1 if a check fails.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import mlx.core as mx


def vlm_drafter(path: Path, trunk):
    """mlx-vlm's DSpark drafter of ``path``, reading ``trunk``'s tables."""
    from mlx_vlm.speculative.drafters import DSparkDraftModel, load_drafter

    model, kind = load_drafter(str(path))  # DSpark runs as its "dflash" kind
    if not isinstance(model, DSparkDraftModel):
        raise SystemExit(f"mlx-vlm loads {path} as {type(model).__name__}")
    model.embed_tokens = trunk.model.embed_tokens
    head = getattr(trunk, "lm_head", None)
    model.lm_head = head if head is not None else trunk.model.embed_tokens.as_linear
    return model


def ours(model, taps: mx.array, tokens, n: int) -> mx.array:
    """mlx-mtp's slot logits ``(gamma, V)`` after context rows 0..n-1 (``taps``:
    the trunk's packed rows), teacher-forced on ``tokens``."""
    from mlx_mtp.cache import mtp_caches, ops

    d = model.drafter
    caches = mtp_caches(model)
    model.draft_context(taps[:, :n], caches)
    context = [ops(c).read_kv([n]) for c in caches]
    z, g = model.draft_block(mx.array([tokens[n]]), context, n)
    state, rows = d.markov_start(1, g.dtype), []
    for k in range(z.shape[1]):
        bias, state = d.markov(mx.array([tokens[n + k]]), g[:, k], state)
        rows.append(z[0, k] if bias is None else z[0, k] + bias[0])
    return mx.stack(rows)


def theirs(m, taps: mx.array, tokens, n: int, gamma: int) -> mx.array:
    """mlx-vlm's slot logits ``(gamma, V)``, as its ``DSparkDraftModel.draft_block``
    computes them, teacher-forced on ``tokens``."""
    c = m.config
    masks = [int(c.mask_token_id)] * (gamma - int(c.sample_from_anchor))
    inputs = mx.array([[tokens[n]] + masks], dtype=mx.int32)
    hidden = m._hidden(inputs, taps[:, :n], m.make_cache())
    if not c.sample_from_anchor:
        hidden = hidden[:, 1:]
    base = m._logits(hidden)[0]  # (gamma, V)
    prev = mx.array(tokens[n : n + gamma], dtype=mx.int32)
    return base + m.markov_head.markov_w2(m.markov_head.get_prev_embeddings(prev))


def dspark_drafter(path: Path, trunk):
    """mlx-dspark's drafter of ``path`` in float (its loader quantizes to 4 bits
    by default), reading ``trunk``'s tables where the folder has none."""
    from mlx_dspark.load import load_drafter

    drafter, _ = load_drafter(str(path), quantize=False)
    if drafter.embed_tokens is None:
        drafter.bind_embed(trunk.model.embed_tokens)
    if drafter.lm_head is None:
        head = getattr(trunk, "lm_head", None)
        drafter.bind_lm_head(
            head if head is not None else trunk.model.embed_tokens.as_linear
        )
    return drafter


def theirs_dspark(d, taps: mx.array, tokens, n: int, gamma: int) -> mx.array:
    """mlx-dspark's slot logits ``(gamma, V)``: the context rows into its caches,
    the block (anchor, then mask tokens) through its backbone at offset n, the
    slots its head reads, each with the Markov bias of the true previous token."""
    caches = d.make_ctx_cache()
    d.update_context(taps[:, :n], 0, caches)
    ids = [tokens[n]] + [int(d.mask_token_id)] * (d.block_size - 1)
    hidden = d.backbone(d.embed(mx.array([ids], dtype=mx.int32)), n, caches)
    base = d.compute_logits(d.head_slice(hidden, gamma))[0]  # (gamma, V)
    prev = mx.array(tokens[n : n + gamma], dtype=mx.int32)
    return base + d.markov_head.step_bias(prev)


def compare(model, peer, taps, tokens, start: int, gamma: int):
    """(largest logit difference, every argmax equal, blocks) over the rows."""
    worst, agree, rows = 0.0, True, 0
    for n in range(start, len(tokens) - gamma):
        a, b = ours(model, taps, tokens, n), peer(taps, tokens, n, gamma)
        worst = max(worst, mx.abs(a - b).max().item())
        agree &= bool(mx.all(mx.argmax(a, -1) == mx.argmax(b, -1)).item())
        rows += 1
    return worst, agree, rows


def continuation(model, prompt, n: int):
    """The prompt and the target's greedy continuation (``n`` tokens and a block
    more), and the trunk's packed taps of all of it."""
    tokens = list(prompt)
    for _ in range(n + model.drafter.block_size):
        logits = model.logits(model.hidden(mx.array(tokens)[None]))
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
    taps = model.hidden(mx.array(tokens)[None])[..., : model.drafter.tap_width]
    return tokens, taps


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vlm", help="the folder mlx-vlm is installed in")
    p.add_argument("--dspark", help="the folder mlx-dspark is installed in")
    p.add_argument("--target", type=Path, default=None)
    p.add_argument("--drafter", type=Path, default=None)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--tolerance", type=float, default=1e-4)
    args = p.parse_args()
    if (args.target is None) != (args.drafter is None):
        p.error("give both --target and --drafter, or neither")
    if not (args.vlm or args.dspark):
        p.error("give --vlm, --dspark or both")
    sys.path[:0] = [d for d in (args.vlm, args.dspark) if d]
    from mlx_mtp.loading import load_model

    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        peers = []  # (name, the layout it reads, its drafter, its slot logits)
        if args.vlm:
            peers.append(("mlx-vlm", "nested", vlm_drafter, theirs))
        if args.dspark:
            peers.append(("mlx-dspark", "deepspec", dspark_drafter, theirs_dspark))
        target = args.target
        if target is None:
            from mlx_mtp.testing.dspark import write_dspark, write_qwen3_target

            target = write_qwen3_target(Path(tmp) / "target", predictable=True)
        for name, layout, load_peer, slots in peers:
            drafter = args.drafter or write_dspark(
                Path(tmp) / layout, target, layout=layout, predictable=True
            )
            model = load_model(str(target), draft_model=str(drafter))[0]
            tokens, taps = continuation(model, list(range(10, 30)), args.tokens)
            peer = load_peer(drafter, model.trunk)
            gamma = model.drafter.block_size
            worst, agree, rows = compare(
                model, lambda *a: slots(peer, *a), taps, tokens, 20, gamma
            )
            ok = worst <= args.tolerance and agree
            failed |= not ok
            print(
                f"{name} ({layout} folder): {rows} blocks of {gamma} slots, "
                f"teacher-forced: largest logit difference {worst:.2e} (tolerance "
                f"{args.tolerance:g}); every argmax equal: {agree}; "
                f"{'PASS' if ok else 'FAIL'}"
            )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
