"""``mlx-mtp train-heads``: retrofit MTP heads to a model that has none.

Self-distillation with a frozen trunk. A DeepSeek-style MTP layer (``eh_proj`` over
``[enorm(embedding), hnorm(hidden)]``, one decoder block of the trunk's family,
``norm``, the trunk's own head) is fed the trunk's post-final-norm hidden state, exactly
as the runtime feeds it, and learns to predict the token the *trunk* emits next (a draft
is accepted when it equals that token). The same layer is chained for depths 2..D as
the runtime chains it, so later drafts are trained too.

The data is source text (``--data``), the trunk's own replies to prompts
(``--distill``, `mlx_mtp.convert.distill`: the distribution decoding actually sees,
reply positions only), or both.

Efficiency on a CPU: trunk features (hidden states, greedy tokens) are computed once and
stored (float16, memory-mapped) and reused across epochs; the head's softmax runs over
a draft vocabulary (the ``--draft-vocab-size`` most frequent greedy tokens, FR-Spec
style), which the runtime then drafts from. The block starts as a copy of the trunk's
last layer, or as heads trained earlier (``--init-heads``: a run goes on across
sessions, on more data; refused when they were trained for another trunk, unless
``any_trunk``). Training checkpoints every ``--save-every`` steps, each checkpoint one
file written whole (the head, the optimizer, and the run's record: step, history,
options, trunk, data), and ``--resume`` continues with identical state, refusing
other options than the run's; the output is a normal mlx-mtp model folder (trunk
files + heads).
"""

import contextlib
import functools
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, List, Optional

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from mlx_mtp.errors import DiskFullError, MTPError, one_line
from mlx_mtp.files import read_json, safetensors_header
from mlx_mtp.heads import (
    HEADS_FILE,
    has_heads_file,
    heads_section,
    load_heads,
    load_strict,
    provenance,
    save_heads,
    source_fingerprint,
)
from mlx_mtp.loading import load, read_config
from mlx_mtp.models.mtp import MTPLayer, MTPStack

from .distill import (
    KINDS,
    TEMP,
    TOP_P,
    conversation_rows,
    generate_replies,
    read_prompts,
    split_prompts,
)
from .output import (
    MODEL_FILES,
    check_destination,
    check_place,
    reserve,
    staged_folder,
    writing,
)

TEXT_SUFFIXES = (".py", ".rst", ".txt", ".md")
FEATURES = "features"
STATE = "state.safetensors"  # the checkpoint; its metadata holds the run's record
PROGRESS = "progress.json"  # a copy of the record to read; --resume reads the state's
RECORD = "mlx_mtp.train_heads"  # the checkpoint's metadata key of the record
FREE = ("steps", "eval_every", "save_every")  # options a resumed run may change


@dataclass
class TrainConfig:
    depth: int = 2
    seq_len: int = 256
    batch_size: int = 4
    steps: int = 1000
    tokens: Optional[int] = None  # feature tokens to compute (default: all the data)
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.01
    draft_vocab_size: int = 8192  # the heads draft from this many tokens
    held_out: float = 0.05
    eval_every: int = 100
    save_every: int = 100
    seed: int = 0
    distill: Optional[str] = None  # prompts the trunk answers ("builtin" or a file)
    distill_samples: int = 2  # replies per prompt: one greedy, the rest sampled
    soft_targets: float = 0.0  # weight of KL(trunk || head) beside the hard targets
    init_heads: Optional[str] = None  # a model folder whose heads training starts from


# --- data and features ----------------------------------------------------------------


def text_files(paths: List[str]) -> List[Path]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(
                f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file()
            )
        elif p.is_file():
            files.append(p)
        else:
            raise MTPError(f"no such data file or folder: {p}")
    if not files:
        raise MTPError("no training text found (.py, .rst, .txt, .md)")
    return files


def split_files(files: List[Path], held_out: float, seed: int):
    """Deterministic split by file: (train, held-out)."""
    order = list(files)
    random.Random(seed).shuffle(order)
    n = max(1, int(round(len(order) * held_out))) if held_out > 0 else 0
    return order[n:], order[:n]


def pack(tokenizer, files: List[Path], length: int, limit: Optional[int]) -> np.ndarray:
    """Token sequences of ``length`` (files joined by EOS), at most ``limit`` tokens."""
    eos = tokenizer.eos_token_id
    buf, rows = [], []
    for f in files:
        buf += tokenizer.encode(f.read_text(errors="ignore")) + [eos]
        while len(buf) >= length:
            rows.append(buf[:length])
            buf = buf[length:]
            if limit and len(rows) * length >= limit:
                return np.array(rows, dtype=np.int32)
    if not rows:
        raise MTPError(f"not enough text for one sequence of {length} tokens")
    return np.array(rows, dtype=np.int32)


