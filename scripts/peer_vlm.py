"""What the peer scripts of the families with mlx-vlm trunks share
(`peer_glm5_next.py`, `peer_qwen4_exp.py`, `peer_hy_v4.py`): mlx-mtp's teacher-forced
logits, a text-only copy of a fixture for mlx-vlm, the row-by-row comparison, and
the run over the fixtures with its verdict. Not a script of its own."""

import tempfile
from pathlib import Path
from typing import Callable, Iterable, Sequence, Tuple

import mlx.core as mx
import numpy as np

ATOL = 1e-4
# (name, dtype, predictable): random and predictable float32, which must agree; a
# bfloat16 one reported beside them (MLX's CPU ``gather_mm``, both runtimes' routed
# experts, takes float32 only: on a CPU it prints the error and is not compared).
FIXTURES = (
    ("random", "float32", False),
    ("predictable", "float32", True),
    ("random-bf16", "bfloat16", False),
)


def f32(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


def teacher_forced(path: Path, seq: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """mlx-mtp's ``(trunk (n, V), mtp (n - 1, V))`` logits over ``seq``, the MTP
    layer fed the trunk's hidden states and the next tokens."""
    from mlx_mtp import load

    model = load(str(path))[0]
    ids = mx.array(seq)[None]
    h = model.hidden(ids)
    z = model.mtp_forward(0, h[:, :-1], ids[:, 1:])
    return f32(model.logits(h)[0]), f32(model.logits(z)[0])


def text_only(path: Path) -> Path:
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


def compare(name: str, mine, peer, parts: Iterable[str] = ("trunk", "MTP")) -> bool:
    """Print each part's largest difference and argmax agreement; whether every row
    agrees within `ATOL` with the same argmax."""
    ok = True
    for part, a, b in zip(parts, mine, peer):
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


def run_fixtures(
    family: str, check: Callable[[Path, str], bool], fixtures=FIXTURES, **options
) -> int:
    """``check(path, title) -> agree`` on each fixture of ``family`` (``options`` to
    its builder); the exit status: 0 when every float32 fixture agrees."""
    from mlx_mtp.testing.fixtures import write_checkpoint

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for name, dtype, predictable in fixtures:
            path = Path(tmp) / name
            write_checkpoint(
                family, path, predictable=predictable, dtype=dtype, **options
            )
            try:
                agree = check(path, f"{family} fixture {name} ({dtype})")
            except RuntimeError as e:
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
