"""The family interface: the hooks one family module (one per Hugging Face
``model_type``) gives mlx-mtp, and the defaults of those it may leave out.

A family module ends with one object, ``FAMILY``: ``define(...)`` names every hook a
family sets, and ``other.FAMILY.derive(...)`` takes another family's hooks except the
ones it names (its own, or ``defaults=(...)`` for the defaults), so a reader sees what
a family takes from which. Hook names are checked where they are written (a misspelt
one is an error naming the closest hook), and `Family.from_module` refuses a module
whose public names look like hooks ``FAMILY`` does not use. The rest of mlx-mtp calls
``family.hook(...)`` with no ``getattr``: everything a Hugging Face layout means to
mlx-mtp (tensor names, the trunk's embedding, norm and head) is a hook.

A new family touches exactly these files (every test iterating over the fixtures'
families then runs it: greedy identity, sampling, rollback, conversion, numerics):

- ``mlx_mtp/models/<model_type>.py``: its hooks, ending in ``FAMILY``;
- ``mlx_mtp/models/__init__.py``: its name in ``FAMILIES`` (and ``SHARED`` for
  further model types of the same module);
- ``mlx_mtp/testing/fixtures.py``: the builder of its tiny checkpoint, in ``_SPECS``
  (everything else the fixture needs is the family's own);
- ``tests/numpy_reference.py``: its name in ``FAMILIES`` (and, for a trunk of a new
  kind, ``SEPARATE`` and a ``tests/numpy_<model_type>.py``), the independent forward
  pass `tests/test_numerics.py` compares every fixture family with;
- ``tests/golden/<model_type>.json``, when a release's tensor names and shapes can be
  found (`tests/test_golden_layouts.py` checks every file there);
- ``docs/models.md``: its row under "Supported checkpoints" (and its name in the
  README's list).

Required:

- ``LAYOUT``: a `Layout`, where the checkpoint keeps the MTP tensors and their names
  (read by the family's own code, by the fixtures and by the converter's checks);
- ``MTP_CONFIG_KEYS``: the config keys that declare the MTP layers, most usual first
  (empty when released configs do not count them: the checkpoint's tensors do);
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

- ``declared_mtp_layers(config) -> int`` [the first of ``MTP_CONFIG_KEYS`` set in the
  config or its ``text_config``, else 0]: how many MTP layers the config declares;
- ``MASK_FIRST_POSITION`` [False]: zero the embedding of an MTP layer's first row at
  position 0 (vLLM's convention for DeepSeek, GLM and MiMo);
- ``MASK_AS_ARRAY`` [False]: the block's attention takes its causal mask as an array;
- ``EMBEDDING_KEY`` [``"model.embed_tokens.weight"``]: the checkpoint name of the
  trunk's token embedding (its last two parts also name it in an MLX conversion);
- ``FINAL_NORM_KEY`` [``"model.norm.weight"``]: the checkpoint name of the trunk's
  final norm (None: it has none, and ``final_norm`` refuses);
- ``ZERO_CENTRED_NORMS`` [False]: the checkpoint stores norms as ``w`` in
  ``x * (1 + w)`` (Qwen, Step), so a norm that scales by one is stored as 0;
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
- ``final_norm(trunk)`` [`trunk_final_norm`]: the norm ``hidden`` ends with;
- ``fix_config(config) -> dict`` [no fixes]: config values mlx-lm's ``ModelArgs``
  need to build the trunk as transformers would (merged over ``config.json``);
- ``trunk_classes(config) -> (Model, ModelArgs)`` [None: mlx-lm's classes for the
  ``model_type``]: the trunk's classes, for a model mlx-lm has none for;
- ``hidden_width(args) -> int`` [``args.hidden_size``]: the last axis of ``hidden``
  (wider when a family packs more than one state into it; the last ``hidden_size``
  entries are then what its ``head`` projects);
- ``image_processor(model_path)`` [None: the family reads no images]: the image
  processor of a model folder (mlx-vlm's, called as ``processor(images=[...])``,
  giving ``pixel_values`` and ``image_grid_thw``);
- ``media(trunk, ids, pixel_values, grid_thw) -> (ids, Media)``: a prompt with one
  image placeholder per image, as the model reads it (each placeholder repeated
  for its image's features) and its `mlx_mtp.media.Media` (the trunk's caches
  then end with a `mlx_mtp.media.MediaCache`, and each MTP layer keeps one: its
  ``reads_media``);
- ``image_placeholder(trunk) -> mlx_mtp.media.Placeholder``: with ``media``, how
  the prompt holds an image: the placeholder token, the tower's spatial merge (an
  image of t x h x w patches takes t*h*w / merge**2 placeholders) and the tokens
  around them (`mlx_mtp.media.expand`);
- ``MAPPED_TABLES`` [()]: parts of the names of the trunk's embedding tables that a
  step reads a few rows of (Qwen3.8-Flash-Next's hashed n-gram table), the same in
  the checkpoint and in the trunk: a load reads them by row from their files,
  memory-mapped, and never loads them (`mlx_mtp.tables`);
- ``make_drafter(trunk, config)`` [None]: the checkpoint's MTP tensors are a block
  drafter (DeepSeek-V4.1's DSpark stages), not MTP layers: the module ``sanitize``'s
  names load into, attached as the model's drafter (``make_layer`` then refuses).
"""

