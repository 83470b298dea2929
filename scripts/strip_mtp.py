"""Copy an MLX model folder without its MTP tensors, for runtimes whose loader keeps
them and then refuses them (mlx-lm's llama layout: the MTP layers sit at
``model.layers.{N}`` past ``num_hidden_layers``), so that benchmarks can give both
runtimes the same trunk.

    python scripts/strip_mtp.py SRC DST

An mlx-mtp conversion's heads file (``mtp.safetensors``, its config's ``mtp``
section) is left out too. The other files of SRC are copied as they are; DST must
not exist.
"""

import json
import re
import shutil
import sys
from pathlib import Path


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.split("\n\n")[1].strip())
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    if dst.exists():
        raise SystemExit(f"{dst} exists")
    import mlx.core as mx

    from mlx_mtp.heads import HEADS_FILE

    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]

    def is_mtp(name: str) -> bool:
        m = re.match(r"model\.layers\.(\d+)\.", name)
        return name.startswith("mtp.") or (m is not None and int(m[1]) >= layers)

    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == HEADS_FILE:
            continue
        if f.name == "config.json":
            config = json.loads(f.read_text())
            config.pop("mtp", None)
            (tmp / f.name).write_text(json.dumps(config, indent=2))
        elif f.suffix == ".safetensors":
            weights = mx.load(str(f))
            kept = {k: v for k, v in weights.items() if not is_mtp(k)}
            mx.save_safetensors(str(tmp / f.name), kept, metadata={"format": "mlx"})
        elif f.is_file() and f.name != "model.safetensors.index.json":
            shutil.copy2(f, tmp / f.name)
    tmp.rename(dst)
    print(f"{dst}: the trunk of {src}, without MTP tensors")


if __name__ == "__main__":
    main()