def compute_features(
    model,
    tokens: np.ndarray,
    folder: Path,
    name: str,
    progress,
    greedy_rows: Optional[np.ndarray] = None,
) -> dict:
    """Trunk hidden states (float16) and greedy next tokens for every sequence, written
    to memory-mapped files and resumable (sequences already done are kept, also when a
    rerun asks for fewer of the same sequences).

    ``greedy_rows``, ``(n,)`` bool, marks the greedy replies: the trunk chose each of
    their reply tokens as its argmax, so their greedy tokens are their own next tokens
    (`next_tokens`) and their full-vocabulary logits are not computed (on Gemma 3's
    262k rows that is most of a feature pass)."""
    from tqdm import tqdm

    n, length = tokens.shape
    hidden_size = model.args.hidden_size
    paths = {
        k: folder / f"{name}.{k}.npy" for k in ("tokens", "hidden", "greedy", "done")
    }
    if not (paths["done"].exists() and _stored_prefix(paths["tokens"], tokens)):
        paths["done"].unlink(missing_ok=True)  # a new run: not done until reserved
        np.save(paths["tokens"], tokens)
        shapes = {"hidden": (np.float16, (n, length, hidden_size))}
        shapes["greedy"] = (np.int32, (n, length))
        for k, (dtype, shape) in shapes.items():
            np.lib.format.open_memmap(paths[k], "w+", dtype, shape)
            try:
                reserve(paths[k], paths[k].stat().st_size)
            except OSError:
                paths[k].unlink()  # sparse and useless: give the space back
                raise
        np.save(paths["done"], np.array(0))
    hidden = np.load(paths["hidden"], mmap_mode="r+")[:n]
    greedy = np.load(paths["greedy"], mmap_mode="r+")[:n]
    done = min(n, int(np.load(paths["done"])))
    bar = tqdm(
        total=n,
        initial=done,
        desc=f"features ({name})",
        unit="seq",
        disable=not progress,
    )
    for i in range(done, n):
        h = model.hidden(mx.array(tokens[i : i + 1]))  # (1, L, H)
        if greedy_rows is not None and greedy_rows[i]:
            greedy[i] = next_tokens(tokens[i])
        else:
            greedy[i] = np.array(mx.argmax(model.logits(h), axis=-1)[0])
        hidden[i] = np.array(h[0].astype(mx.float16))
        if (i + 1) % 16 == 0 or i + 1 == n:
            hidden.flush(), greedy.flush()
            np.save(paths["done"], np.array(i + 1))
        bar.update()
    bar.close()
    return {
        "tokens": tokens,
        "hidden": np.load(paths["hidden"], mmap_mode="r")[:n],
        "greedy": np.load(paths["greedy"], mmap_mode="r")[:n],
    }


def next_tokens(row: np.ndarray) -> np.ndarray:
    """``(L,)``: each position's next token in ``row`` (the last repeats itself): a
    greedy reply's greedy tokens at its reply positions."""
    return np.append(row[1:], row[-1:])


def _stored_prefix(path: Path, tokens: np.ndarray) -> bool:
    """Whether the stored feature run starts with ``tokens`` (same sequences, perhaps
    more of them): a smaller ``--tokens`` then reuses what was computed."""
    if not path.exists():
        return False
    stored = np.load(path, mmap_mode="r")
    return (
        stored.shape[1:] == tokens.shape[1:]
        and stored.shape[0] >= tokens.shape[0]
        and np.array_equal(stored[: tokens.shape[0]], tokens)
    )


# --- the head -------------------------------------------------------------------------


def init_head(model, family, draft_vocab: np.ndarray) -> MTPStack:
    """One MTP layer: block = copy of the trunk's last layer, ``eh_proj`` passing the
    hidden state through, norms from the trunk."""
    layer: MTPLayer = family.make_layer(model.trunk, 0, read_config(model.source))
    last = model.trunk.layers[-1]
    layer.block.update(tree_map(lambda x: x, last.parameters()))
    H = model.args.hidden_size
    layer.eh_proj.weight = mx.concatenate(
        [0.01 * mx.random.normal((H, H)), mx.eye(H)], axis=1
    )
    layer.norm.weight = mx.array(family.final_norm(model.trunk).weight)
    stack = MTPStack([layer], len(draft_vocab))
    stack.draft_vocab = mx.array(draft_vocab, dtype=mx.int32)
    return stack


