"""``mlx-mtp check OUT``: what a conversion holds, and whether its heads still
predict what the source checkpoint's heads predict.

The agreement check runs both models teacher-forced over a built-in text (code and
prose) and compares top-1 predictions position by position: the trunk's next token, and
each MTP layer's token after next. The verdict is about the heads' conversion alone:
the converted heads run on the source's trunk (its hidden states, embedding and head),
so trunk quantization does not blur it, and a double-shifted norm, a swapped
concatenation or a broken head quantization drops it far below the threshold.
End-to-end agreement, through the converted trunk, is reported beside it.

A folder drafting with a Gemma 4 assistant or a grafted block drafter (DSpark, DFlash,
DFlash2) is checked the same way on its own trunk: the converted drafter's top-1 against
the source drafter's, run on the same target (`check_assistant`, `check_drafter`).
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import numpy as np

from mlx_mtp.cache import block_context, mtp_caches
from mlx_mtp.errors import MTPError
from mlx_mtp.loading import attach_assistant, load, read_config
from mlx_mtp.models import dflash, dspark
from mlx_mtp.models.base import Model

BUILTIN_TEXT = '''\
def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return out + a[i:] + b[j:]

The river runs slowly through the valley in late summer. Farmers bring their harvest to
the market in town, where the streets fill with voices, carts and the smell of bread.
'''
MAX_TOKENS = 256


def _bits(q: Optional[dict]) -> str:
    if not q:
        return "float"
    text = f"{q['bits']}-bit {q.get('mode', 'affine')} (group {q['group_size']})"
    modes = sorted({v["mode"] for v in q.values() if isinstance(v, dict)})
    return text + (f", some layers {'/'.join(modes)}" if modes else "")


@dataclass
class CheckReport:
    path: Path
    num_heads: int
    head_quantization: Optional[dict]
    trunk_quantization: Optional[dict]
    trunk_parameters: int
    head_parameters: int
    threshold: float
    source: Optional[str] = None
    tokens: int = 0
    trunk_agreement: Optional[float] = None
    head_agreement: List[float] = field(default_factory=list)  # on the source trunk
    end_to_end: List[float] = field(default_factory=list)  # through the converted trunk
    self_agreement: List[float] = field(default_factory=list)  # vs its own trunk
    missing_source: Optional[str] = None  # recorded, but no longer there

    @property
    def passed(self) -> bool:
        return self.num_heads > 0 and all(
            a >= self.threshold for a in self.head_agreement
        )

    def lines(self) -> List[str]:
        out = [
            f"{self.path}:",
            f"  MTP heads: {self.num_heads} layer(s), {_bits(self.head_quantization)}, "
            f"{self.head_parameters / 1e6:.2f}M parameters",
            f"  trunk: {_bits(self.trunk_quantization)}, "
            f"{self.trunk_parameters / 1e6:.2f}M parameters",
        ]
        proxy = " ".join(f"{a:.3f}" for a in self.self_agreement)
        out.append(
            f"  heads vs their own trunk's greedy tokens (acceptance proxy, "
            f"{self.tokens} tokens): {proxy}"
        )
        if self.missing_source:
            return out + [
                f"  the recorded source {self.missing_source} is not there any more: "
                "agreement with it not checked (pass --hf-path SOURCE)"
            ]
        if self.source is None:
            return out + [
                "  no source heads recorded: agreement with a source not checked"
            ]
        out.append(
            f"  top-1 agreement with {self.source} over {self.tokens} tokens "
            f"(teacher-forced): trunk {self.trunk_agreement:.3f}"
        )
        for j, (a, e) in enumerate(zip(self.head_agreement, self.end_to_end)):
            verdict = "ok" if a >= self.threshold else "FAIL"
            out.append(
                f"    head {j}: {a:.3f} on the source's trunk "
                f"(threshold {self.threshold:.2f}) {verdict}; {e:.3f} end to end"
            )
        return out


def _moved(source: str) -> bool:
    """A recorded local source folder that is no longer there (a hub id is fetched)."""
    return Path(source).is_absolute() and not Path(source).exists()


def _source(source: Optional[str], section: dict, report) -> Optional[str]:
    """The source to compare with: the one given, else the one the section records
    (None, noted in ``report``, when that was a local folder that has moved)."""
    if source:
        return source
    source = section.get("provenance", {}).get("source")
    if source and _moved(source):
        report.missing_source = source
        return None
    return source


def predictions(model, tokens: List[int]) -> List[np.ndarray]:
    """Top-1 of the trunk (next token) and of each MTP layer (chained,
    teacher-forced)."""
    seq = mx.array(tokens)[None]
    h = model.hidden(seq)  # (1, n, H)
    out = [np.array(mx.argmax(model.logits(h), axis=-1)[0])]
    n = len(tokens)
    for j in range(model.num_mtp_layers):
        h = model.mtp_forward(j, h[:, : n - 1 - j], seq[:, j + 1 :])
        out.append(np.array(mx.argmax(model.logits(h), axis=-1)[0]))
    return out


def _parameters(module) -> int:
    from mlx_lm.utils import get_total_parameters

    return get_total_parameters(module)


def _run_as(reference, model) -> None:
    """Cast the source ``reference`` to the float dtype of the conversion ``model``,
    as convert and graft cast the heads to the trunk's: both then run alike (MLX's CPU
    runs MoE layers in float32 only, so a float16 source would not run there)."""
    from .graft import _float_dtype
    from .hf import _cast

    dtype = _float_dtype(model.trunk, model.family)
    if _float_dtype(reference.trunk, reference.family) != dtype:
        trunk = reference.trunk
        _cast(trunk, dtype, getattr(trunk, "cast_predicate", None))
        _cast(reference.mtp, dtype, None)


def check(
    mlx_path: str,
    source: Optional[str] = None,
    threshold: float = 0.9,
    text: str = BUILTIN_TEXT,
    trust_remote_code: bool = False,
) -> CheckReport:
    """Inspect a conversion and compare its heads with ``source`` (default: the source
    its provenance records, when it can still be found: a recorded local folder that
    has moved is reported, and what needs no source is still checked). Raises
    `MTPError` when the folder has no MTP heads."""
    path = Path(mlx_path)
    config = read_config(path)
    section = config.get("mtp")
    if isinstance(config.get("assistant"), dict) and not isinstance(section, dict):
        return check_assistant(path, config, source, threshold, text, trust_remote_code)
    if not isinstance(section, dict) and isinstance(config.get("drafter"), dict):
        return check_drafter(path, config, source, threshold, text, trust_remote_code)
    if not isinstance(section, dict):
        if dspark.is_dspark(config):
            raise MTPError(
                f"{path} is a {dflash.kind(config) or 'DSpark'} drafter alone; check "
                f"reads one beside its target: mlx-mtp graft --from {path} --mlx-path "
                "TARGET, then mlx-mtp check TARGET"
            )
        raise MTPError(
            f"{path} has no mlx-mtp MTP heads nor assistant (not converted by mlx-mtp?)"
        )
    model, tokenizer = load(str(path), trust_remote_code=trust_remote_code)
    trunk_quant = config.get("quantization")
    report = CheckReport(
        path=path,
        num_heads=model.num_mtp_layers,
        head_quantization=section.get("quantization"),
        trunk_quantization=trunk_quant
        and {
            k: trunk_quant[k]
            for k in ("group_size", "bits", "mode")
            if k in trunk_quant
        },
        trunk_parameters=_parameters(model.trunk),
        head_parameters=_parameters(model.mtp),
        threshold=threshold,
    )
    tokens = tokenizer.encode(text)[:MAX_TOKENS]
    ours = predictions(model, tokens)
    report.tokens = len(tokens)
    report.self_agreement = [
        float((p == ours[0][j : j + len(p)]).mean())  # head j row i: token i+j+1
        for j, p in enumerate(ours[1:], start=1)
    ]
    source = _source(source, section, report)
    if not source:
        return report
    reference, _ = load(source, trust_remote_code=trust_remote_code)
    _run_as(reference, model)
    if reference.num_mtp_layers != model.num_mtp_layers:
        raise MTPError(
            f"{path} has {model.num_mtp_layers} MTP layers, {source} "
            f"{reference.num_mtp_layers}"
        )
    theirs = predictions(reference, tokens)
    on_source = Model(reference.trunk, model.mtp, reference.family)
    isolated = predictions(on_source, tokens)

    def agree(xs):
        return [float((a == b).mean()) for a, b in zip(xs, theirs)]

    report.source = source
    report.trunk_agreement = agree(ours)[0]
    report.head_agreement, report.end_to_end = agree(isolated)[1:], agree(ours)[1:]
    return report


class AgainstSource:
    """A drafter's verdict against its source (``agreement``, ``threshold``,
    ``source``, ``missing_source``: the report's fields)."""

    @property
    def passed(self) -> bool:
        return self.agreement is not None and self.agreement >= self.threshold

    def against_source(self, over: str) -> List[str]:
        """The report's last line: the agreement ``over`` the text, or why there is
        none."""
        if self.missing_source:
            return [
                f"  the recorded source {self.missing_source} is not there any more: "
                "agreement with it not checked (pass --hf-path SOURCE)"
            ]
        if self.source is None:
            return ["  no source recorded: agreement with it not checked"]
        verdict = "ok" if self.passed else "FAIL"
        return [
            f"  top-1 agreement with {self.source} on this target, {over}: "
            f"{self.agreement:.3f} (threshold {self.threshold:.2f}) {verdict}"
        ]


