"""mlx-mtp's DSpark drafter against mlx-vlm's and mlx-dspark's on the same files, and
its DFlash and DFlash2 drafters against mlx-vlm's (``--dflash``): a peer check,
outside the default suite.

    python scripts/peer_dspark.py [--vlm DIR] [--dspark DIR] [--dflash]
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
mlx-vlm, DeepSpec's top-level one for mlx-dspark; with ``--vlm``, also a Gemma 4
DSpark drafter (``write_gemma4_dspark``: Gemma 4 layers, own embedding and head)
beside a Gemma 4 target, against mlx-vlm's ``Gemma4DSparkDraftModel`` (whose fused
context projection is bypassed: it reads a ``v_proj`` that layers sharing keys and
values lack).

Teacher-forced on every row of the target's own greedy continuation of a prompt: for
each position n, the block after the context rows 0..n-1 with anchor t_n, both
drafters' slot logits with the Markov correction of the true previous token (t_n,
then t_{n+1}, ...), each drafter reading the same packed taps of the target. The
peers are given the target's embedding and head where the folder has none (mlx-vlm's
``bind`` asks for a target of its own with speculative rollback), and mlx-dspark
loads in float (its loader quantizes to 4 bits by default). Prints, per peer, the
largest difference and whether every slot's argmax agrees; exits 1 if a check fails.

``--dflash`` checks DFlash2 and DFlash drafters (`mlx_mtp.testing.dspark`'s
``write_dflash2`` and ``write_dflash`` fixtures, and ``write_gemma4_dflash``'s Gemma 4
one, sliding and full layers, and a DFlash2 one of that spelling, beside a Gemma 4
target; or ``--drafter``) against
mlx-vlm's ``DFlash2DraftModel``, ``DFlashDraftModel`` and ``Gemma4DFlashDraftModel``
(bound to the target by its ``bind``): per row each slot's selector scores
(DFlash: logits), teacher-forced as above (the same candidates, -inf elsewhere,
scores within the tolerance), and the block mlx-vlm's greedy ``draft_block``
proposes equal to the one mlx-mtp's slots draw one after another.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import mlx.core as mx


def vlm_drafter(path: Path, trunk, kind: str = "DSparkDraftModel"):
    """mlx-vlm's drafter of ``path`` (a ``kind``, or a subclass), reading
    ``trunk``'s tables."""
    from mlx_vlm.speculative import drafters

    model, _ = drafters.load_drafter(str(path))  # DSpark runs as its "dflash" kind
    if not isinstance(model, getattr(drafters, kind)):
        raise SystemExit(f"mlx-vlm loads {path} as {type(model).__name__}")
    model.embed_tokens = trunk.model.embed_tokens
    head = getattr(trunk, "lm_head", None)
    model.lm_head = head if head is not None else trunk.model.embed_tokens.as_linear
    return model


def vlm_gemma4_dspark(path: Path, trunk):
    """mlx-vlm's Gemma 4 DSpark drafter of ``path``, with its own embedding (at
    its scale) and head, as its ``bind`` keeps them."""
    from mlx_vlm.speculative import drafters

    model, _ = drafters.load_drafter(str(path))
    if type(model).__name__ != "Gemma4DSparkDraftModel":
        raise SystemExit(f"mlx-vlm loads {path} as {type(model).__name__}")
    # its fused context projection reads every layer's v_proj, which a layer with
    # attention_k_eq_v lacks (an AttributeError in 0.7.10); each layer's own
    # projection (its _project_kv: values = keys' projection) is what it means
    model._project_context_kv = lambda hidden: None
    return model


def ours(model, taps: mx.array, tokens, n: int) -> mx.array:
    """mlx-mtp's slot logits ``(gamma, V)`` after context rows 0..n-1 (``taps``:
    the trunk's packed rows), teacher-forced on ``tokens``."""
    from mlx_mtp.cache import block_context, mtp_caches

    d = model.drafter
    caches = mtp_caches(model)
    model.draft_context(taps[:, :n], caches)
    context = block_context(model.drafter, caches, [n])
    z, g = model.draft_block(mx.array([tokens[n]]), context, n)
    state, rows = d.markov_start(1, g.dtype), []
    for k in range(z.shape[1]):
        prev = mx.array([tokens[n + k]])
        logits, state = model.slot_logits(z[:, k], prev, g[:, k], state)
        rows.append(logits[0])
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