def warm_start(model, family, path: str, any_trunk: bool = False) -> MTPStack:
    """The heads of the model folder ``path`` (one chained layer for this trunk, as
    `train_heads` writes them) as a float stack to train on from, with their draft
    vocabulary; quantized weights are dequantized. Heads trained for another trunk
    are refused (`_check_lineage`) unless ``any_trunk``."""
    folder = _model_dir(path)
    config = read_config(folder)
    if not has_heads_file(config):
        raise MTPError(f"{path} holds no MTP heads to start training from")
    if not any_trunk:
        _check_lineage(path, folder, config, Path(model.source))
    heads = load_heads(folder, config, family, model.trunk)
    if len(heads.layers) != 1 or "draft_vocab" not in heads:
        raise MTPError(
            f"{path}: training starts from one MTP layer with a draft vocabulary "
            "(heads that train-heads wrote)"
        )
    vocab = np.array(heads.draft_vocab, dtype=np.int32)
    stack = init_head(model, family, vocab)
    weights = dict(tree_flatten(heads.parameters()))
    for name, m in heads.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            prefix = f"{name}." if name else ""
            for part in ("scales", "biases"):
                weights.pop(prefix + part, None)
            weights[prefix + "weight"] = mx.dequantize(
                m.weight, m.scales, m.biases, m.group_size, m.bits
            )
    return load_strict(stack, weights)


def _check_lineage(path: str, folder: Path, config: dict, trunk: Path) -> None:
    """Refuse heads trained for another trunk than ``trunk``: the trunk fingerprint
    (`source_fingerprint`: its embedding) that train-heads records with the heads, else
    that of the trunk files ``folder`` holds beside them, against ``trunk``'s. Not
    checked when either is unknown (no safetensors embedding to read)."""
    record = config["mtp"].get("provenance") or {}
    theirs = record.get("trunk_fingerprint") or source_fingerprint(folder)
    ours = source_fingerprint(trunk)
    if theirs and ours and theirs != ours:
        where = record.get("trained_from") or "a trunk with other weights"
        raise MTPError(
            f"--init-heads {path}: these heads were trained for another trunk "
            f"({where}), not {trunk} (their embeddings differ); pass --any-trunk to "
            "start from them anyway (a fine-tune or another quantization of it)"
        )


def draft_weight(model, vocab: mx.array) -> mx.array:
    """Rows of the trunk's output projection (the family's ``output_head``: its
    ``lm_head``, or the tied embedding) for the draft vocabulary, (V', H),
    dequantized."""
    head = model.family.output_head(model.trunk)
    if head is None:
        raise MTPError(
            f"cannot train heads for {model.family.name}: its logits are not one "
            "projection of the hidden state"
        )
    w = head.weight
    if hasattr(head, "scales"):
        w = mx.dequantize(w, head.scales, head.biases, head.group_size, head.bits)
    return w[vocab].astype(mx.float32)


class ChainCache:
    """The MTP layer's KV cache as the runtime holds it when a draft at depth j
    runs (the training-time test of EAGLE-3): the depth-1 entries of every position
    up to the row's (as the MTP cache keeps them), then the row's own entries of the
    chained depths 2..j-1, each at the next position. ``offset`` places the calls'
    rows (row i of depth j sits at position i + j - 1); `chain_mask` says which
    entries each row reads."""

    def __init__(self, offset: int = 0, kept: Optional[list] = None):
        self.offset, self.kept = offset, list(kept or [])

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Keep this depth's ``(B, heads, rows, d)`` keys and values; return every
        depth's so far, side by side on the key axis."""
        self.kept.append((keys, values))
        return (
            mx.concatenate([k for k, _ in self.kept], axis=2),
            mx.concatenate([v for _, v in self.kept], axis=2),
        )


def chain_mask(rows: int, depth: int) -> mx.array:
    """``(rows, depth * rows)``: row i of depth ``depth`` reads the depth-1 entries
    of rows 0..i and its own entry of each later depth."""
    causal = mx.tril(mx.ones((rows, rows), dtype=mx.bool_))
    own = mx.eye(rows, dtype=mx.bool_)
    return mx.concatenate([causal] + [own] * (depth - 1), axis=1)


def chained_outputs(stack, model, h: mx.array, x: mx.array, depth: int) -> list:
    """The MTP layer's ``(B, rows, H)`` outputs at depths 1..``depth`` for rows
    0..L-depth-1 of ``(B, L, H)`` hidden states ``h`` and ``(B, L)`` tokens ``x``,
    each computed as the runtime chains the layer: depth j's row i reads what the
    MTP cache holds then (`ChainCache`), not a sequence of depth-j rows."""
    rows = x.shape[1] - depth
    z, kept, out = h[:, :rows], [], []
    for j in range(1, depth + 1):
        e = model.embed(x[:, j : rows + j])  # (B, rows, H)
        if j == 1 and model.family.MASK_FIRST_POSITION:  # as `Model.mtp_forward`
            e = mx.where((mx.arange(rows) > 0)[None, :, None], e, mx.zeros_like(e))
        cache = ChainCache(j - 1, kept)
        z = stack.layers[0](e, z, chain_mask(rows, j), cache)
        kept = cache.kept
        out.append(z)
    return out