@dataclass
class AssistantReport(AgainstSource):
    """What `check_assistant` found (``passed`` as `CheckReport`'s)."""

    path: Path
    model_type: str
    layers: int
    head: str
    quantization: Optional[dict]
    parameters: int
    threshold: float
    tokens: int = 0
    self_agreement: float = 0.0  # its first draft vs its own target's greedy token
    source: Optional[str] = None
    agreement: Optional[float] = None  # vs the source assistant, on this target
    missing_source: Optional[str] = None

    def lines(self) -> List[str]:
        out = [
            f"{self.path}:",
            f"  assistant: {self.model_type}, {self.layers} layers, {self.head} head, "
            f"{_bits(self.quantization)}, {self.parameters / 1e6:.2f}M parameters",
            f"  first draft vs the target's greedy token (teacher-forced, acceptance "
            f"proxy, {self.tokens} tokens): {self.self_agreement:.3f}",
        ]
        return out + self.against_source(f"over {self.tokens} tokens")


def assistant_predictions(model, tokens: List[int]) -> np.ndarray:
    """Top-1 of an assistant's first draft at every position, teacher-forced, in one
    pass: row i drafts from (t_{i+1}, h_i) at position i + 1, reading the trunk's K/V
    of positions <= i (the last W + 1 of them in sliding layers), and predicts
    t_{i+2}, as decoding does when t_{i+1} is the pending token."""
    from mlx_lm.models.cache import KVCache

    caches = [KVCache() for _ in model.make_trunk_cache()]
    seq = mx.array(tokens)[None]
    h = model.hidden(seq, caches)  # (1, n, H)
    kv = {kind: caches[i].keys_and_values() for kind, i in model.reads.items()}
    q = mx.arange(1, len(tokens))[:, None]  # query positions
    k = mx.arange(len(tokens))[None]
    past = k < q
    masks = {
        "full_attention": past,
        "sliding_attention": past & (k >= q - model.assistant.window),
    }
    logits, _ = model.assist(seq[:, 1:], h[:, :-1], kv, 1, masks)
    return np.array(mx.argmax(logits, axis=-1)[0])