def vlm_dflash(path: Path, trunk):
    """mlx-vlm's DFlash or DFlash2 drafter of ``path`` (Gemma 4's included), given
    ``trunk``'s tables as its ``bind`` takes them (which also asks the target for
    speculative rollback): the embedding with the target's scale (Gemma's sqrt(H))
    and the head."""
    from mlx_vlm.speculative import drafters

    model, _ = drafters.load_drafter(str(path))
    if not isinstance(model, drafters.DFlashDraftModel):
        raise SystemExit(f"mlx-vlm loads {path} as {type(model).__name__}")
    text = getattr(trunk, "language_model", trunk)
    model.embed_tokens = text.model.embed_tokens
    model.embed_scale = getattr(text.model, "embed_scale", 1.0)
    head = getattr(text, "lm_head", None)
    model.lm_head = head if head is not None else model.embed_tokens.as_linear
    return model


def ours_dflash(model, taps: mx.array, tokens, n: int):
    """mlx-mtp's DFlash2 selector scores (DFlash: slot logits) ``(gamma, V)`` after
    context rows 0..n-1, teacher-forced on ``tokens``, and the block its greedy slots
    draw."""
    from mlx_mtp.cache import block_context, mtp_caches

    caches = mtp_caches(model)
    model.draft_context(taps[:, :n], caches)
    context = block_context(model.drafter, caches, [n])
    z, g = model.draft_block(mx.array([tokens[n]]), context, n)
    forced, drawn, prev = [], [], mx.array([tokens[n]])
    for k in range(z.shape[1]):
        forced.append(
            model.slot_logits(z[:, k], mx.array([tokens[n + k]]), g[:, k], None)[0][0]
        )
        prev = mx.argmax(model.slot_logits(z[:, k], prev, g[:, k], None)[0], axis=-1)
        drawn.append(prev.item())
    return mx.stack(forced), drawn


def theirs_dflash(m, taps: mx.array, tokens, n: int, gamma: int):
    """mlx-vlm's: its block's hidden rows and logits, the selector's candidates and
    scores built from its own modules (its ``select`` returns the path only),
    teacher-forced on ``tokens``; and its greedy ``draft_block``."""
    inputs = mx.array([[tokens[n]] + [int(m.config.mask_token_id)] * gamma])
    hidden = m._hidden(inputs, taps[:, :n], m.make_cache())[:, 1:]
    logits = m._logits(hidden)[0]  # (gamma, V)
    greedy = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    drawn = m.draft_block(tokens[n], taps[:, :n], m.make_cache(), gamma + 1, greedy)
    if "candidate_selector" not in m:  # DFlash: each slot from its logits
        return logits, drawn[0].tolist()
    sel = m.candidate_selector
    cand = mx.argpartition(logits, -sel.top_k, axis=-1)[..., -sel.top_k :]
    unary = mx.take_along_axis(logits, cand, axis=-1)
    prev = mx.array(tokens[n : n + gamma])
    hp = sel.hidden_projection(hidden)[0]
    edges = sel.predecessor_codebook(prev)[:, None] * hp[:, None]
    scores = unary + (edges * sel.successor_codebook(cand)).sum(-1)
    forced = mx.put_along_axis(mx.full(logits.shape, -mx.inf), cand, scores, axis=-1)
    return forced, drawn[0].tolist()


