"""One set of decode options: `DecodeOptions` holds every default, the CLI's flags and
the Python API read them from it, and a bad value is refused naming its option."""

import dataclasses
import inspect

import pytest

from mlx_mtp.draft_length import AdaptiveLength, DraftPolicy, FixedLength, RoundCosts
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import stream_generate
from mlx_mtp.options import DecodeOptions
from mlx_mtp.speculative import mtp_generate_step
from mlx_mtp.stats import MTPStats
from mlx_mtp.testing import HEADS

# CLI flags of generate and chat whose parameter is an option of the same name
CLI_COMMANDS = ("generate", "chat")


def test_options_are_frozen_and_unknown_names_refused():
    options = DecodeOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.temp = 1.0
    assert options.replace(temp=0.5).temp == 0.5 and options.temp == 0.0
    with pytest.raises(MTPError, match="unknown decode option.*tmp"):
        DecodeOptions.build(tmp=0.5)


@pytest.mark.parametrize(
    "change,name",
    [
        (dict(num_draft_tokens=17), "num_draft_tokens"),
        (dict(num_draft_tokens="many"), "num_draft_tokens"),
        (dict(max_draft_tokens=-1), "max_draft_tokens"),
        (dict(draft_source="context"), "draft_source"),
        (dict(lookup_tokens=0), "lookup_tokens"),
        (dict(draft_vocab="some"), "draft_vocab"),
        (dict(draft_vocab=True), "draft_vocab"),
        (dict(temp=-1.0), "temp"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(prefill_step_size=0), "prefill_step_size"),
        (dict(kv_bits=4, max_kv_size=64), "rotating KV window"),
        (dict(kv_group_size=0), "kv_group_size"),
    ],
)
def test_a_bad_value_is_refused_naming_its_option(change, name):
    with pytest.raises(MTPError, match=name):
        DecodeOptions.build(**change)


def test_the_api_spells_no_default_of_its_own():
    """stream_generate and mtp_generate_step take the options object (and option
    names as keywords); none of them has a default of its own to disagree."""
    names = set(DecodeOptions.names())
    for fn in (stream_generate, mtp_generate_step):
        params = inspect.signature(fn).parameters
        spelled = names & set(params) - {"max_tokens"}
        assert not spelled, f"{fn.__name__} spells {sorted(spelled)}"
    assert inspect.signature(stream_generate).parameters["max_tokens"].default is None


@pytest.mark.parametrize("command", CLI_COMMANDS)
def test_cli_defaults_are_the_options_defaults(command):
    from mlx_mtp.cli import main

    defaults = DecodeOptions()
    params = {p.name: p for p in main.commands[command].params}
    shared = [n for n in DecodeOptions.names() if n in params]
    assert len(shared) >= 12, shared
    for name in shared:
        default = params[name].default
        if name == "max_tokens" and command == "chat":
            continue  # a chat reply's own limit
        if name == "kv_bits":
            assert default is None
            continue
        if name == "logit_bias":  # ID=BIAS flags, none by default
            assert params[name].multiple
            continue
        assert default == getattr(defaults, name), name


def test_cli_checks_the_options_before_loading_the_model(tmp_path):
    """A combination refused by the options is one line before any model is read."""
    from click.testing import CliRunner

    from mlx_mtp.cli import main

    missing = tmp_path / "nothing-here"
    args = ["generate", "--model", str(missing), "-p", "hi"]
    result = CliRunner().invoke(main, [*args, "--kv-bits", "4", "--max-kv-size", "64"])
    assert result.exit_code == 1
    assert "rotating KV window" in result.output
    assert "nothing-here" not in result.output


class Recorder(DraftPolicy):
    """A scripted policy: k each round, every observation recorded."""

    def __init__(self, k):
        self.max_k, self.calls = k, []

    def next(self):
        return self.max_k

    def observe(self, k, accepted, missed=False):
        self.calls.append((k, accepted, missed))


def test_every_policy_takes_the_same_observation():
    costs = RoundCosts([1.0, 1.1, 1.2], 0.1)
    for policy in (FixedLength(2), AdaptiveLength(costs, [0, 1, 2]), Recorder(2)):
        assert isinstance(policy, DraftPolicy)
        policy.observe(2, 1, missed=True)
        assert policy.next() in (0, 1, 2)


def test_a_scripted_policy_drives_the_loop(loaded):
    model, tokenizer = loaded("deepseek_v3", predictable=True)
    policy = Recorder(2)
    steps = mtp_generate_step(
        tokenizer.encode("def f(x):"), model, HEADS, policy=policy, max_tokens=12
    )
    tokens = [o.token for o in steps]
    assert len(tokens) == 12
    assert policy.calls[0][0] == 2 and all(k <= 2 for k, _, _ in policy.calls)
    with pytest.raises(TypeError, match="DraftPolicy"):
        mtp_generate_step([1, 2], model, policy=object())


def test_statistics_keep_the_counts_they_are_given():
    stats = MTPStats(2, drafted_per_position=[3, 1], accepted_per_position=[2, 0])
    assert stats.drafted_per_position == [3, 1]
    assert stats.accepted_per_position == [2, 0]
    assert stats.accepted_histogram == [0, 0, 0] and stats.rounds_by_k == [0, 0, 0]
    copy = stats.snapshot()
    stats.record(2, 1)
    assert copy.drafted_per_position == [3, 1] and copy.rounds == 0
    assert stats.drafted_per_position == [4, 2]


def test_the_cli_reads_the_defaults_without_loading_mlx():
    """The CLI reads the defaults from mlx_mtp.options, which loads nothing heavy."""
    import subprocess
    import sys

    code = (
        "import sys; import mlx_mtp.options, mlx_mtp.cli; "
        "print('mlx.core' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
