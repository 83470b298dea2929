"""Writing an output folder safely: everything goes to a temporary folder next to the
destination, which is renamed into place only when complete."""

import contextlib
import json
import os
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from mlx_mtp.errors import MTPError


@contextlib.contextmanager
def staged_folder(dst: Path, overwrite: bool = False):
    """Yield a fresh temporary folder; on success it becomes ``dst``.

    An existing ``dst`` is refused unless ``overwrite``; it is replaced only after the new
    folder is complete. On any error or interruption the temporary folder is removed
    and ``dst`` is untouched (a hard kill can leave only the temporary folder, whose
    name starts with ``.`` and ends with ``.partial``).
    """
    dst = Path(dst)
    if dst.exists() and not overwrite:
        raise MTPError(f"{dst} already exists (use --overwrite to replace it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.{os.getpid()}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if dst.exists():
            old = dst.parent / f".{dst.name}.{os.getpid()}.old"
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replace_file(path: Path, write) -> None:
    """Write ``path`` atomically: ``write(tmp_path)`` then rename over ``path``."""
    tmp = path.parent / f".{path.name}.{os.getpid()}.partial{path.suffix}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_trunk(
    folder: Path, model: nn.Module, shard_gb: float = 5.0, progress=True
) -> dict:
    """Write the trunk as mlx-lm does (``model[-i-of-n].safetensors`` + index), evaluating
    one shard at a time and releasing the model's arrays as they are written.

    Returns the index's weight map.
    """
    from mlx_lm.utils import get_total_parameters
    from tqdm import tqdm

    weights = dict(tree_flatten(model.parameters()))
    total_parameters = get_total_parameters(model)
    limit = int(shard_gb * (1 << 30))
    shards, size = [], 0
    for k, v in weights.items():
        if not shards or size + v.nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += v.nbytes
    total = sum(v.nbytes for v in weights.values())
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    weights.clear()
    n = len(shards)
    name = "model-{:05d}-of-{:05d}.safetensors" if n > 1 else "model.safetensors"
    weight_map = {}
    bar = tqdm(total=n, unit="shard", desc="writing", disable=not progress)
    for i in range(n):
        shard, shards[i] = shards[i], None
        file = name.format(i + 1, n)
        mx.save_safetensors(str(folder / file), shard, metadata={"format": "mlx"})
        weight_map.update({k: file for k in shard})
        del shard
        mx.clear_cache()
        bar.update()
    bar.close()
    index = {
        "metadata": {"total_size": total, "total_parameters": total_parameters},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    return weight_map