def losses(stack, model, W, remap, batch, depth: int, soft: float = 0.0):
    """Per depth, ``(loss, correct, count, hit)`` on a batch of feature rows, the
    depths chained as the runtime chains them (`chained_outputs`): the mean loss over
    the weighted positions (cross-entropy with the trunk's greedy token, mixed with
    ``soft`` times KL(trunk || head) over the draft vocabulary), how many drafts
    equal the trunk's token, how many positions count, and ``(B, rows)`` which
    drafts do."""
    h, x, g, w = batch  # (B, L, H), (B, L), (B, L), (B, L)
    rows = x.shape[1] - depth
    out = []
    for j, z in enumerate(chained_outputs(stack, model, h, x, depth), 1):
        logits = z @ W.T  # (B, rows, V')
        target = remap[g[:, j : rows + j]]  # -1 outside the draft vocabulary
        counted = w[:, j : rows + j] > 0
        valid = (target >= 0) & counted
        ce = nn.losses.cross_entropy(logits, mx.maximum(target, 0), reduction="none")
        loss = (ce * valid).sum() / mx.maximum(valid.sum(), 1)
        if soft:
            loss = (1 - soft) * loss + soft * _kl(
                h[:, j : rows + j] @ W.T, logits, counted
            )
        hit = (mx.argmax(logits, axis=-1) == target) & valid
        out.append((loss, hit.sum(), counted.sum(), hit))
    return out


def _kl(teacher: mx.array, student: mx.array, mask: mx.array) -> mx.array:
    """Mean KL(teacher || student) over the masked positions of ``(B, rows, V')``
    logits: the trunk's distribution over the draft vocabulary is the soft target."""
    t = mx.stop_gradient(teacher - mx.logsumexp(teacher, axis=-1, keepdims=True))
    s = student - mx.logsumexp(student, axis=-1, keepdims=True)
    kl = (mx.exp(t) * (t - s)).sum(axis=-1)  # (B, rows)
    return (kl * mask).sum() / mx.maximum(mask.sum(), 1)


# --- training -------------------------------------------------------------------------


