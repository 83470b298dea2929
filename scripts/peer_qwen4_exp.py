"""Qwen3.8-Flash-Next (qwen4_exp) against mlx-vlm's own runtime: teacher-forced trunk
and MTP logits of mlx-mtp and of mlx-vlm 0.7.10's ``qwen4_exp`` model with its
``qwen4_exp_mtp`` drafter, on tiny fixtures, random and predictable (float32), and a
bfloat16 one reported beside them; then the trunk decoding with caches in both.

    python scripts/peer_qwen4_exp.py

mlx-vlm loads the checkpoint with its ``load_model`` (the vision-language model; its
``language_model`` with ``return_hidden=True`` returns in ``hidden_states[0]`` the
hyper-connection streams before the final mixer, which its MTP reads) and the
drafter with its ``Qwen4ExpMTPSplitter().load`` (the in-memory split; the block size
it sets does not enter a teacher-forced pass). The drafter is bound to the target
and given a fresh cache by its ``reset``, as mlx-vlm's decoding loop does, then runs
its ``_forward_tokens`` once over the trunk's streams ``h[:, :-1]`` with the tokens
``seq[:, 1:]`` from position 0 (as ``prefill_from_target_hidden`` does, less the
bonus token); it returns its mixer's output first, which its ``draft_block``
projects with the target's head (``_lm_head_fn``, the target's ``lm_head``), as
here. mlx-mtp runs ``hidden`` (packed: the streams, then their mixed collapse),
``mtp_forward`` and ``logits``.

Two comparisons per fixture, both printed:

- (a) forward: one pass over the whole sequence, no cache, in both (mlx-vlm's
  ordinary forward; mlx-mtp's ``hidden`` without a cache runs the same), trunk
  logits (n, V) and MTP logits (n - 1, V);
- (b) decode: both with fresh caches (mlx-vlm's ``make_cache``, mlx-mtp's
  ``make_caches``), a prefill of the first 12 tokens (the ordinary forward in both),
  then the rest one token at a time (mlx-vlm's ``__call__`` routes a one-token pass
  with a cache through its batch-invariant forward, and mlx-mtp's ``hidden`` does
  too), trunk logits (n, V).

mlx-vlm's ``LanguageModel`` keeps position-id state across calls (``_position_ids``,
``_rope_deltas``: a pass at cache offset 0 reuses the ids a longer earlier pass
stored), so each comparison loads its own target. The sequence (24 tokens, ids below
the fixture's 512) runs past the QSA indexer's budget (pools of 4 keys, 2 selected:
it drops pools from the twelfth key on, where the decode's one-token steps begin)
and holds one EOS (509) mid-sequence, where the PLE's n-gram history restarts; it
avoids the config's vision marker ids (505 to 508). mlx-mtp's MTP layer runs
without a cache (the indexer's cacheless path), mlx-vlm's drafter with its fresh
one. On both float32 fixtures the trunk logits agree exactly (difference 0, in (a)
and (b)); the MTP logits differ by about 4e-7, rounding only: mlx-mtp's MTP layer
fuses the projections as one ``eh_proj`` over ``[embedding, stream]`` where the
drafter sums ``fc_embedding`` and ``fc_hidden`` (the same with the drafter run
without a cache, or mlx-mtp's layer fed mlx-vlm's streams). The float32 fixtures
must agree within 1e-4 with the argmax equal on every row, in every part, else the
script exits 1; the bfloat16 fixture is printed for what it shows and counts only if
it agrees as closely. MLX's CPU backend cannot run it: its
``gather_mm`` (both runtimes' routed experts) takes float32 only, so on a CPU the
bfloat16 fixture prints the error and is not compared. mlx-vlm is given a copy of
each checkpoint without the fixture's two-tensor sample of the vision tower
(``model.visual.*``): with it, its strict load refuses the tower's other parameters
as missing; without, it drops the tower (a warning) and loads the text model
strictly. Needs the extra ``mlx-mtp[vlm]``; no network.
"""

import sys
from pathlib import Path

import mlx.core as mx
from peer_vlm import compare, f32, run_fixtures, teacher_forced, text_only

SEQ = [5, 77, 301, 12, 9, 140, 88, 2, 250, 31, 64, 411]
SEQ += [17, 99, 509, 46, 380, 7, 128, 356, 61, 490, 23, 174]
PREFILL = 12


def theirs(path: Path):
    """mlx-vlm's, its drafter bound and reset as its decoding loop does."""
    from mlx_vlm.speculative.drafters.qwen4_exp_mtp.split import Qwen4ExpMTPSplitter
    from mlx_vlm.utils import load_model

    target = load_model(path)
    drafter = Qwen4ExpMTPSplitter().load(path)
    drafter.reset(target)  # bind (embedding, head) and a fresh cache
    seq = mx.array(SEQ)[None]
    out = target.language_model(seq, return_hidden=True)
    h = out.hidden_states[0]  # the streams before the final mixer
    z, _ = drafter._forward_tokens(seq[:, 1:], h[:, :-1], mx.int32)
    return f32(out.logits[0]), f32(drafter._lm_head_fn(z)[0])


def ours_decode(path: Path):
    """mlx-mtp's trunk logits ``(n, V)``: a prefill, then one token at a time."""
    from mlx_mtp import load
    from mlx_mtp.cache import make_caches

    model = load(str(path))[0]
    caches = make_caches(model)
    rows = []
    for ids in _steps():
        rows.append(model.logits(model.hidden(ids, caches.trunk))[0])
        mx.eval(rows[-1])
    return (f32(mx.concatenate(rows)),)


def theirs_decode(path: Path):
    """mlx-vlm's, the same way (a fresh target: see the module docstring)."""
    from mlx_vlm.utils import load_model

    lm = load_model(path).language_model
    cache = lm.make_cache()
    rows = []
    for ids in _steps():
        rows.append(lm(ids, cache=cache).logits[0])
        mx.eval(rows[-1])
    return (f32(mx.concatenate(rows)),)


def _steps():
    """The sequence as a decoding loop feeds it: the first `PREFILL` tokens, then
    one at a time."""
    seq = mx.array(SEQ)[None]
    yield seq[:, :PREFILL]
    for i in range(PREFILL, len(SEQ)):
        yield seq[:, i : i + 1]


def check(path: Path, title: str) -> bool:
    peer = text_only(path)
    print(f"{title}, {len(SEQ)} tokens (decode: prefill {PREFILL}, then 1 at a time)")
    forward = compare("(a) forward", teacher_forced(path, SEQ), theirs(peer))
    decode = compare("(b) decode", ours_decode(path), theirs_decode(peer), ["trunk"])
    return forward and decode


if __name__ == "__main__":
    sys.exit(run_fixtures("qwen4_exp", check))