def check_assistant(
    path: Path,
    config: dict,
    source: Optional[str],
    threshold: float,
    text: str,
    trust_remote_code: bool,
) -> AssistantReport:
    """`check` for a pair folder: the assistant against its target, and against the
    source assistant it was converted from, run on the same target."""
    model, tokenizer = load(str(path), trust_remote_code=trust_remote_code)
    if model.assistant is None:
        raise MTPError(f"{path}: the assistant could not be loaded")
    section = config["assistant"]
    assistant = model.assistant
    report = AssistantReport(
        path=path,
        model_type=assistant.model_type,
        layers=len(assistant.model.layers),
        head="centroid" if "masked_embedding" in assistant else "tied",
        quantization=section.get("quantization"),
        parameters=_parameters(assistant),
        threshold=threshold,
    )
    tokens = tokenizer.encode(text)[:MAX_TOKENS]
    report.tokens = len(tokens)
    ours = assistant_predictions(model, tokens)
    greedy = np.array(mx.argmax(model.logits(model.hidden(mx.array(tokens)[None])), -1))
    report.self_agreement = float((ours == greedy[0, 1:]).mean())
    source = _source(source, section, report)
    if not source:
        return report
    reference = Model(model.trunk, model.mtp, model.family)
    attach_assistant(reference, config, path, source)
    report.source = source
    report.agreement = float((assistant_predictions(reference, tokens) == ours).mean())
    return report