def train_heads(
    model_path: str,
    data: List[str],
    mlx_path: str,
    cfg: TrainConfig = TrainConfig(),
    *,
    work_dir: Optional[str] = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    on_eval: Optional[Callable[[int, List[float]], None]] = None,
    trust_remote_code: bool = False,
    any_trunk: bool = False,
) -> Path:
    """Train MTP heads for ``model_path`` on text ``data``; write the model to
    ``mlx_path``.

    Everything is checked before the work folder is made: the output may not replace
    anything but a model folder (see `mlx_mtp.convert.output.check_destination`), the
    data must fill one sequence, ``cfg.init_heads`` must be heads trained for this
    trunk (unless ``any_trunk``: e.g. the heads of the model a fine-tune started
    from). A full disk is one `MTPError`; the work folder is kept for ``resume``.

    ``resume`` continues the run whose checkpoint is in the work folder, exactly: with
    its options (`_check_resumable`: the same trunk, data and `TrainConfig` but for
    ``eval_every``, ``save_every``, and ``steps``, which may grow to train longer, the
    learning-rate schedule then being that of the new length). A checkpoint that
    cannot be read is one `MTPError`.
    """
    from tqdm import tqdm

    out = Path(mlx_path).expanduser()
    work = Path(work_dir).expanduser() if work_dir else out.parent / f"{out.name}.train"
    if not data and not cfg.distill:
        raise MTPError("nothing to train on: give --data, --distill, or both")
    files = text_files(data) if data else []
    prompts = read_prompts(cfg.distill) if cfg.distill else []
    model_dir = _model_dir(model_path)
    check_destination(out, overwrite, sources=[model_dir], inputs=data)
    check_place(work, [model_dir, out], data, what="work folder")
    run = _run_of(model_dir, data)
    stored = None
    if (work / STATE).exists() or (work / PROGRESS).exists():
        if not resume:
            raise MTPError(f"{work} holds a training run: pass --resume, or remove it")
        if (work / STATE).exists():
            stored = _stored_run(work)
            _check_resumable(work, stored, run, cfg)
    model, tokenizer = load(
        str(model_dir), allow_missing_heads=True, trust_remote_code=trust_remote_code
    )
    family = model.family
    mx.random.seed(cfg.seed)
    start = None
    if cfg.init_heads:
        start = warm_start(model, family, cfg.init_heads, any_trunk)
    if files:
        train_files, eval_files = split_files(files, cfg.held_out, cfg.seed)
        train_tok = pack(tokenizer, train_files, cfg.seq_len, cfg.tokens)
    work.mkdir(parents=True, exist_ok=True)  # inputs checked: nothing half-made
    with _kept_on_full_disk(work):
        sets, evals, distilled = [], {}, None
        if files:
            sets.append(compute_features(model, train_tok, work, "train", progress))
            evals.update(
                held_out_features(model, tokenizer, eval_files, cfg, work, progress)
            )
        if prompts:
            d_train, d_evals, distilled = distilled_features(
                model, tokenizer, prompts, cfg, work, progress
            )
            sets.append(d_train)
            evals.update(d_evals)
        feats = Features(sets)

        counts = feats.greedy_counts(model.args.vocab_size)
        if start is not None:  # checked before any reply or feature is made
            stack = start
            vocab = np.array(stack.draft_vocab, dtype=np.int32)
        else:
            top = np.argsort(-counts, kind="stable")[: cfg.draft_vocab_size]
            vocab = np.sort(top).astype(np.int32)
            stack = init_head(model, family, vocab)
        remap_np = np.full(counts.shape[0], -1, dtype=np.int32)
        remap_np[vocab] = np.arange(len(vocab), dtype=np.int32)
        remap, W = mx.array(remap_np), draft_weight(model, mx.array(vocab))
        coverage = counts[vocab].sum() / max(counts.sum(), 1)

        stack.freeze(keys=["draft_vocab"], recurse=False)
        model.trunk.freeze()
        schedule = optim.join_schedules(
            [
                optim.linear_schedule(cfg.lr / 100, cfg.lr, cfg.warmup),
                optim.cosine_decay(cfg.lr, max(1, cfg.steps - cfg.warmup), cfg.lr / 20),
            ],
            [cfg.warmup],
        )
        opt = optim.AdamW(learning_rate=schedule, weight_decay=cfg.weight_decay)
        step, history = 0, []
        if stored is not None:
            step, history = _restore(work, stack, opt, stored)
        update = compile_step(stack, opt, model, W, remap, cfg.depth, cfg.soft_targets)
        n = len(feats)
        bar = tqdm(
            total=cfg.steps,
            initial=step,
            desc="train",
            unit="step",
            disable=not progress,
        )
        while step < cfg.steps:
            idx = _batch_indices(n, cfg.batch_size, step, cfg.seed)
            loss = update(feats.batch(idx))
            mx.eval(stack.parameters(), opt.state, loss)
            step += 1
            bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update()
            if evals and (step % cfg.eval_every == 0 or step == cfg.steps):
                scores = {
                    kind: evaluate(stack, model, W, remap, f, cfg.depth)
                    for kind, f in evals.items()
                }
                by_kind = {k: a for k, (a, _) in scores.items()}
                agree = _pooled(by_kind, evals)
                history.append(
                    {
                        "step": step,
                        "tokens": step * cfg.batch_size * cfg.seq_len,
                        "loss": loss.item(),
                        "agreement": agree,
                        "by_kind": by_kind,
                        "conditional_by_kind": {k: c for k, (_, c) in scores.items()},
                    }
                )
                bar.write(
                    f"step {step}: held-out agreement per depth "
                    + "; ".join(
                        f"{kind} " + " ".join(f"{a:.3f}" for a in a_k)
                        for kind, a_k in by_kind.items()
                    )
                )
                if on_eval:
                    on_eval(step, agree)
            if step % cfg.save_every == 0 or step == cfg.steps:
                record = {"step": step, "history": history, "config": asdict(cfg)}
                record.update(coverage=coverage, run=run)
                _save_state(work, stack, opt, record)
        bar.close()
        return _write_model(
            model_dir,
            out,
            stack,
            cfg,
            history,
            coverage,
            overwrite,
            trust_remote_code,
            distilled,
        )


def compile_step(stack, opt, model, W, remap, depth, soft, compiled=False):
    """``update(batch) -> loss``: one optimizer step of ``stack`` on a batch, the
    depths' losses weighted 1, 1/2, 1/4, ...; with ``compiled``, one `mx.compile`d
    graph whose state is the head's parameters and the optimizer's (so call this
    after restoring them). Not compiled by default: on a CPU it gains nothing
    (3.74 against 3.60 s a step, `scripts/train_step_cost.py`)."""
    weights = mx.array([0.5**j for j in range(depth)])

    def loss_fn(stack, batch):
        parts = losses(stack, model, W, remap, batch, depth, soft)
        return sum(w * p[0] for w, p in zip(weights, parts)) / weights.sum()

    grad_fn = nn.value_and_grad(stack, loss_fn)

    def update(batch):
        loss, grads = grad_fn(stack, batch)
        opt.update(stack, grads)
        return loss

    if not compiled:
        return update
    state = [stack.state, opt.state]
    return functools.partial(mx.compile, inputs=state, outputs=state)(update)


@contextlib.contextmanager
def _kept_on_full_disk(work: Path):
    """A full disk is one `DiskFullError` that says the work folder can be resumed."""
    kept = f"free some space and rerun with --resume ({work} keeps what was computed)"
    try:
        with writing(work / FEATURES, kept):
            yield
    except DiskFullError as e:
        if kept in str(e):
            raise
        raise DiskFullError(f"{e}; {kept}") from None


