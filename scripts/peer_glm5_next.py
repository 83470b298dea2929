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
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

SEQ = [5, 77, 301, 12, 9, 140, 88, 2, 250, 31, 64, 411]
SEQ += [17, 99, 203, 46, 380, 7, 128, 356, 61, 490, 23, 174]
ATOL = 1e-4


def ours(path: Path):
    """mlx-mtp's ``(trunk (n, V), mtp (n - 1, V))`` teacher-forced logits."""
    from mlx_mtp import load

    model = load(str(path))[0]
    seq = mx.array(SEQ)[None]
    h = model.hidden(seq)
    z = model.mtp_forward(0, h[:, :-1], seq[:, 1:])
    return _f32(model.logits(h)[0]), _f32(model.logits(z)[0])


def theirs(path: Path):
    """mlx-vlm's, its drafter bound and reset as its decoding loop does."""
    from mlx_vlm.speculative.drafters.glm5_next_mtp.split import Glm5NextMTPSplitter
    from mlx_vlm.utils import load_model

    path = _text_only(path)
    target = load_model(path)
    drafter = Glm5NextMTPSplitter().load(path)
    drafter.reset(target)  # bind (embedding, head) and a fresh cache
    seq = mx.array(SEQ)[None]
    out = target.language_model(seq, return_hidden=True)
    h = out.hidden_states[-1]
    z, _ = drafter._forward_tokens(seq[:, 1:], h[:, :-1], mx.int32)
    return _f32(out.logits[0]), _f32(drafter._lm_head_fn(z)[0])


def _text_only(path: Path) -> Path:
    """A copy of the checkpoint without its vision tensors (``model.visual.*``),
    beside it: the fixture keeps a two-tensor sample of the tower, which mlx-vlm's
    strict load refuses (the tower's other parameters missing); with none, it drops
    the tower and loads the text model strictly."""
    out = path.with_name(path.name + "-text")
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text((path / "config.json").read_text())
    weights = mx.load(str(path / "model.safetensors"))
    text = {k: v for k, v in weights.items() if not k.startswith("model.visual.")}
    mx.save_safetensors(str(out / "model.safetensors"), text, {"format": "pt"})
    return out


def _f32(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


def compare(name: str, mine, peer) -> bool:
    ok = True
    for part, a, b in zip(("trunk", "MTP"), mine, peer):
        diff = np.abs(a - b).max(axis=-1)
        same = a.argmax(-1) == b.argmax(-1)
        bad = [i for i in range(len(diff)) if diff[i] > ATOL or not same[i]]
        print(
            f"  {name:<24} {part:<5} {a.shape}: max |diff| {diff.max():.2e}, argmax "
            f"equal on {same.sum()}/{len(same)} rows"
            + (f"; rows off: {bad}" if bad else "")
        )
        ok = ok and not bad
    return ok


def main() -> int:
    from mlx_mtp.testing.fixtures import write_checkpoint

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, dtype, predictable in (
            ("random", "float32", False),
            ("predictable", "float32", True),
            ("random-bf16", "bfloat16", False),
        ):
            path = Path(tmp) / name
            write_checkpoint("glm5_next", path, predictable=predictable, dtype=dtype)
            print(f"glm5_next fixture {name} ({dtype}), {len(SEQ)} tokens")
            try:
                agree = compare("mlx-vlm", ours(path), theirs(path))
            except RuntimeError as e:  # see the module docstring
                if dtype == "float32":
                    raise
                print(f"  not run on {mx.default_device()}: {e}")
                continue
            if dtype == "float32":
                ok = agree and ok
            elif not agree:
                print("  (bfloat16: reported only)")
    print("agree" if ok else "DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
