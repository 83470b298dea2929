"""The family interface: hooks derived visibly, misspelt hooks refused, and what a
Hugging Face layout means (embedding, final norm, head) asked of the family."""

import ast
import importlib
import json
import types
import typing
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_mtp import distributed
from mlx_mtp.errors import MTPError
from mlx_mtp.heads import source_fingerprint
from mlx_mtp.models import FAMILIES, get_family, module_of
from mlx_mtp.models.family import DeclaredByKeys, Family, define
from mlx_mtp.testing import fixtures

MODELS = Path(__file__).resolve().parents[1] / "mlx_mtp" / "models"


def _hooks(name: str) -> dict:
    """A family's hooks; the default layer count stands for "by MTP_CONFIG_KEYS"."""
    family = get_family({"model_type": name})
    hooks = {h: getattr(family, h) for h in Family.hooks()}
    if isinstance(hooks["declared_mtp_layers"], DeclaredByKeys):
        hooks["declared_mtp_layers"] = "by MTP_CONFIG_KEYS"
    return hooks


def test_a_misspelt_hook_is_an_error_naming_the_closest():
    mimo = {h: v for h, v in _hooks("mimo").items() if h in Family.required()}
    with pytest.raises(TypeError, match=r"fix_confg .*did you mean fix_config\?"):
        define(**mimo, fix_confg=lambda config: {})
    deepseek = get_family({"model_type": "deepseek_v3"})
    with pytest.raises(TypeError, match="did you mean MASK_AS_ARRAY"):
        deepseek.derive(MASK_AS_ARAY=False)
    with pytest.raises(TypeError, match="did you mean prepare"):
        deepseek.derive(defaults=("prepar",))
    with pytest.raises(TypeError, match="lacks make_layer"):
        define(**{h: v for h, v in mimo.items() if h != "make_layer"})


def _module(**names) -> types.ModuleType:
    module = types.ModuleType("mlx_mtp.models.example")
    module.FAMILY = get_family({"model_type": "mimo"})
    module.__dict__.update(names)
    return module


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("fix_confg", lambda config: {}, "did you mean fix_config"),
        ("MASK_FIRST", True, "not a family hook"),
        ("make_layer", lambda trunk, j, config: None, "not the FAMILY's make_layer"),
        ("LAYOUT", None, "not the FAMILY's LAYOUT"),
    ],
)
def test_a_module_name_that_looks_like_an_unused_hook_is_refused(name, value, message):
    """A hook written in the module but not given to FAMILY (misspelt, or forgotten)
    would silently fall back to the default or to another family's."""
    with pytest.raises(TypeError, match=message):
        Family.from_module(_module(**{name: value}))


def test_helpers_private_names_and_the_familys_own_hooks_pass():
    mimo = importlib.import_module("mlx_mtp.models.mimo")
    family = Family.from_module(
        _module(stack_experts=len, _fix_confg=len, re=ast, sanitize=mimo.sanitize)
    )
    assert family.name == "example"


def _reexported_hooks(path: Path) -> list:
    """Hook names a family module takes from another by import or by assignment
    (``LAYOUT = deepseek_v3.LAYOUT``): inheritance that no ``FAMILY`` shows."""
    hooks, found = set(Family.hooks()), []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            found += [a.name for a in node.names if a.name in hooks]
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Attribute):
            found += [t.id for t in node.targets if getattr(t, "id", None) in hooks]
    return found


def test_no_family_takes_hooks_but_through_its_family():
    modules = {module_of(name).rpartition(".")[2] for name in FAMILIES}
    found = {m: _reexported_hooks(MODELS / f"{m}.py") for m in sorted(modules)}
    assert {m: names for m, names in found.items() if names} == {}


# What each derived family changes of the one it derives from: anything else it
# inherits, and a change to either list is a deliberate one.
DERIVED = {
    ("deepseek_v32", "deepseek_v3"): {"make_layer", "trunk_classes"},
    ("glm4_moe", "deepseek_v3"): {"make_layer", "MASK_AS_ARRAY"},
    ("glm4_moe_lite", "deepseek_v3"): {"make_layer"},
    ("llama", "deepseek_v3"): {"make_layer", "MASK_FIRST_POSITION", "MASK_AS_ARRAY"},
    ("qwen3_5", "qwen3_next"): {
        "MTP_CONFIG_KEYS",
        "EMBEDDING_KEY",
        "FINAL_NORM_KEY",
        "is_raw",
        "text_args",
        "head",
        "logits",
        "make_layer",
        "trunk_classes",  # images: the vision tower kept (`qwen_vision`)
        "hidden",
        "image_processor",
        "media",
        "image_placeholder",
    },
    ("qwen3_5_moe", "qwen3_5"): {"split_weights"},
    ("step3p7", "step3p5"): {
        "LAYOUT",
        "mtp_layer_of",
        "split_weights",
        "sanitize",
        "trunk_classes",
    },
    ("bailing_moe_v3", "bailing_hybrid"): {
        "sanitize",
        "make_layer",
        "MASK_FIRST_POSITION",
        "fix_config",
    },
}