import difflib
from dataclasses import MISSING, dataclass, field, fields, replace
from types import ModuleType
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

from .base import trunk_embed, trunk_final_norm, trunk_head, trunk_hidden, trunk_logits


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
        halves: The checkpoint names of ``eh_proj``'s embedding and hidden halves
            when the checkpoint keeps them apart (DeepSeek-V4's ``e_proj``,
            ``h_proj``; ``fusion`` names the first as ``eh_proj``).
    """

    prefix: Callable[[dict, int], str]
    fusion: Dict[str, str]
    hidden_first: bool = False
    copies: Dict[str, str] = field(default_factory=dict)
    norm_prefix: Optional[Callable[[dict, int], str]] = None
    halves: Optional[Tuple[str, str]] = None

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


def trunk_args(trunk):
    """The default ``text_args``: the trunk's own args."""
    return trunk.args


def args_hidden_size(args) -> int:
    """The default ``hidden_width``: the model's width."""
    return args.hidden_size


def no_fixes(config: dict) -> dict:
    """The default ``fix_config``: nothing to add to ``config.json``."""
    return {}


def always_raw(weights: dict, config: dict) -> bool:
    """The default ``is_raw``: the tensors are as Hugging Face writes them."""
    return True


@dataclass(frozen=True)
class DeclaredByKeys:
    """The default ``declared_mtp_layers``: the first of ``keys`` set in the config
    or its ``text_config`` (0 when none is)."""

    keys: Tuple[str, ...]

    def __call__(self, config: dict) -> int:
        for part in (config, config.get("text_config") or {}):
            for key in self.keys:
                if part.get(key):
                    return int(part[key])
        return 0