def held_out_features(model, tokenizer, files, cfg, work, progress) -> dict:
    """Held-out features per kind of text, ``code`` (.py) and ``prose`` (the rest), up
    to 24 sequences each; a kind with too little text is left out."""
    kinds = {
        "code": [f for f in files if f.suffix == ".py"],
        "prose": [f for f in files if f.suffix != ".py"],
    }
    sets = {}
    for kind, kind_files in kinds.items():
        if not kind_files:
            continue
        try:
            tokens = pack(tokenizer, kind_files, cfg.seq_len, 24 * cfg.seq_len)
        except MTPError:
            continue
        sets[kind] = compute_features(model, tokens, work, f"eval-{kind}", progress)
    return sets


def distilled_features(model, tokenizer, prompts, cfg, work, progress):
    """Self-distillation (`mlx_mtp.convert.distill`): the trunk answers the training
    prompts ``cfg.distill_samples`` times and the held-out ones greedily, one
    conversation a row. Returns ``(train features, held-out features per kind
    ("code replies", "chat replies"), provenance record)``."""
    train_p, held_p = split_prompts(prompts, cfg.held_out, cfg.seed)
    pad = tokenizer.eos_token_id
    evals = {}
    if held_p:
        path = work / "replies.eval.jsonl"
        recs = generate_replies(
            model, tokenizer, held_p, 1, cfg.seq_len, path, cfg.seed, progress=progress
        )
        for kind in KINDS:
            tokens, weights = conversation_rows(recs, cfg.seq_len, pad, kind)
            if len(tokens):
                name = f"eval-{kind}-replies"
                greedy = np.ones(len(tokens), dtype=bool)  # one greedy reply each
                f = compute_features(model, tokens, work, name, progress, greedy)
                evals[f"{kind} replies"] = {**f, "weight": weights}
    path = work / "replies.train.jsonl"
    samples = cfg.distill_samples
    recs = generate_replies(
        model,
        tokenizer,
        train_p,
        samples,
        cfg.seq_len,
        path,
        cfg.seed,
        limit=cfg.tokens,
        progress=progress,
    )
    tokens, weights = conversation_rows(recs, cfg.seq_len, pad)
    greedy = np.array([r["sample"] == 0 for r in recs], dtype=bool)
    train = {**compute_features(model, tokens, work, "distill", progress, greedy)}
    train["weight"] = weights
    record = {
        "prompts": cfg.distill,
        "train_prompts": len(train_p),
        "held_out_prompts": len(held_p),
        "replies": len(recs),
        "reply_tokens": int(sum(len(r["tokens"]) - r["reply_start"] for r in recs)),
        "train_only_prompts": sum(p.train_only for p in train_p),
        "sampling": (
            f"sample 0 greedy, then temp {TEMP}, top_p {TOP_P}"
            if samples > 1
            else "greedy"
        ),
        "chat_template": bool(getattr(tokenizer, "has_chat_template", False)),
    }
    return train, evals, record


def _pooled(by_kind: dict, evals: dict) -> List[float]:
    """Agreement per depth over all held-out sequences."""
    sizes = {k: f["tokens"].shape[0] for k, f in evals.items()}
    total = sum(sizes.values())
    depth = len(next(iter(by_kind.values())))
    return [
        sum(by_kind[k][d] * sizes[k] for k in by_kind) / total for d in range(depth)
    ]


def evaluate(stack, model, W, remap, feats, depth: int):
    """Held-out agreement with the trunk's greedy token per draft depth, and per
    depth the conditional agreement a decoding loop sees (depth j's draft agrees,
    given that depths 1..j-1 did): ``(agreement, conditional)``."""
    n = feats["tokens"].shape[0]
    hits, counts, chains = np.zeros(depth), np.zeros(depth), np.zeros(depth + 1)
    for start in range(0, n, 4):
        batch = _batch(feats, np.arange(start, min(n, start + 4)))
        parts = losses(stack, model, W, remap, batch, depth)
        chain = batch[3][:, 1 : 1 + parts[0][3].shape[1]] > 0  # row i is drafted
        chained = [chain]
        for _, _, _, hit in parts:
            chain = chain & hit
            chained.append(chain)
        mx.eval(parts, chained)
        hits += [p[1].item() for p in parts]
        counts += [p[2].item() for p in parts]
        chains += [c.sum().item() for c in chained]
    agreement = [float(h / max(c, 1)) for h, c in zip(hits, counts)]
    conditional = [float(chains[j + 1] / max(chains[j], 1)) for j in range(depth)]
    return agreement, conditional


