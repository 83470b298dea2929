"""The benchmark runs end to end (no timing is asserted), and the synthetic-model
builder lands near the acceptance it is asked for."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mlx_mtp.cli import main
from mlx_mtp.loading import load_model
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.testing import HEADS

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_bench_cli(checkpoint, tmp_path):
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "--model",
        str(checkpoint("mimo", predictable=True)),
        "--tokens",
        "16",
        "--reps",
        "1",
        "-k",
        "0",
        "-k",
        "2",
        "--temp",
        "0",
        "--workload",
        "code",
        "--workload",
        "adversarial",
        "--output",
        str(out),
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["k"]) for r in rows] == [
        ("code", None),
        ("code", 0),
        ("code", 2),
        ("adversarial", None),
        ("adversarial", 0),
        ("adversarial", 2),
    ]
    k2 = rows[2]
    assert len(k2["acceptance"]) == 2 and k2["ideal"] > 0 and k2["efficiency"] > 0
    assert "mtp k=2" in result.output


def test_bench_with_sources_and_draft_vocabularies(checkpoint, tmp_path):
    """Runs per draft source and draft vocabulary; the draft step is timed for each
    vocabulary size, and each run's ideal uses its own."""
    out = tmp_path / "bench.json"
    path = str(checkpoint("deepseek_v3", predictable=True))
    args = ["bench", "--model", path, "--tokens", "16", "--reps", "1", "-k", "2"]
    args += ["--temp", "0", "--workload", "code-edit", "--output", str(out)]
    args += ["--draft-source", "heads", "--draft-source", "lookup"]
    args += ["--draft-vocab", "full", "--draft-vocab", "64"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    runs = [(r["k"], r["source"], r["vocab"]) for r in data["rows"]]
    assert runs == [
        (None, "heads", None),
        (2, "heads", "full"),
        (2, "heads", 64),
        (2, "lookup", "full"),
        (2, "lookup", 64),
    ]
    assert data["costs"]["draft_64"] > 0 and data["costs"]["draft"] > 0
    heads_64 = data["rows"][2]
    assert set(heads_64["drafted_by_vocab"]) == {"64"}
    assert set(heads_64["drafted_by_source"]) == {"heads"}
    assert "dv=64" in result.output


@pytest.mark.slow  # 20 s: builds and measures two synthetic models
@pytest.mark.parametrize("draft_vocab", [0, 256])
def test_synthetic_model_lands_near_its_acceptance(tmp_path, draft_vocab):
    out = tmp_path / "syn"
    args = [
        "--draft-vocab-size",
        str(draft_vocab),
        "--acceptance",
        "0.6",
        "--params",
        "1e6",
        "--vocab",
        "1024",
        "--hidden",
        "128",
    ]
    subprocess.run(
        [sys.executable, str(SCRIPTS / "make_synthetic_model.py"), str(out), *args],
        check=True,
        env={**os.environ, "MLX_MTP_FAST_BLAS": "0"},  # a tiny model needs no OpenBLAS
        capture_output=True,
    )
    info = json.loads((out / "synthetic.json").read_text())
    assert abs(info["measured_agreement"] - 0.6) < 0.05
    model = load_model(str(out))[0]
    rng = np.random.default_rng(7)
    accepted = []
    for _ in range(3):
        prompt = rng.integers(0, 1024, 16).tolist()
        outs = list(
            mtp_generate_step(prompt, model, HEADS, num_draft_tokens=1, max_tokens=96)
        )
        accepted.append(outs[-1].stats.acceptance_rate)
        plain = mtp_generate_step(
            prompt, model, HEADS, num_draft_tokens=0, max_tokens=96
        )
        assert [o.token for o in outs] == [o.token for o in plain]
    assert abs(np.mean(accepted) - 0.6) < 0.12
    assert model.num_mtp_layers == 1
    if draft_vocab:
        assert model.mtp.draft_vocab.shape == (draft_vocab,)
        emitted = {o.token for o in outs[1:]}  # after the first, from the cycle
        assert emitted <= set(np.array(model.mtp.draft_vocab).tolist())


def test_stats_of_several_runs_add_up():
    """The benchmark reports acceptance over all its timed runs: MTPStats add."""
    from mlx_mtp.stats import MTPStats

    rounds_a = [(3, 2, "heads", None), (3, 0, "heads", 512), (8, 5, "lookup", None)]
    rounds_b = [(2, 2, "heads", None), (0, 0, "heads", None)]
    a, b, both = MTPStats(3, 8), MTPStats(2, 2), MTPStats(3, 8)
    for stats, rounds in ((a, rounds_a), (b, rounds_b), (both, rounds_a + rounds_b)):
        for k, n, source, vocab in rounds:
            stats.record(k, n, source, vocab)
    total = a + b
    for name in ("rounds", "drafted", "accepted", "emitted", "rounds_by_k"):
        assert getattr(total, name) == getattr(both, name), name
    assert total.drafted_per_position == both.drafted_per_position
    assert total.accepted_per_position == both.accepted_per_position
    assert total.drafted_by_source == {"heads": 8, "lookup": 8}
    assert total.accepted_by_source == both.accepted_by_source
    assert total.drafted_by_vocab == {"full": 5, "512": 3}
    assert total.tokens_per_round == both.tokens_per_round