@dataclass(frozen=True, kw_only=True)
class Family:
    """A family's hooks, with the documented defaults filled in (build one with
    `define` or `Family.derive`, which check the hook names)."""

    name: str = ""
    LAYOUT: Layout
    MTP_CONFIG_KEYS: Tuple[str, ...]
    mtp_layer_of: Callable[[str, dict], Optional[int]]
    split_weights: Callable[[dict, dict], tuple]
    sanitize: Callable[..., dict]
    make_layer: Callable[[Any, int, dict], Any]
    declared_mtp_layers: Optional[Callable[[dict], int]] = None
    MASK_FIRST_POSITION: bool = False
    MASK_AS_ARRAY: bool = False
    EMBEDDING_KEY: str = "model.embed_tokens.weight"
    FINAL_NORM_KEY: Optional[str] = "model.norm.weight"
    ZERO_CENTRED_NORMS: bool = False
    is_raw: Callable[[dict, dict], bool] = always_raw
    prepare: Optional[Callable[[Any], None]] = None
    text_args: Callable[[Any], Any] = trunk_args
    hidden: Callable = trunk_hidden
    logits: Callable = trunk_logits
    head: Optional[Callable] = None
    embed: Callable = trunk_embed
    final_norm: Callable = trunk_final_norm
    fix_config: Callable[[dict], dict] = no_fixes
    trunk_classes: Optional[Callable[[dict], tuple]] = None
    hidden_width: Callable[[Any], int] = args_hidden_size
    MAPPED_TABLES: Tuple[str, ...] = ()
    make_drafter: Optional[Callable[[Any, dict], Any]] = None
    image_processor: Optional[Callable[[Any], Any]] = None
    media: Optional[Callable[..., Any]] = None
    image_placeholder: Optional[Callable[[Any], Any]] = None

    def __post_init__(self):
        # The default count follows MTP_CONFIG_KEYS, also in a derived family that
        # changes them.
        if self.declared_mtp_layers is None or isinstance(
            self.declared_mtp_layers, DeclaredByKeys
        ):
            keys = DeclaredByKeys(tuple(self.MTP_CONFIG_KEYS))
            object.__setattr__(self, "declared_mtp_layers", keys)

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
    def default(cls, hook: str) -> Any:
        """The default of an optional hook."""
        check_hook_names([hook])
        value = next(f.default for f in fields(cls) if f.name == hook)
        if value is MISSING:
            raise TypeError(f"the family hook {hook} is required; it has no default")
        return value

    def derive(self, *, defaults: Iterable[str] = (), **hooks) -> "Family":
        """This family's hooks, except ``hooks`` (replaced) and ``defaults`` (reset
        to the interface's defaults).

        Raises:
            TypeError: a name is not a hook (naming the closest one).
        """
        defaults = tuple(defaults)
        check_hook_names([*defaults, *hooks])
        both = sorted(set(defaults) & set(hooks))
        if both:
            raise TypeError(f"{', '.join(both)}: both given and reset to the default")
        reset = {h: self.default(h) for h in defaults}
        return replace(self, **reset, **hooks)

    @classmethod
    def from_module(cls, module: ModuleType) -> "Family":
        """The ``FAMILY`` of a family module, its public names checked.

        Raises:
            TypeError: the module has no ``FAMILY``, or a public name of it looks
                like a hook that ``FAMILY`` does not use (a bug in the module).
        """
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, cls):
            raise TypeError(
                f"family module {module.__name__} defines no FAMILY (a Family, "
                "from define or another family's FAMILY.derive)"
            )
        for name, value in vars(module).items():
            problem = _name_problem(name, value, family)
            if problem:
                raise TypeError(f"family module {module.__name__}: {problem}")
        return replace(family, name=module.__name__.rpartition(".")[2])

    def output_head(self, trunk) -> Optional[Any]:
        """The module whose ``(V, H)`` weight ``logits`` projects with (``head``, or
        the trunk's own); None when ``logits`` is the family's own and names none."""
        if self.head is not None:
            return self.head(trunk)
        return None if self.own_logits else trunk_head(trunk)

    @property
    def own_logits(self) -> bool:
        """The family computes logits its own way (its head is not the trunk's)."""
        return self.logits is not trunk_logits


def define(**hooks) -> Family:
    """A family from its hooks (the optional ones default as the module docstring
    says).

    Raises:
        TypeError: a name is not a hook (naming the closest one), or a required hook
            is missing.
    """
    check_hook_names(hooks)
    missing = [h for h in Family.required() if h not in hooks]
    if missing:
        raise TypeError(f"the family lacks {', '.join(missing)}")
    return Family(**hooks)


def check_hook_names(names: Iterable[str]) -> None:
    """Raise TypeError for the first of ``names`` that is not a hook."""
    hooks = Family.hooks()
    for name in names:
        if name not in hooks:
            raise TypeError(f"{name} is not a family hook{_closest(name, hooks)}")


def _closest(name: str, hooks: Tuple[str, ...], cutoff: float = 0.6) -> str:
    match = difflib.get_close_matches(name, hooks, n=1, cutoff=cutoff)
    return f" (did you mean {match[0]}?)" if match else ""


# Public module names starting so, or this close to a hook's name, are taken for
# misspelt hooks; a family's own helpers are named otherwise (or start with "_").
HOOK_PREFIXES = ("MASK_", "MTP_", "LAYOUT")
LOOKALIKE = 0.8


def _name_problem(name: str, value: Any, family: Family) -> Optional[str]:
    """Why a family module's public ``name`` is refused, or None."""
    if name.startswith("_") or name == "FAMILY" or isinstance(value, ModuleType):
        return None
    hooks = Family.hooks()
    if name in hooks:
        ours = getattr(family, name)
        if value is ours or (not callable(value) and value == ours):
            return None
        return f"{name} is not the FAMILY's {name} (pass it to FAMILY, or rename it)"
    lookalike = difflib.get_close_matches(name, hooks, n=1, cutoff=LOOKALIKE)
    if lookalike or name.startswith(HOOK_PREFIXES):
        hint = _closest(name, hooks)
        return f"{name} is not a family hook{hint}; name a helper otherwise"
    return None
