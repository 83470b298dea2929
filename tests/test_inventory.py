"""``mlx-mtp models``: the models in mlx-mtp's folder, the Hugging Face cache and
named folders, with their type, size, quantization, what each drafts with and
whether it fits the memory bound; folders that are not models are skipped, and
nothing is loaded."""

import json

from mlx_mtp import inventory, memory
from mlx_mtp.convert import convert
from mlx_mtp.testing.dspark import write_dspark, write_qwen3_target

from .test_errors import run_cli


def test_a_folder_of_models_is_described(checkpoint, tmp_path, monkeypatch):
    source = checkpoint("deepseek_v3")
    models = tmp_path / "models"
    convert(str(source), models / "ds-4bit", quantize=True, progress=False)
    target = write_qwen3_target(tmp_path / "qwen3")
    write_dspark(models / "drafter", target)
    (models / "notes").mkdir()
    (models / "notes" / "config.json").write_text("not json")
    (models / "empty").mkdir()
    (models / "empty" / "config.json").write_text('{"model_type": "llama"}')
    monkeypatch.setenv("MLX_MTP_HOME", str(tmp_path / "home"))
    entries = {e.name: e for e in inventory.scan([models, source], hub=False)}
    assert set(entries) == {
        str(models / "ds-4bit"),
        str(models / "drafter"),
        str(source),
    }
    converted = entries[str(models / "ds-4bit")]
    assert converted.model_type == "deepseek_v3"
    assert converted.quantization == "4-bit affine"
    assert converted.drafts == "MTP heads (1 layer, 8-bit)"
    assert converted.size == memory.weights_bytes([models / "ds-4bit"]) > 0
    original = entries[str(source)]
    assert original.drafts == "1 MTP layer in the checkpoint"
    assert original.quantization == "float32" and original.fits
    assert entries[str(models / "drafter")].drafts.startswith("is a DSpark drafter")

    monkeypatch.setenv(memory.LIMIT_ENV, str(converted.size))
    fits = {e.name: e.fits for e in inventory.scan([models, source], hub=False)}
    assert fits[str(models / "ds-4bit")] and not fits[str(source)]


def test_a_gemma4_target_names_its_assistant(tmp_path):
    from mlx_mtp.testing.gemma4 import write_gemma4, write_gemma4_assistant

    target = write_gemma4(tmp_path / "target")
    write_gemma4_assistant(tmp_path / "assistant", target)
    entries = {e.name: e.drafts for e in inventory.scan([tmp_path], hub=False)}
    assert entries[str(target)] == "none (its Gemma 4 assistant drafts: --draft-model)"
    assert entries[str(tmp_path / "assistant")].startswith("is a Gemma 4 assistant")


def test_the_hub_cache_and_the_command(checkpoint, tmp_path, monkeypatch):
    source = checkpoint("qwen3_5")
    monkeypatch.setattr(
        inventory, "_hub_snapshots", lambda: iter([("Qwen/Qwen3.6-27B", source)])
    )
    monkeypatch.setenv("MLX_MTP_HOME", str(tmp_path / "home"))
    listed = tmp_path / "models.json"
    result = run_cli("models", "-o", str(listed))
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(listed.read_text())
    assert entry["name"] == "Qwen/Qwen3.6-27B" and entry["model_type"] == "qwen3_5"
    assert entry["drafts"] == "1 MTP layer in the checkpoint"
    result = run_cli("models", "--no-hub")
    assert result.exit_code == 0 and result.output.startswith("no models found")
    assert "MLX can use" in result.output
    result = run_cli("models")
    lines = result.output.splitlines()
    assert lines[0].split() == [
        "model",
        "type",
        "size",
        "quantization",
        "drafts",
        "with",
        "fits",
    ]
    assert lines[1].startswith("Qwen/Qwen3.6-27B") and lines[1].endswith("yes")