@dataclass
class DrafterReport(AgainstSource):
    """What `check_drafter` found (``passed`` as `CheckReport`'s)."""

    path: Path
    kind: str
    layers: int
    gamma: int
    quantization: Optional[dict]
    parameters: int
    threshold: float
    tokens: int = 0
    # per slot: its token vs the target's greedy one (teacher-forced)
    self_agreement: List[float] = field(default_factory=list)
    source: Optional[str] = None
    agreement: Optional[float] = None  # every slot vs the source drafter's
    missing_source: Optional[str] = None

    def lines(self) -> List[str]:
        slots = " ".join(f"{a:.2f}" for a in self.self_agreement)
        out = [
            f"{self.path}:",
            f"  drafter: {self.kind}, {self.layers} layers, {self.gamma} slots a "
            f"block, {_bits(self.quantization)}, {self.parameters / 1e6:.2f}M "
            "parameters",
            f"  each slot vs the target's greedy token (teacher-forced, acceptance "
            f"proxy, {self.tokens} tokens): {slots}",
        ]
        return out + self.against_source(f"every slot over {self.tokens} tokens")


def drafter_predictions(model, tokens: List[int]) -> np.ndarray:
    """``(rows, gamma)`` top-1 of every slot of a block drafter's block after each
    position n >= 1, teacher-forced: context rows 0..n-1, anchor t_n, slot k after
    t_{n+k} (its Markov state so), predicting t_{n+k+1}, as decoding does when
    the drafts before it were accepted."""
    d = model.drafter
    taps = model.hidden(mx.array(tokens)[None])  # (1, n, packed width)
    caches = mtp_caches(model)
    rows = []
    for n in range(1, len(tokens) - d.block_size):
        model.draft_context(taps[:, n - 1 : n], caches)
        z, g = model.draft_block(
            mx.array([tokens[n]]), block_context(d, caches, [n]), n
        )
        state, slots = d.markov_start(1, g.dtype), []
        for k in range(d.block_size):
            prev = mx.array([tokens[n + k]])
            logits, state = model.slot_logits(z[:, k], prev, g[:, k], state)
            slots.append(mx.argmax(logits, axis=-1))
        rows.append(mx.concatenate(slots))
        mx.eval(rows[-1])
    return np.array(mx.stack(rows))


def check_drafter(
    path: Path,
    config: dict,
    source: Optional[str],
    threshold: float,
    text: str,
    trust_remote_code: bool,
) -> DrafterReport:
    """`check` for a folder with a grafted block drafter (``graft`` of a DSpark,
    DFlash or Gemma 4 DSpark drafter): each slot against the target's greedy
    tokens, and every slot against the source drafter it was grafted from, run on
    the same target."""
    model, tokenizer = load(str(path), trust_remote_code=trust_remote_code)
    if model.drafter is None:
        raise MTPError(f"{path}: the grafted drafter could not be loaded")
    section, d = config["drafter"], model.drafter
    report = DrafterReport(
        path=path,
        kind=dflash.kind(section.get("config") or {}) or "DSpark",
        layers=len(d.layers),
        gamma=d.block_size,
        quantization=section.get("quantization"),
        parameters=_parameters(d),
        threshold=threshold,
    )
    tokens = tokenizer.encode(text)[:MAX_TOKENS]
    if len(tokens) <= d.block_size + 1:
        raise MTPError(f"the check text is too short for {d.block_size}-slot blocks")
    report.tokens = len(tokens)
    ours = drafter_predictions(model, tokens)
    greedy = np.array(mx.argmax(model.logits(model.hidden(mx.array(tokens)[None])), -1))
    rows = ours.shape[0]
    report.self_agreement = [
        float((ours[:, k] == greedy[0, 1 + k : 1 + k + rows]).mean())
        for k in range(d.block_size)
    ]
    source = _source(source, section, report)
    if not source:
        return report
    reference = Model(model.trunk, model.mtp, model.family)
    attach_assistant(reference, config, path, source)
    if reference.drafter is None or reference.drafter.block_size != d.block_size:
        raise MTPError(f"{source} is not the block drafter grafted onto {path}")
    report.source = source
    report.agreement = float((drafter_predictions(reference, tokens) == ours).mean())
    return report
