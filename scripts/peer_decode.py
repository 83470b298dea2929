"""Greedy speculative decoding by two peer runtimes, mlx-dspark and mlx-vlm, on a
Qwen3 target with a DSpark drafter: their own round loops, loaded once and run as
often as a benchmark likes, so that it can time them beside mlx-mtp's.

    PYTHONPATH=VLM:VLMDEPS:DSPARK python scripts/peer_decode.py

The peers are installed apart (see peer_dspark.py): mlx-vlm 0.7.10 in VLM (its
pillow in VLMDEPS) and mlx-dspark 0.20.3 in DSPARK (which imports mlx-vlm). Importing
this module needs neither: each peer is imported when it is loaded.

- `DsparkPeer`: mlx-dspark's ``speculative_generate`` (its DSpark loop; its
  ``dflash_generate`` is the loop of z-lab's DFlash drafters, which read the mask
  slots and have no Markov head), the target through its ``load_target`` (mlx-lm,
  with its hidden-state tap, checked at load) and the drafter through its
  ``load_drafter`` in float: that loader quantizes the drafter to 4 bits unless told
  not to. It reads DeepSpec's folder (the drafter keys at the top level).
- `VlmPeer`: mlx-vlm's ``generate_step`` with a ``draft_model``, which prefills the
  prompt with the taps and runs ``speculative.dflash._dflash_rounds`` (DSpark is its
  "dflash" kind), the target through ``mlx_vlm.utils.load_model`` and the drafter
  through ``speculative.drafters.load_drafter``. It reads the nested spelling
  (``dflash_config``). mlx-vlm 0.7.10 cannot run a dense Qwen3 target as shipped: its
  ``qwen3`` language model neither captures hidden states (it drops
  ``capture_layer_ids``) nor offers ``rollback_speculative_cache``, so
  ``validate_dflash_target`` refuses it ("does not expose speculative cache rollback
  support"); only its hybrid and other tapped families (qwen3_5, gemma4, laguna,
  lfm2, nemotron_h, ...) can. `VlmPeer` therefore gives that model the two missing
  pieces, as its qwen3_5 model has them: the taps (the residual stream after each
  listed layer) and a verify that runs mlx-vlm's own ``verify_forward`` inside its
  cache transaction, committed by its ``rollback_speculative_cache``. Drafting,
  verification, the walk, the rollback and the block-size policy are mlx-vlm's code.

Both peers verify every draft and take the target's argmax, so at temperature 0
their tokens are the target's plain greedy decoding (the self-check checks this
against mlx-lm), and neither casts float32 weights: the float fixtures stay float32.
Each ``generate`` returns a dict:

- ``tokens``: the generated ids, without the prompt, at most ``max_tokens``;
- ``seconds``: wall time of the call, prefill included (load excluded; perf_counter
  around the peer's call, after any setup such as calibration lookups);
- ``prefill_s``, ``decode_s``: the prompt's prefill (to the first token) and the rest;
  mlx-dspark times them itself (``GenResult.prefill_seconds``), mlx-vlm's are timed
  here (to the first token its generator yields, then to the last);
- ``passes``: target forward passes, the prefill's included (1 + ``rounds``);
  ``rounds``: speculative rounds (one verify each); ``drafted``, ``accepted``: draft
  tokens verified and accepted over them; ``tokens_per_pass``: tokens / passes;
- ``blocks``: the draft length of each round; ``settings``: what the call ran with.

Passes compare across runtimes with one caveat: both peers take the first token
from the prefill alone and draft from it, while mlx-mtp drafts a block from the
prompt's last token and verifies it within the prefill, so on the same acceptance it
can take one pass fewer (the self-check's vocabulary-64 pair shows it).

Greedy only. The first call after a load pays one-time costs (buffers, the drafter's
fused context projection): time a warm-up call apart. A benchmark run in this
environment should apply the same BLAS switch (scripts/fast_blas.py) to the peers.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Union

PEER_PATHS = ("/work/peers/vlm", "/work/peers/vlmdeps", "/work/peers/dspark")

Block = Union[int, str, None]


def _eos_ids(target_dir) -> set:
    """The ``eos_token_id`` entries of the target's config."""
    eos = json.loads((Path(target_dir) / "config.json").read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def _result(tokens, start, first, end, rounds, drafted, accepted, blocks, settings):
    passes = 1 + rounds
    return {
        "tokens": tokens,
        "seconds": end - start,
        "prefill_s": first - start,
        "decode_s": end - first,
        "passes": passes,
        "rounds": rounds,
        "drafted": drafted,
        "accepted": accepted,
        "tokens_per_pass": len(tokens) / passes,
        "blocks": blocks,
        "settings": settings,
    }


class _NoStop:
    """A tokenizer for mlx-dspark's loops that names no end token, so that they run
    to ``max_new_tokens`` (mlx-dspark stops at its tokenizer's end tokens, its
    ``eos_token_ids``: the config's plus ``<|im_end|>``, ``<|endoftext|>``, ...)."""

    eos_token_ids = ()
    eos_token_id = None
    unk_token_id = None
    chat_template = None

    def __init__(self, tokenizer=None):
        self._tokenizer = tokenizer

    def convert_tokens_to_ids(self, token):
        raise KeyError(token)

    def decode(self, ids):
        return "" if self._tokenizer is None else self._tokenizer.decode(ids)


class DsparkPeer:
    """mlx-dspark 0.20.3's DSpark loop (``generate.speculative_generate``, batch 1).

    ``DsparkPeer(target_dir, drafter_dir)`` loads the target with
    ``load.load_target(require_tap=True)`` (mlx-lm's loader, so the folder needs
    tokenizer files; without them the target is built with ``mlx_lm.utils.load_model``
    and the same ``Target`` wrapper and tap check) and the drafter (DeepSpec's
    folder) with ``load.load_drafter(quantize=False)``. The drafter reads the
    target's embedding and head when its folder has none (``speculative_generate``
    binds them).

    Settings, with mlx-dspark's defaults:

    - ``block`` (per call): the draft length, mlx-dspark's cap ``max_draft_tokens``
      (drafted and verified per round, at most the drafter's ``max_draft`` =
      ``block_size`` - ``logits_start``, 4 on the fixture). An int is a fixed cap;
      ``"full"`` the whole block; ``"static"`` the cap its CLI takes when none is
      given (``calibrate.static_cap``: the argmax of a cost model over verify
      timings it measures once, about 2-5 s, cached in ``calibration_dir``);
      ``"auto"`` its per-round ``CapController`` (``--max-draft auto``), fresh for
      each call from the same cached calibration. ``None`` is ``"static"``, the CLI's
      default. (The library's own default is a cap of 2.)
    - ``lookup``: hybrid n-gram lookup drafts (a 4-gram match in the context is
      verified instead of a drafter block). mlx-dspark's library and its CLI (for a
      pair its registry does not list) default to on; ``None`` takes that pair
      default, ``False`` runs the drafter alone.
    - ``drafter_window``: the drafter's context window (rows its block attends);
      ``None`` is the CLI's pair default (4096), 0 the whole context. It only
      matters past 4096 context rows.
    - ``confidence_threshold``: the confidence head's cut of a block (0: off, the
      default of both its library and CLI).
    - Off in the library, set by its CLI from Metal calibrations (Apple GPU kernels,
      not wrapped here): ``SMALL_M_IDS`` (4/8-bit verify matmuls), ``SDPA_SPLIT_CFG``,
      ``MULTIROW_CFG``, ``WIDE_GEMM_*``, ``CPU_SPLIT``. ``PREFILL_LAST_ROW_HEAD``
      (on) projects only the prompt's last row to the vocabulary.

    Its round loop draws drafts and verifies them in one graph with one sync per
    round; it may commit a few tokens past ``max_tokens`` (the cap is not clipped to
    the budget), which ``generate`` drops. It stops at its tokenizer's end tokens
    only with ``stop_at_eos`` (and a tokenizer). ``calibration_dir``: where
    ``"static"`` and ``"auto"`` keep their timings (None: mlx-dspark's
    ``~/.cache/mlx_dspark``).
    """

    name = "mlx-dspark"

    def __init__(
        self,
        target_dir,
        drafter_dir,
        *,
        lookup: Optional[bool] = None,
        drafter_window: Optional[int] = None,
        confidence_threshold: float = 0.0,
        calibration_dir=None,
    ):
        from mlx_dspark.load import (
            load_drafter,
            load_target,
            lookup_drafts_default,
            resolve_drafter_window,
        )

        self.target_dir, self.drafter_dir = str(target_dir), str(drafter_dir)
        if any(Path(target_dir).glob("tokenizer*.json")):
            self.target, self.tokenizer = load_target(self.target_dir, require_tap=True)
        else:
            from mlx_dspark.target import Target
            from mlx_lm.utils import load_model

            model = load_model(Path(target_dir))[0]
            self.target, self.tokenizer = Target(model, None), None
            self.target.verify_tap()
        self.drafter, self.config = load_drafter(self.drafter_dir, quantize=False)
        self.drafter.ctx_window = resolve_drafter_window(
            drafter_window, self.target_dir
        )
        self.lookup = (
            lookup_drafts_default(self.target_dir) if lookup is None else lookup
        )
        self.confidence_threshold = confidence_threshold
        self.calibration_dir = None if calibration_dir is None else str(calibration_dir)

    def _cap(self, block: Block):
        """(max_draft_tokens, cap_controller) for ``block``."""
        from mlx_dspark.calibrate import calibrate, static_cap

        full = self.drafter.max_draft
        if block == "full":
            return None, None
        if isinstance(block, int):
            if not 1 <= block <= full:
                raise ValueError(f"mlx-dspark drafts 1..{full} tokens, not {block}")
            return block, None
        where = dict(
            mode="dspark",
            target_repo=self.target_dir,
            drafter_repo=self.drafter_dir,
            cache_dir=self.calibration_dir,
        )
        if block in (None, "static"):
            return static_cap(self.target, self.drafter, **where), None
        if block == "auto":
            return None, calibrate(self.target, self.drafter, verbose=False, **where)
        raise ValueError(
            f"block: an int, 'full', 'static', 'auto' or None, not {block!r}"
        )

    def generate(
        self,
        prompt_ids: List[int],
        max_tokens: int,
        block: Block = None,
        *,
        lookup: Optional[bool] = None,
        stop_at_eos: bool = False,
    ) -> Dict:
        """Greedy decoding of ``max_tokens`` tokens after ``prompt_ids`` (fewer at an
        end token with ``stop_at_eos``); the dict of the module docstring.
        ``lookup``: None keeps the constructor's setting."""
        from mlx_dspark.generate import speculative_generate

        lookup = self.lookup if lookup is None else lookup
        cap, controller = self._cap(block)
        tokenizer = self.tokenizer
        if not stop_at_eos or tokenizer is None:
            tokenizer = _NoStop(tokenizer)
        rounds = []

        def on_round(drafted, accepted, committed, cap, source):
            rounds.append((drafted, accepted, source))

        start = time.perf_counter()
        res = speculative_generate(
            self.target,
            tokenizer,
            self.drafter,
            prompt_ids=list(prompt_ids),
            max_new_tokens=max_tokens,
            max_draft_tokens=cap,
            cap_controller=controller,
            lookup_drafts=lookup,
            confidence_threshold=self.confidence_threshold,
            temperature=0.0,
            on_round=on_round,
        )
        end = time.perf_counter()
        settings = {
            "peer": self.name,
            "cap": cap if controller is None else "auto",
            "block": block,
            "lookup": lookup,
            "drafter_window": self.drafter.ctx_window,
            "confidence_threshold": self.confidence_threshold,
            "lookup_rounds": res.lookup_rounds,
        }
        return _result(
            res.token_ids[:max_tokens],
            start,
            start + res.prefill_seconds,
            end,
            res.num_rounds,
            sum(r[0] for r in rounds),
            sum(r[1] for r in rounds),
            [r[0] for r in rounds],
            settings,
        )


@functools.lru_cache(maxsize=None)
def _tapped_qwen3():
    """mlx-vlm's ``qwen3`` language model with what its DSpark loop asks of a
    target and that model lacks (see the module docstring): ``capture_layer_ids``
    (``hidden_states``: the residual stream after each listed layer, as its qwen3_5
    model returns them), ``speculative_verify`` (mlx-vlm's ``verify_forward``, whose
    cache transaction is returned as ``gdn_states``), ``rollback_speculative_cache``
    (mlx-vlm's), and ``logits_to_keep`` (as its gemma4 model honours it)."""
    from mlx_vlm.models.base import LanguageModelOutput, create_attention_mask
    from mlx_vlm.models.qwen3.language import LanguageModel
    from mlx_vlm.speculative.cache_state import rollback_speculative_cache
    from mlx_vlm.speculative.common import verify_forward

    class TappedQwen3(LanguageModel):
        def __call__(
            self,
            inputs=None,
            cache=None,
            input_embeddings=None,
            inputs_embeds=None,
            capture_layer_ids=None,
            speculative_verify=False,
            logits_to_keep=None,
            **kwargs,
        ):
            if speculative_verify:
                out, transaction = verify_forward(
                    self, inputs, cache, capture_layer_ids=capture_layer_ids
                )
                out.gdn_states = transaction
                return out
            m = self.model
            h = inputs_embeds if inputs_embeds is not None else input_embeddings
            if h is None:
                h = m.embed_tokens(
                    inputs if inputs is not None else kwargs["input_ids"]
                )
            if cache is None:
                cache = [None] * len(m.layers)
            mask = create_attention_mask(h, cache[0])
            taps = set(capture_layer_ids or ())
            sink = [] if capture_layer_ids is not None else None
            for i, (layer, c) in enumerate(zip(m.layers, cache)):
                h = layer(h, mask, c)
                if i in taps:
                    sink.append(h)
            h = m.norm(h)
            if logits_to_keep:
                h = h[:, -int(logits_to_keep) :]
            tied = self.args.tie_word_embeddings
            head = m.embed_tokens.as_linear if tied else self.lm_head
            return LanguageModelOutput(logits=head(h), hidden_states=sink)

        def rollback_speculative_cache(self, caches, state, accepted, block_size):
            return rollback_speculative_cache(caches, state, accepted, block_size)

    return LanguageModel, TappedQwen3


class VlmPeer:
    """mlx-vlm 0.7.10's DSpark loop (``generate.ar.generate_step`` with a
    ``draft_model``: one prefill with the taps, then ``speculative.dflash.
    _dflash_rounds``, batch 1).

    ``VlmPeer(target_dir, drafter_dir)`` loads the target with
    ``mlx_vlm.utils.load_model`` (no tokenizer needed) and gives a dense ``qwen3``
    one the taps and verify it lacks (module docstring; checked against the model's
    own logits at load); a target with mlx-vlm's own speculative support is left as
    it is. The drafter (the nested folder) comes from
    ``speculative.drafters.load_drafter`` as a ``DSparkDraftModel``; each generation
    binds it to the target's embedding and head (``reset``/``bind``).

    Settings, with mlx-vlm's defaults:

    - ``block`` (per call): the draft length k; mlx-vlm's ``draft_block_size`` is the
      verify width k + 1 (the anchor included), at most the drafter's
      ``block_size`` = checkpoint block + 1 (5 on the fixture: k <= 4). ``None`` is
      its default width, the config's ``runtime_block_size`` (``min(8,
      block_size)``); ``"full"`` the whole block. mlx-vlm does not clip a larger
      ``draft_block_size`` itself: `generate` refuses one.
    - ``adaptive`` (per call): the width policy. DSpark configs with
      ``projector_type: dspark`` read as ``block_size_policy: "adaptive"``: the width
      is a ceiling, the first round drafts ``dflash_initial_block_size`` - 1 (3), then
      ``_dflash_next_block_size``, over the last 8 rounds, narrows it (by 2, or by
      half from width 8; never below width 4) while under half the drafts are
      accepted or under 2 a round, and widens it by 2 when 85% are and 3 rounds in 4
      accept all. ``None`` keeps the config's policy (its
      CLI's behaviour, ``--draft-block-size`` included); ``False`` drafts the width
      every round (``prefer_requested_block_size``), ``True`` adapts.
    - Fixed in 0.7.10: the adapted target's verify is ``verify_forward``, forwards
      of at most 8 tokens (``models.linear.DECODE_BLOCK_SIZE``) in one cache
      transaction (mlx-vlm's qwen3_5 has its own exact verifier); the prompt is
      prefilled in one forward (chunked prefill is off for targets without a
      ``chunked_prefill_policy``); drafts are sampled with the target's sampler
      (argmax), one Markov step per slot; batches (B > 1) go through
      ``_dflash_rounds_batch``, not wrapped here.

    ``generate_step`` never stops at an end token; with ``stop_at_eos`` `generate`
    stops at the config's ``eos_token_id`` as mlx-vlm's ``stream_generate`` does.
    ``temperature=0.0`` is passed explicitly: left ``None``, ``generate_step`` takes
    the checkpoint's ``generation_config.json`` sampling (Qwen3's samples at 0.6).
    """

    name = "mlx-vlm"

    def __init__(self, target_dir, drafter_dir):
        import mlx.core as mx
        from mlx_vlm.speculative.drafters import DFlashDraftModel, load_drafter
        from mlx_vlm.utils import load_model

        self.target_dir, self.drafter_dir = str(target_dir), str(drafter_dir)
        self.model = load_model(Path(target_dir))
        lm = self.model.language_model
        self.adapted = not hasattr(lm, "rollback_speculative_cache")
        if self.adapted:
            native, tapped = _tapped_qwen3()
            if type(lm) is not native:
                raise ValueError(
                    f"mlx-vlm's {type(lm).__module__} has no speculative support and "
                    "only its qwen3 model is adapted here"
                )
            probe = mx.array([[1, 2, 3, 4]])
            want = lm(probe).logits
            lm.__class__ = tapped
            got = lm(probe, capture_layer_ids=[0]).logits
            if not mx.allclose(want, got, atol=1e-4).item():
                raise RuntimeError("the tapped qwen3 forward differs from mlx-vlm's")
        self.drafter, self.kind = load_drafter(self.drafter_dir)
        if not isinstance(self.drafter, DFlashDraftModel):  # DSpark's, DFlash2's base
            raise ValueError(
                f"mlx-vlm loads {drafter_dir} as {type(self.drafter).__name__}, "
                "not a DSpark or DFlash drafter"
            )
        # the class's own width policy (DSpark's and DFlash2's adapt), unless a
        # DSpark config says otherwise (block_size_policy)
        self.adapts = not type(self.drafter).prefer_requested_block_size
        self.eos = _eos_ids(target_dir)

    def _width(self, block: Block) -> Optional[int]:
        """mlx-vlm's ``draft_block_size`` (verify width) for ``block``."""
        most = int(self.drafter.config.block_size)
        if block is None:
            return None
        if block == "full":
            return most
        if isinstance(block, int) and 1 <= block <= most - 1:
            return block + 1
        raise ValueError(f"mlx-vlm drafts 1..{most - 1} tokens, not {block!r}")

    def generate(
        self,
        prompt_ids: List[int],
        max_tokens: int,
        block: Block = None,
        *,
        adaptive: Optional[bool] = None,
        stop_at_eos: bool = False,
    ) -> Dict:
        """Greedy decoding of ``max_tokens`` tokens after ``prompt_ids`` (fewer at an
        end token with ``stop_at_eos``); the dict of the module docstring."""
        import mlx.core as mx
        from mlx_vlm.generate.ar import generate_step

        d = self.drafter
        width = self._width(block)
        policy = getattr(d.config, "block_size_policy", None)
        default = policy == "fixed" if policy else not self.adapts
        fixed = default if adaptive is None else not adaptive
        d.prefer_requested_block_size = fixed
        ids = mx.array([list(prompt_ids)], dtype=mx.int32)
        tokens = []
        start = time.perf_counter()
        steps = generate_step(
            ids,
            self.model,
            None,
            None,
            max_tokens=max_tokens,
            temperature=0.0,
            draft_model=d,
            draft_kind=self.kind,
            draft_block_size=width,
        )
        first = None
        for token, _ in steps:  # the prefill's token comes first
            if first is None:
                first = time.perf_counter()
            tokens.append(int(token))
            if stop_at_eos and tokens[-1] in self.eos:
                break
        steps.close()
        end = time.perf_counter()
        first = end if first is None else first
        settings = {
            "peer": self.name,
            "draft_block_size": width,
            "block": block,
            "adaptive": not fixed,
            "adapted_target": self.adapted,
        }
        return _result(
            tokens,
            start,
            first,
            end,
            len(d.accept_lens),
            sum(d.draft_lens),
            int(sum(d.accept_lens)),
            list(d.draft_lens),
            settings,
        )


def dspark_decode(
    target_dir, drafter_dir, prompt_ids, max_tokens, block: Block = None, **options
) -> Dict:
    """Load mlx-dspark's pair and decode once (see `DsparkPeer`; ``options``: its
    constructor's keywords)."""
    return DsparkPeer(target_dir, drafter_dir, **options).generate(
        prompt_ids, max_tokens, block
    )


def vlm_decode(
    target_dir, drafter_dir, prompt_ids, max_tokens, block: Block = None, **options
) -> Dict:
    """Load mlx-vlm's pair and decode once (see `VlmPeer`; ``options``: its
    ``generate``'s keywords)."""
    return VlmPeer(target_dir, drafter_dir).generate(
        prompt_ids, max_tokens, block, **options
    )


def plain_greedy(target_dir, prompt_ids, max_tokens) -> List[int]:
    """mlx-lm's plain greedy decoding of the target (argmax, no end token)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model = load_model(Path(target_dir))[0]
    steps = generate_step(
        mx.array(list(prompt_ids)),
        model,
        max_tokens=max_tokens,
        sampler=lambda x: mx.argmax(x, axis=-1),
    )
    return [int(t) for t, _ in steps]


def _ours(target_dir, drafter_dir, prompt_ids, max_tokens, k):
    """mlx-mtp's greedy tokens at k and its `MTPStats`, for reference (its
    ``rounds`` count passes, the prefill's included)."""
    from mlx_mtp.loading import load_model
    from mlx_mtp.speculative import mtp_generate_step

    model = load_model(str(target_dir), draft_model=str(drafter_dir))[0]
    steps = list(
        mtp_generate_step(
            list(prompt_ids), model, max_tokens=max_tokens, num_draft_tokens=k
        )
    )
    return [s.token for s in steps], steps[-1].stats


FIXTURES = (
    # (vocabulary, prompt): 512 tokens write the fixtures' tokenizer (mlx-dspark's
    # loader wants one) but accept few drafts; 64 tokens have no tokenizer (mlx-dspark
    # is loaded through the fallback) and accept about half of them
    (512, [300, 200, 100]),
    (64, [5, 17, 30]),
)


def check(root: Path, vocab: int, prompt: List[int], n: int = 48) -> bool:
    """Write the predictable pair of ``vocab`` tokens (agree 0.8) under ``root``,
    decode ``n`` tokens after ``prompt`` with each peer (a warm-up call, then a timed
    one) at its defaults and at the whole block with the drafter alone, and print
    how each compares with mlx-lm's plain greedy decoding; True if all are equal."""
    from mlx_mtp.testing.dspark import write_dspark, write_qwen3_target

    target = write_qwen3_target(root / "target", vocab_size=vocab, predictable=True)
    pair = dict(predictable=True, agree=0.8)
    deepspec = write_dspark(root / "deepspec", target, layout="deepspec", **pair)
    nested = write_dspark(root / "nested", target, layout="nested", **pair)
    want = plain_greedy(target, prompt, n)
    print(f"vocab {vocab}, prompt {prompt}, {n} tokens; mlx-lm: {want[:10]} ...")
    ours, stats = _ours(target, deepspec, prompt, n, 4)
    print(
        f"  mlx-mtp k=4 (reference): equal {ours == want}; "
        f"{len(ours) / stats.rounds:.2f} tokens/pass ({stats.rounds} passes)"
    )
    dspark = DsparkPeer(target, deepspec, calibration_dir=root / "calibration")
    vlm = VlmPeer(target, nested)
    runs = [
        (dspark, {}, "defaults"),
        (dspark, {"block": "full", "lookup": False}, "whole block"),
        (vlm, {}, "defaults"),
        (vlm, {"block": "full", "adaptive": False}, "whole block"),
    ]
    ok = True
    for peer, options, note in runs:
        peer.generate(prompt, n, **options)  # warm-up
        r = peer.generate(prompt, n, **options)
        same = r["tokens"] == want
        ok &= same
        s = {k: v for k, v in r["settings"].items() if k != "peer"}
        print(
            f"  {peer.name}, {note} {s}: equal {same}; "
            f"{r['tokens_per_pass']:.2f} tokens/pass ({r['passes']} passes, "
            f"{r['accepted']}/{r['drafted']} drafts accepted); prefill "
            f"{r['prefill_s'] * 1e3:.1f} ms, decode {r['decode_s'] * 1e3:.1f} ms"
        )
        if not same:
            print(f"    got  {r['tokens']}\n    want {want}")
    return ok


def main():
    """Self-check on the tiny fixtures (`FIXTURES`, see `check`). Exits 1 on a
    mismatch."""
    import tempfile

    for p in PEER_PATHS:  # this machine's installs, when PYTHONPATH lacks them
        if p not in sys.path and Path(p).is_dir():
            sys.path.append(p)
    ok = True
    for vocab, prompt in FIXTURES:
        with tempfile.TemporaryDirectory() as tmp:
            ok &= check(Path(tmp), vocab, prompt)
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