def compare_dflash(model, peer, taps, tokens, start: int, gamma: int):
    """(largest score difference over the candidates, same candidates and argmax
    and greedy blocks everywhere, rows)."""
    worst, agree, rows = 0.0, True, 0
    for n in range(start, len(tokens) - gamma):
        (a, drawn_a), (b, drawn_b) = ours_dflash(model, taps, tokens, n), peer(
            taps, tokens, n, gamma
        )
        live = mx.isfinite(a)
        agree &= bool(mx.all(live == mx.isfinite(b)).item()) and drawn_a == drawn_b
        agree &= bool(mx.all(mx.argmax(a, -1) == mx.argmax(b, -1)).item())
        worst = max(worst, mx.where(live, mx.abs(a - b), 0).max().item())
        rows += 1
    return worst, agree, rows


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
    p.add_argument("--dflash", action="store_true", help="check DFlash(2) drafters")
    p.add_argument("--target", type=Path, default=None)
    p.add_argument("--drafter", type=Path, default=None)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--tolerance", type=float, default=1e-4)
    args = p.parse_args()
    if (args.target is None) != (args.drafter is None):
        p.error("give both --target and --drafter, or neither")
    if not (args.vlm or args.dspark or args.dflash):
        p.error("give --vlm, --dspark, --dflash or several")
    sys.path[:0] = [d for d in (args.vlm, args.dspark) if d]
    from mlx_mtp.loading import load_model
    from mlx_mtp.testing.dspark import (
        gemma4_dflash_config,
        write_dflash,
        write_dflash2,
        write_dspark,
        write_gemma4_dflash,
        write_gemma4_dspark,
        write_qwen3_target,
    )
    from mlx_mtp.testing.gemma4 import write_gemma4

    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        peers = []  # (name, the layout it reads, its drafter, its slot logits)
        if args.vlm:
            peers.append(("mlx-vlm", "nested", vlm_drafter, theirs))
        if args.dspark:
            peers.append(("mlx-dspark", "deepspec", dspark_drafter, theirs_dspark))
        if args.dflash:
            peers.append(("mlx-vlm DFlash2", "dflash2", vlm_dflash, theirs_dflash))
            peers.append(("mlx-vlm DFlash", "dflash", vlm_dflash, theirs_dflash))
            if args.drafter is None:
                peers.append(
                    ("mlx-vlm Gemma 4 DFlash", "gemma4", vlm_dflash, theirs_dflash)
                )
                peers.append(
                    (
                        "mlx-vlm Gemma 4 DFlash2",
                        "gemma4-dflash2",
                        vlm_dflash,
                        theirs_dflash,
                    )
                )
        if args.vlm and args.drafter is None:
            peers.append(
                ("mlx-vlm Gemma 4", "gemma4-dspark", vlm_gemma4_dspark, theirs)
            )
        qwen3 = args.target
        if qwen3 is None:
            qwen3 = write_qwen3_target(Path(tmp) / "target", predictable=True)
        for name, layout, load_peer, slots in peers:
            drafter, target = args.drafter, qwen3
            if layout.startswith("gemma4"):
                target = write_gemma4(Path(tmp) / "gemma4-target", "dense")
            if layout == "gemma4":
                drafter = write_gemma4_dflash(Path(tmp) / layout, target)
            elif layout == "gemma4-dflash2":
                drafter = write_dflash2(
                    Path(tmp) / layout,
                    target,
                    config=gemma4_dflash_config(target),
                    mask_token_id=4,
                )
            elif layout == "gemma4-dspark":
                drafter = write_gemma4_dspark(Path(tmp) / layout, target)
            elif drafter is None and layout == "dflash2":
                drafter = write_dflash2(Path(tmp) / layout, target, predictable=True)
            elif drafter is None and layout == "dflash":
                drafter = write_dflash(
                    Path(tmp) / layout, target, final_logit_softcapping=3.0
                )
            elif drafter is None:
                drafter = write_dspark(
                    Path(tmp) / layout, target, layout=layout, predictable=True
                )
            model = load_model(str(target), draft_model=str(drafter))[0]
            tokens, taps = continuation(model, list(range(10, 30)), args.tokens)
            peer = load_peer(drafter, model.trunk)
            gamma = model.drafter.block_size
            dflash = layout in ("dflash2", "dflash", "gemma4", "gemma4-dflash2")
            check = compare_dflash if dflash else compare
            worst, agree, rows = check(
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
