"""GLM-5.3-Flash (glm5_next) against mlx-vlm's own runtime: teacher-forced trunk and
MTP logits of mlx-mtp and of mlx-vlm 0.7.10's ``glm5_next`` model with its
``glm5_next_mtp`` drafter, on tiny fixtures, random and predictable (float32), and a
bfloat16 one reported beside them.

    python scripts/peer_glm5_next.py

mlx-vlm loads the checkpoint with its ``load_model`` (the vision-language model; its
``language_model`` returns the hidden states after the streams' mean and
``model.norm`` with ``return_hidden=True``) and the drafter with its
``Glm5NextMTPSplitter().load`` (the in-memory split; ``load`` is the base
``MTPSplitter``'s, and the block size it sets, ``num_nextn_predict_layers + 1``, does
not enter a teacher-forced pass). The drafter is bound to the target and given a
fresh cache by its ``reset``, as mlx-vlm's decoding loop does, then runs its
``_forward_tokens`` once over the trunk's hidden states ``h[:, :-1]`` with the tokens
``seq[:, 1:]`` from position 0 (as ``prefill_from_target_hidden`` does, less the
bonus token), and its output is projected with the target's head
(``_lm_head_fn``). mlx-mtp runs ``hidden``, ``mtp_forward`` and ``logits``.

The sequence (24 tokens) runs past the indexer's 8 selected keys, so its pools of 4
are chosen among (selecting every key instead changes the random fixture's trunk
logits from row 11 on and its MTP logits from row 11 on). mlx-mtp's MTP layer runs
without a cache (the indexer's cacheless path), mlx-vlm's drafter with its fresh
one; they agree exactly (difference 0 on both float32 fixtures). Per fixture,
trunk logits (n, V) and MTP logits (n - 1, V), both printed: the float32 fixtures
must agree within 1e-4 with the argmax equal on every row, else the script exits 1;
the bfloat16 fixture is printed for what it shows and counts only if it agrees as
closely. MLX's CPU backend cannot run it: its ``gather_mm`` (both runtimes' routed
experts, mlx- lm's ``SwitchGLU``) takes float32 only, so on a CPU the bfloat16
fixture prints the error and is not compared. mlx-vlm is given a copy of each
checkpoint without the fixture's two-tensor sample of the vision tower
(``model.visual.*``): with it, its strict load refuses the tower's other parameters
as missing; without, it drops the tower (a warning) and loads the text model
strictly. Needs the extra ``mlx-mtp[vlm]``; no network.
"""

import sys
from pathlib import Path

import mlx.core as mx
from peer_vlm import compare, f32, run_fixtures, teacher_forced, text_only

SEQ = [5, 77, 301, 12, 9, 140, 88, 2, 250, 31, 64, 411]
SEQ += [17, 99, 203, 46, 380, 7, 128, 356, 61, 490, 23, 174]


def theirs(path: Path):
    """mlx-vlm's, its drafter bound and reset as its decoding loop does."""
    from mlx_vlm.speculative.drafters.glm5_next_mtp.split import Glm5NextMTPSplitter
    from mlx_vlm.utils import load_model

    target = load_model(path)
    drafter = Glm5NextMTPSplitter().load(path)
    drafter.reset(target)  # bind (embedding, head) and a fresh cache
    seq = mx.array(SEQ)[None]
    out = target.language_model(seq, return_hidden=True)
    h = out.hidden_states[-1]
    z, _ = drafter._forward_tokens(seq[:, 1:], h[:, :-1], mx.int32)
    return f32(out.logits[0]), f32(drafter._lm_head_fn(z)[0])


def check(path: Path, title: str) -> bool:
    print(f"{title}, {len(SEQ)} tokens")
    return compare("mlx-vlm", teacher_forced(path, SEQ), theirs(text_only(path)))


if __name__ == "__main__":
    sys.exit(run_fixtures("glm5_next", check))
