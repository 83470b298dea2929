"""The family interface: what one family module (one per Hugging Face ``model_type``)
defines, and the defaults of what it may leave out.

A family module is plain functions and constants; `Family.from_module` checks it and
fills the defaults, so the rest of mlx-mtp calls ``family.hook(...)`` with no
``getattr``. Adding a family is one module in this package (plus its name in
`mlx_mtp.models.FAMILIES`) and one fixture spec in `mlx_mtp.testing.fixtures`.

Required:

- ``LAYOUT``: a `Layout`, where the checkpoint keeps the MTP tensors and their names
  (read by the family's own code, by the fixtures and by the converter's checks);
- ``MTP_CONFIG_KEYS``: the config keys that declare the MTP layers, most usual first
  (empty when released configs do not count them: the checkpoint's tensors do);
- ``declared_mtp_layers(config) -> int``: how many MTP layers the config declares;
- ``mtp_layer_of(key, config) -> Optional[int]``: the MTP layer a checkpoint tensor
  belongs to (None: a trunk tensor);
- ``split_weights(weights, config) -> (trunk, mtp)``: the checkpoint's tensors, split
  (duplicated embedding / head copies checked and dropped);
- ``sanitize(mtp, config, trunk, raw) -> dict``: the MTP tensors in the schema
  ``layers.{j}.{enorm,hnorm,eh_proj,norm,block.*}`` (``raw``: see ``is_raw``);
- ``make_layer(trunk, j, config) -> MTPLayer``: MTP layer j, its block the family's
  mlx-lm decoder layer (``config``: the model's ``config.json``, for what the trunk's
  args do not keep, such as the sub-layers of a Nemotron-H MTP step).

Optional (default in brackets):

- ``MASK_FIRST_POSITION`` [False]: zero the embedding of an MTP layer's first row at
  position 0 (vLLM's convention for DeepSeek, GLM and MiMo);
- ``MASK_AS_ARRAY`` [False]: the block's attention takes its causal mask as an array;
- ``is_raw(weights, config) -> bool`` [True]: the tensors are in raw Hugging Face form,
  which the family's sanitize fixes (e.g. Qwen's ``(1 + w)`` norms);
- ``prepare(trunk)`` [None]: install per-position state capture in recurrent mixers
  (a family with it gets rollback-capable recurrent caches);
- ``text_args(trunk)`` [``trunk.args``]: the text model's args;
- ``hidden(trunk, inputs, cache)`` [`trunk_hidden`]: post-final-norm hidden states;
- ``logits(trunk, h)`` [`trunk_logits`]: the shared head;
- ``head(trunk)`` [None: `trunk_head`, or no draft-vocabulary rows when ``logits`` is
  the family's own]: the module whose ``(V, H)`` weight ``logits`` projects with;
- ``embed(trunk, ids)`` [`trunk_embed`]: token embeddings;
- ``fix_config(config) -> dict`` [no fixes]: config values mlx-lm's ``ModelArgs``
  need to build the trunk as transformers would (merged over ``config.json``).
"""

from dataclasses import MISSING, dataclass, field, fields
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Tuple

from .base import trunk_embed, trunk_hidden, trunk_logits


@dataclass(frozen=True)
class Layout:
    """Where a family's checkpoints keep their MTP tensors.

    Attributes:
        prefix: ``prefix(config, j)``, the name prefix of MTP layer j's fusion tensors
            (``"model.layers.61."``, ``"model.mtp_layers.0."``, ``"mtp."``).
        fusion: Checkpoint name -> schema name of the fusion and norm tensors
            (schema names: ``enorm``, ``hnorm``, ``eh_proj``, ``norm``); ``{j}`` in a
            name stands for the layer (ERNIE's ``mtp_linear_proj.{j}``). A layout
            without ``norm`` closes the layer with the trunk's final norm.
        hidden_first: The projection's input is ``[hidden, embedding]`` (MiMo), not
            ``[embedding, hidden]``.
        copies: Per-layer duplicates of trunk tensors (name inside the layer -> trunk
            key), checked against the trunk and dropped.
        norm_prefix: ``norm_prefix(config, j)``, where the final norm sits when it is
            not under ``prefix`` (Nemotron-H: on the last sub-layer of the step).
    """

    prefix: Callable[[dict, int], str]
    fusion: Dict[str, str]
    hidden_first: bool = False
    copies: Dict[str, str] = field(default_factory=dict)
    norm_prefix: Optional[Callable[[dict, int], str]] = None

    def name(self, schema: str) -> str:
        """The checkpoint name of a fusion tensor's schema name (``enorm`` ...)."""
        return next(k for k, v in self.fusion.items() if v == schema)

    def key(self, config: dict, j: int, schema: str) -> str:
        """The full checkpoint name of MTP layer j's fusion tensor ``schema``
        (``"model.layers.61.enorm.weight"``)."""
        prefix = self.prefix
        if schema == "norm" and self.norm_prefix is not None:
            prefix = self.norm_prefix
        name = self.name(schema).replace("{j}", str(j))
        return f"{prefix(config, j)}{name}.weight"


def _trunk_args(trunk):
    return trunk.args


def _no_fixes(config: dict) -> dict:
    return {}


def _always_raw(weights: dict, config: dict) -> bool:
    return True


@dataclass(frozen=True)
class Family:
    """A family module's hooks, with the documented defaults filled in."""

    name: str
    LAYOUT: Layout
    MTP_CONFIG_KEYS: Tuple[str, ...]
    declared_mtp_layers: Callable[[dict], int]
    mtp_layer_of: Callable[[str, dict], Optional[int]]
    split_weights: Callable[[dict, dict], tuple]
    sanitize: Callable[..., dict]
    make_layer: Callable[[Any, int], Any]
    MASK_FIRST_POSITION: bool = False
    MASK_AS_ARRAY: bool = False
    is_raw: Callable[[dict, dict], bool] = _always_raw
    prepare: Optional[Callable[[Any], None]] = None
    text_args: Callable[[Any], Any] = _trunk_args
    hidden: Callable = trunk_hidden
    logits: Callable = trunk_logits
    head: Optional[Callable] = None
    embed: Callable = trunk_embed
    fix_config: Callable[[dict], dict] = _no_fixes

    @classmethod
    def hooks(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "name")

    @classmethod
    def required(cls) -> Tuple[str, ...]:
        return tuple(
            f.name
            for f in fields(cls)
            if f.name != "name"
            and f.default is MISSING
            and f.default_factory is MISSING
        )

    @classmethod
    def from_module(cls, module: ModuleType) -> "Family":
        """Check ``module`` against the interface and fill in the defaults.

        Raises:
            TypeError: a required hook is missing (a bug in the family module).
        """
        missing = [h for h in cls.required() if not hasattr(module, h)]
        if missing:
            raise TypeError(
                f"family module {module.__name__} lacks {', '.join(missing)}"
            )
        hooks = {h: getattr(module, h) for h in cls.hooks() if hasattr(module, h)}
        return cls(name=module.__name__.rpartition(".")[2], **hooks)

    @property
    def own_logits(self) -> bool:
        """The family computes logits its own way (its head is not the trunk's)."""
        return self.logits is not trunk_logits