class Features:
    """The training rows of several feature sets, indexed as one."""

    def __init__(self, sets: List[dict]):
        self.sets = sets
        self.starts = np.cumsum([0] + [f["tokens"].shape[0] for f in sets])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def batch(self, idx: np.ndarray):
        """``(h, x, g, w)`` of the rows ``idx``, as `_batch`."""
        idx = np.sort(idx)
        parts = []
        for f, lo, hi in zip(self.sets, self.starts[:-1], self.starts[1:]):
            mine = idx[(idx >= lo) & (idx < hi)] - lo
            if len(mine):
                parts.append(_batch(f, mine))
        return tuple(mx.concatenate(a) for a in zip(*parts))

    def greedy_counts(self, vocab_size: int) -> np.ndarray:
        """How often the trunk emits each token at a trained position."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        for f in self.sets:
            g = np.asarray(f["greedy"])
            if "weight" in f:
                g = g[np.asarray(f["weight"])[:, : g.shape[1]] > 0]
            counts += np.bincount(g.ravel(), minlength=vocab_size)[:vocab_size]
        return counts


def _batch(feats: dict, idx: np.ndarray):
    """``(h, x, g, w)``: hidden states, tokens, the trunk's greedy tokens and the
    positions' weights (every position of source text; reply positions of a
    conversation) of the feature rows ``idx``."""
    idx = np.sort(idx)
    x = feats["tokens"][idx]
    w = feats["weight"][idx] if "weight" in feats else np.ones_like(x, np.uint8)
    return (
        mx.array(np.asarray(feats["hidden"][idx], dtype=np.float32)),
        mx.array(x),
        mx.array(np.asarray(feats["greedy"][idx])),
        mx.array(w),
    )


def _batch_indices(n: int, batch: int, step: int, seed: int) -> np.ndarray:
    """Epoch-wise permutations, a pure function of (seed, step): resumable exactly."""
    per_epoch = max(1, n // batch)
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[i * batch : (i + 1) * batch] if n >= batch else order


def _save_state(work: Path, stack, opt, record: dict) -> None:
    """Checkpoint: the head's parameters, the optimizer's state and the run's
    ``record`` (step, history, config, coverage, run) in one safetensors file (the
    record in its metadata), written whole and renamed into place, so that a crash at
    any point leaves the previous checkpoint or this one; then ``progress.json``, a
    copy of the record for people and scripts (never read back)."""
    state = dict(tree_flatten(stack.parameters()))
    state.update({f"opt.{k}": v for k, v in tree_flatten(opt.state)})
    tmp = work / f".{STATE}"
    mx.save_safetensors(str(tmp), state, metadata={RECORD: json.dumps(record)})
    _synced(tmp).replace(work / STATE)
    tmp = work / f".{PROGRESS}"
    tmp.write_text(json.dumps(record, indent=2))
    _synced(tmp).replace(work / PROGRESS)


def _synced(path: Path) -> Path:
    """``path``, its bytes on disk (so that a rename never publishes a torn file)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def _stored_run(work: Path) -> dict:
    """The record of the checkpoint in ``work`` (`_save_state`); for a checkpoint an
    earlier mlx-mtp wrote (no record inside), ``progress.json`` at the step the
    checkpoint's optimizer counted. A damaged checkpoint is one `MTPError`."""
    path = work / STATE
    try:
        metadata = _metadata(path)
        if RECORD in metadata:
            record = json.loads(metadata[RECORD])
        else:
            record = _earlier_record(work)
        if not (
            isinstance(record, dict)
            and isinstance(record.get("step"), int)
            and isinstance(record.get("history"), list)
            and isinstance(record.get("config"), dict)
        ):
            raise ValueError("its record of the run is incomplete")
    except (ValueError, KeyError, TypeError, RuntimeError, OSError) as e:
        raise _damaged(work, e) from None
    return record


def _damaged(work: Path, e: BaseException) -> MTPError:
    """The one line for a checkpoint that cannot be resumed from, saying why."""
    path = work / STATE
    why = str(e) if isinstance(e, MTPError) else f"{path}: {one_line(e)}"
    return MTPError(
        f"cannot resume the run in {work}: {why}; remove {path} and resume to train "
        f"again from step 0 (the features in {work} are kept)"
    )


def _metadata(path: Path) -> dict:
    """The ``__metadata__`` of the safetensors file ``path``, its tensors checked to
    lie inside it (`safetensors_header`: a truncated file is an `MTPError`)."""
    safetensors_header(path)
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ValueError("its metadata is not an object")
    return metadata


def _earlier_record(work: Path) -> dict:
    """The record of a checkpoint written before it held one: ``progress.json``,
    written after the checkpoint, so from the same step or (after a crash between the
    two) the one before; the step is the optimizer's own count, the history cut
    there."""
    record = read_json(work / PROGRESS, "the run's record")
    step = int(mx.load(str(work / STATE))["opt.step"].item())
    record["history"] = [h for h in record["history"] if h["step"] <= step]
    return {**record, "step": step}


def _run_of(model_dir: Path, data: List[str]) -> dict:
    """What a resumed run must share with its checkpoint beside its `TrainConfig`:
    the trunk (its weights' fingerprint, else its folder) and the data."""
    return {
        "model": str(Path(model_dir).resolve()),
        "trunk_fingerprint": source_fingerprint(model_dir),
        "data": [str(Path(d).expanduser().resolve()) for d in data],
    }


