"""Hy4 (hy_v4) against mlx-vlm's own runtime: teacher-forced trunk and MTP logits of
mlx-mtp and of mlx-vlm 0.7.10's ``hy_v4`` model with its ``hy_v4_mtp`` drafter, on
tiny fixtures in the release's form (ModelOpt MXFP8; mlx-vlm's sanitize cannot read
a float ``kv_b_proj``), random and predictable.

    python scripts/peer_hy_v4.py

mlx-vlm loads the checkpoint with its ``load_model`` and the drafter with its
``HyV4MTPSplitter().load`` (the in-memory split), and runs the drafter's
``_forward_hidden`` over the trunk's hidden states, as its decoding loop does. Two
comparisons per fixture, both printed:

- mlx-vlm as shipped, which differs from the release's references (vLLM, SGLang,
  transformers; `mlx_mtp.models.hy_v4`) in four places: its ``HyV4Indexer`` selects
  in a function compiled ``shapeless``, which fixes ``argpartition``'s ``kth`` to the
  key count of its first call; it rotates the first ``qk_rope_head_dim`` dimensions
  of each index head, where the release keeps them last; its routed experts do not
  clamp at ``swiglu_limit``; its MTP layer does not zero position 0's embedding. Its
  logits then differ on the rows these touch;
- mlx-vlm with those four changed as mlx-mtp makes them (its indexers selecting as
  their DeepSeek-V3.2 parent does, their heads' rows permuted as SGLang permutes
  them, its experts clamped, position 0 zeroed): logits within 1e-4 and argmax equal
  on every row, trunk and MTP layer. The script exits 1 otherwise.

Needs the extra ``mlx-mtp[vlm]``; no network.
"""

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from peer_vlm import compare, run_fixtures, teacher_forced

SEQ = [5, 77, 301, 12, 9, 140, 88, 2, 250, 31, 64, 411, 17, 99]
FIXTURES = (("random", "float32", False), ("predictable", "float32", True))


def theirs(path: Path, fixed: bool):
    """mlx-vlm's, with mlx-mtp's four changes when ``fixed``."""
    import json

    from mlx_vlm.speculative.drafters.hy_v4_mtp.split import HyV4MTPSplitter
    from mlx_vlm.utils import load_model

    target = load_model(path)
    drafter = HyV4MTPSplitter().load(path)
    lm = target.language_model
    seq = mx.array(SEQ)[None]
    e = lm.model.embed_tokens(seq[:, 1:])
    if fixed:
        limit = json.loads((path / "config.json").read_text())["swiglu_limit"]
        for layer in [*lm.layers, drafter.decoder]:
            _fix(layer, lm.args, limit)
        e = mx.where(mx.arange(e.shape[1])[None, :, None] > 0, e, 0)
    out = lm(seq, return_hidden=True)
    h = out.hidden_states[0]
    z = drafter._forward_hidden(e, h[:, :-1], None, None)
    return np.array(out.logits[0]), np.array(lm.lm_head(z)[0])


def _fix(layer, args, limit: float) -> None:
    """An mlx-vlm Hy4 layer as mlx-mtp runs it: exact top-k, index heads' rows
    ``[nope | rope]`` -> ``[rope | nope]``, routed experts clamped."""
    from mlx_mtp.models import hy_v4

    indexer = layer.self_attn.indexer
    if indexer is not None:
        indexer.__class__ = hy_v4._indexer()
        for name, module in (("wq_b", indexer.wq_b), ("wk", indexer.wk)):
            for part in ("weight", "scales"):
                if part in module:
                    permuted = hy_v4._rope_first(module[part], f".{name}.", args)
                    setattr(module, part, permuted)
        for part in ("weight", "bias"):
            norm = indexer.k_norm
            setattr(norm, part, hy_v4._rope_first(norm[part], ".k_norm.", args))
    if hasattr(layer.mlp, "switch_mlp"):
        layer.mlp.switch_mlp.activation = hy_v4.ClampedSwiGLU(limit)


def check(path: Path, title: str) -> bool:
    print(f"{title}, MXFP8 release form")
    mine = teacher_forced(path, SEQ)
    compare("mlx-vlm as shipped", mine, theirs(path, fixed=False))
    return compare("mlx-vlm, changed", mine, theirs(path, fixed=True))


if __name__ == "__main__":
    sys.exit(run_fixtures("hy_v4", check, FIXTURES, release="mxfp8"))