@pytest.mark.parametrize("name, base", DERIVED)
def test_a_derived_family_changes_only_what_it_says(name, base):
    ours, theirs = _hooks(name), _hooks(base)
    assert {h for h in ours if ours[h] != theirs[h]} == DERIVED[name, base]


def test_the_default_layer_count_follows_the_familys_keys():
    """Counted from the first of MTP_CONFIG_KEYS set (in the config or its
    text_config), also in a derived family that changes the keys."""
    deepseek = get_family({"model_type": "deepseek_v3"})
    assert deepseek.declared_mtp_layers({"num_nextn_predict_layers": 2}) == 2
    derived = deepseek.derive(MTP_CONFIG_KEYS=("mtp_layers", "other"))
    assert derived.declared_mtp_layers({"num_nextn_predict_layers": 2}) == 0
    assert derived.declared_mtp_layers({"text_config": {"other": 3}}) == 3
    assert derived.declared_mtp_layers({"mtp_layers": 1, "other": 3}) == 1


def test_make_layer_takes_the_config():
    hints = typing.get_type_hints(Family)
    assert hints["make_layer"] == typing.Callable[[typing.Any, int, dict], typing.Any]


@pytest.mark.parametrize("family", fixtures.FAMILIES)
def test_embedding_and_final_norm_keys_are_the_trunks(family, checkpoint, loaded):
    """``EMBEDDING_KEY``, ``FINAL_NORM_KEY`` and ``ZERO_CENTRED_NORMS`` (what the
    fixtures and fingerprints read) name the tensors ``embed`` and ``final_norm``
    use."""
    path = checkpoint(family)
    weights = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    model, _ = loaded(family)
    fam, ids = model.family, mx.array([[1, 5, 9]])
    embedding = weights[fam.EMBEDDING_KEY]
    assert mx.allclose(model.embed(ids), embedding[ids]).item()
    if fam.FINAL_NORM_KEY is None:  # no final norm (Qwen3.8-Flash-Next): refused
        with pytest.raises(MTPError, match="has no final norm"):
            fam.final_norm(model.trunk)
        return
    shift = 1.0 if fam.ZERO_CENTRED_NORMS else 0.0
    norm = fam.final_norm(model.trunk).weight
    assert mx.allclose(norm, weights[fam.FINAL_NORM_KEY] + shift).item()


def test_train_heads_drafts_with_the_familys_head(loaded):
    """Qwen3.5's untied head sits in its text model; train-heads used the embedding."""
    from mlx_mtp.convert.train_heads import draft_weight

    model, _ = loaded("qwen3_5")
    vocab = mx.array([3, 40, 300])
    head = model.trunk.language_model.lm_head.weight
    assert mx.array_equal(draft_weight(model, vocab), head[vocab]).item()
    strange = SimpleNamespace(
        trunk=model.trunk,
        family=model.family.derive(head=None, logits=lambda trunk, h: h),
    )
    with pytest.raises(MTPError, match="cannot train heads"):
        draft_weight(strange, vocab)


def test_fingerprint_is_the_trunks_embedding_not_a_copy(checkpoint, tmp_path):
    """A Ling checkpoint with the MTP layer's copy of the embedding has the
    fingerprint of the same checkpoint without its heads."""
    src = checkpoint("bailing_hybrid")
    config = json.loads((src / "config.json").read_text())
    weights = mx.load(str(src / "model.safetensors"))
    copy = f"model.layers.{config['num_hidden_layers']}.embed_tokens.weight"
    family = get_family(config)
    weights[copy] = weights[family.EMBEDDING_KEY]
    with_copy, without = tmp_path / "with", tmp_path / "without"
    trunk, _ = family.split_weights(weights, config)
    for folder, tensors in ((with_copy, weights), (without, trunk)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        mx.save_safetensors(str(folder / "model.safetensors"), tensors)
    assert source_fingerprint(with_copy) == source_fingerprint(without) is not None
    (without / "config.json").write_text(json.dumps({"model_type": "nope"}))
    assert source_fingerprint(without) is None


class _Pipelined:
    def __init__(self):
        self.groups = []

    def pipeline(self, group):
        self.groups.append(group)


def test_shard_follows_mlx_lm_sharded_load():
    """Pipeline parallel exactly when mlx-lm's ``sharded_load`` would pipeline
    (``model.pipeline``): no probe of a wrapper's ``language_model``."""
    wrapper = SimpleNamespace(model=_Pipelined(), model_type="wrapped")
    assert distributed.shard(wrapper, "group") == "pipeline"
    assert wrapper.model.groups == ["group"]
    inner = SimpleNamespace(
        language_model=SimpleNamespace(model=_Pipelined()), model_type="inner"
    )
    with pytest.raises(MTPError, match="cannot shard inner models"):
        distributed.shard(inner, "group")
    assert inner.language_model.model.groups == []