def _check_resumable(work: Path, stored: dict, run: dict, cfg: TrainConfig) -> None:
    """Refuse, in one line naming the options, to resume the run of ``stored`` (its
    checkpoint's record) with other options than its own, or with fewer ``steps``
    than it has trained: resuming continues that run, exactly."""
    differ = []  # (stored, given), as options
    config = stored["config"]
    for f in fields(TrainConfig):
        old, new = config.get(f.name, f.default), getattr(cfg, f.name)
        if f.name not in FREE and not _same(old, new):
            flag = "--" + f.name.replace("_", "-")
            differ.append((f"{flag} {old}", f"{flag} {new}"))
    theirs = stored.get("run") or {}  # none from an earlier mlx-mtp
    if theirs and not _same_trunk(theirs, run):
        differ.append((f"--model {theirs['model']}", f"--model {run['model']}"))
    if theirs and theirs.get("data") != run["data"]:
        differ.append((_data_flags(theirs.get("data")), _data_flags(run["data"])))
    if differ:
        was, given = (" ".join(side) for side in zip(*differ))
        raise MTPError(
            f"cannot resume the run in {work}: it was started with {was}, not "
            f"{given} (give its options again, or remove {work} to start another run)"
        )
    if cfg.steps < stored["step"]:
        raise MTPError(
            f"the run in {work} has trained {stored['step']} steps, more than --steps "
            f"{cfg.steps}: give --steps {stored['step']} or more to resume it"
        )


def _same(old, new) -> bool:
    """Whether a stored option equals a given one; paths (``distill``,
    ``init_heads``) compare as the files they name."""
    if old == new:
        return True
    if isinstance(old, str) and isinstance(new, str) and os.path.exists(new):
        return os.path.exists(old) and os.path.samefile(old, new)
    return False


def _same_trunk(theirs: dict, ours: dict) -> bool:
    a, b = theirs.get("trunk_fingerprint"), ours["trunk_fingerprint"]
    return a == b if a and b else _same(theirs.get("model"), ours["model"])


def _data_flags(data) -> str:
    return " ".join(f"--data {d}" for d in data) if data else "no --data"


def _restore(work: Path, stack, opt, record: dict):
    """Load the checkpoint of ``record`` (`_stored_run`) into ``stack`` and ``opt``:
    ``(step, history)``."""
    path = work / STATE
    try:
        state = mx.load(str(path))
        weights = [(k, v) for k, v in state.items() if not k.startswith("opt.")]
        stack.load_weights(weights)
        opt.state = tree_unflatten(
            [(k[4:], v) for k, v in state.items() if k.startswith("opt.")]
        )
        counted = int(opt.state["step"].item())
    except (ValueError, KeyError, RuntimeError) as e:
        raise _damaged(work, e) from None
    if counted != record["step"]:
        why = f"its optimizer counts {counted} steps, its record {record['step']}"
        raise _damaged(work, ValueError(why))
    return record["step"], record["history"]


def _model_dir(model_path: str) -> Path:
    from mlx_mtp.loading import resolve

    return resolve(model_path)


def _copied(f: Path, code: bool) -> bool:
    """Whether the output takes the trunk's file ``f``: model files (`MODEL_FILES`),
    not the config and heads it writes itself, Python code only with ``code``."""
    if not f.is_file() or f.name in ("config.json", "mtp.safetensors", "README.md"):
        return False
    return any(f.match(p) for p in MODEL_FILES) and (code or f.suffix != ".py")


def _write_model(
    src: Path, out: Path, stack, cfg, history, coverage, overwrite, code, distilled
) -> Path:
    """The trunk's files plus the heads: a folder mlx-mtp loads with its MTP layer."""
    config = read_config(src)
    training = {
        "config": asdict(cfg),
        "history": history[-1:] if history else [],
        "draft_vocab_coverage": coverage,
    }
    if distilled:
        training["distilled"] = distilled
    if cfg.init_heads:  # the lineage: how the heads it started from were trained
        earlier = read_config(_model_dir(cfg.init_heads))["mtp"].get("provenance", {})
        training["started_from"] = earlier.get("training")
        training["started_from_trunk"] = earlier.get("trained_from")
    record = provenance(
        None,
        16,
        trained_from=str(Path(src).resolve()),
        trunk_fingerprint=source_fingerprint(src),
        training=training,
    )
    config.pop("mtp", None)
    config["num_nextn_predict_layers"] = len(stack.layers)
    with staged_folder(out, overwrite, [src]) as tmp:
        for f in src.iterdir():
            if _copied(f, code):
                shutil.copy2(f, tmp / f.name)
        save_heads(tmp / HEADS_FILE, stack)
        config["mtp"] = heads_section(stack, None, record)
        (tmp / "config.json").write_text(json.dumps(config, indent=4))
    return out
