"""Recurrent mixers that can record their state after every position of a pass.

A verify pass feeds k+1 tokens through the trunk; if only a of the k drafts are
accepted, each recurrent layer must continue from its state after position a, which
mlx-lm's mixers do not expose (they return the final state only). `install_capture`
gives the trunk's mixers a subclass that, when its cache asks for it
(`RecurrentCache.capture`), runs the projections and the convolution over all positions
at once, as usual, and the recurrence one position at a time, recording the cache slots
``[conv_state, state]`` after each. No weight is read twice; the extra cost is k more
calls of the small recurrence. Without a capture request the mixer is mlx-lm's,
unchanged.

The recurrence runs the same per-position update as plain one-token decoding, so the
recorded states, and the states kept after rollback, are those of plain decoding.

Covered mlx-lm mixers: the Gated-DeltaNet of ``qwen3_5`` / ``qwen3_5_moe`` and
``qwen3_next``, the Mamba-2 mixer of ``nemotron_h``, and the lightning (gated linear)
attention of ``bailing_hybrid`` and the Kimi Delta Attention of ``bailing_moe_v3``.
Another mixer joins with a subclass that records per-position slots and an entry in
`CAPTURING`.
"""

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import (
    bailing_hybrid,
    bailing_moe_v3,
    nemotron_h,
    qwen3_5,
    qwen3_next,
)
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk


def _take_capture(cache):
    """The pending capture request of ``cache`` (cleared: it is one-shot), or None."""
    capture = getattr(cache, "capture", None)
    if capture is not None:
        cache.capture = None
        if cache.lengths is not None:
            raise ValueError("state capture supports unpadded single sequences only")
    return capture


class CaptureDeltaNet:
    """Mixin over an mlx-lm Gated-DeltaNet class; subclasses provide `_project`."""

    def __call__(self, inputs: mx.array, mask=None, cache=None) -> mx.array:
        capture = _take_capture(cache)
        if capture is None:
            return super().__call__(inputs, mask, cache)
        if mask is not None:
            raise ValueError("state capture supports unmasked passes only")
        if inputs.shape[1] == 1:  # one position: its state is the pass's last
            out = super().__call__(inputs, mask, cache)
            capture.record([list(cache.cache)])
            return out
        return self._capture_call(inputs, cache, capture)

    def _project(self, inputs: mx.array):
        """``(qkv (B, S, conv_dim), z (B, S, Hv, Dv), b (B, S, Hv), a (B, S, Hv))``."""
        raise NotImplementedError

    def _capture_call(self, inputs: mx.array, cache, capture) -> mx.array:
        B, S, _ = inputs.shape
        qkv, z, b, a = self._project(inputs)
        n_keep = self.conv_kernel_size - 1
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros((B, n_keep, self.conv_dim), dtype=inputs.dtype)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)  # (B, n_keep + S, C)
        conv_out = nn.silu(self.conv1d(conv_input))  # (B, S, C)
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        state, ys, steps = cache[1], [], []
        for t in range(S):
            at = slice(t, t + 1)
            y, state = gated_delta_update(
                q[:, at],
                k[:, at],
                v[:, at],
                a[:, at],
                b[:, at],
                self.A_log,
                self.dt_bias,
                state,
                None,
                use_kernel=not self.training,
            )  # y: (B, 1, Hv, Dv)
            ys.append(y)
            steps.append([conv_input[:, t + 1 : t + 1 + n_keep], state])
        cache[0] = mx.contiguous(conv_input[:, -n_keep:])
        cache[1] = state
        cache.advance(S)
        capture.record(steps)
        out = self.norm(mx.concatenate(ys, axis=1), z)
        out = self.out_proj(out.reshape(B, S, -1))
        group = getattr(self, "sharding_group", None)  # a tensor-parallel mixer's heads
        return out if group is None else mx.distributed.all_sum(out, group=group)


class Qwen3_5DeltaNet(CaptureDeltaNet, qwen3_5.GatedDeltaNet):
    def _project(self, inputs):
        B, S, _ = inputs.shape
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        return (
            self.in_proj_qkv(inputs),
            z,
            self.in_proj_b(inputs),
            self.in_proj_a(inputs),
        )


class Qwen3NextDeltaNet(CaptureDeltaNet, qwen3_next.Qwen3NextGatedDeltaNet):
    def _project(self, inputs):
        B, S, _ = inputs.shape
        q, k, v, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(inputs), self.in_proj_ba(inputs)
        )
        qkv = mx.concatenate(
            [q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1
        )
        return qkv, z, b, a


class NemotronHMamba(nemotron_h.NemotronHMamba2Mixer):
    """Mamba-2 mixer: mlx-lm's forward, with the SSM step run once per position while
    capturing (its ``_conv`` and ``_ssm`` are the hooks)."""

    _capture = None

    def __call__(self, hidden_states: mx.array, mask, cache=None) -> mx.array:
        capture = _take_capture(cache)
        if capture is None:
            return super().__call__(hidden_states, mask, cache)
        if mask is not None:
            raise ValueError("state capture supports unmasked passes only")
        self._capture, self._steps = capture, []
        try:
            out = super().__call__(hidden_states, mask, cache)
        finally:
            self._capture = None
        capture.record(self._steps)
        return out

    def _conv(self, conv_input, cache, mask):
        if self._capture is not None:
            state = cache[0]
            if state is None:
                shape = (conv_input.shape[0], self.conv_kernel_size - 1, self.conv_dim)
                state = mx.zeros(shape, dtype=conv_input.dtype)
            self._padded = mx.concatenate([state, conv_input], axis=1)
        return super()._conv(conv_input, cache, mask)

    def _ssm(self, hidden_states, B, C, dt, cache, mask):
        if self._capture is None:
            return super()._ssm(hidden_states, B, C, dt, cache, mask)
        n_keep, ys = self.conv_kernel_size - 1, []
        for t in range(hidden_states.shape[1]):
            at = slice(t, t + 1)
            ys.append(
                super()._ssm(
                    hidden_states[:, at], B[:, at], C[:, at], dt[:, at], cache, None
                )
            )
            self._steps.append([self._padded[:, t + 1 : t + 1 + n_keep], cache[1]])
        return mx.concatenate(ys, axis=1)


class BailingLightning(bailing_hybrid.LinearAttention):
    """Ling 2.5's lightning attention: projections, norms and RoPE over all positions
    at once, the decayed recurrence ``h = exp(g) h + k^T v`` one position at a time
    (mlx-lm's one-token step), recording the state after each."""

    def __call__(self, x: mx.array, mask=None, cache=None, offset: int = 0):
        capture = _take_capture(cache)
        if capture is None:
            return super().__call__(x, mask, cache, offset=offset)
        if mask is not None:
            raise ValueError("state capture supports unmasked passes only")
        B, L, _ = x.shape
        heads, d = self.num_attention_heads, self.head_dim
        qkv = self.query_key_value(x).reshape(B, L, 3 * heads, d)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in mx.split(qkv, 3, axis=2))
        if self.use_qk_norm:
            q, k = self.query_layernorm(q), self.key_layernorm(k)
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        state, ys, steps = cache[0], [], []
        for t in range(L):
            at = slice(t, t + 1)
            y, state = bailing_hybrid.recurrent_gla(
                q[:, :, at],
                k[:, :, at],
                v[:, :, at],
                self._slope,
                scale=self.scale,
                h=state,
            )  # y: (B, heads, 1, d)
            ys.append(y)
            steps.append([state])
        cache[0] = state
        cache.advance(L)
        capture.record(steps)
        out = mx.concatenate(ys, axis=2).transpose(0, 2, 1, 3).reshape(B, L, -1)
        out = self.g_norm(out) * mx.sigmoid(self.g_proj(x))
        return self.dense(out)


class BailingKDA(bailing_moe_v3.BailingKDA):
    """Ling 3.0's Kimi Delta Attention: projections and the three short convolutions
    over all positions at once, the gated delta rule one position at a time, recording
    ``[q_conv, k_conv, v_conv, state]`` after each."""

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        capture = _take_capture(cache)
        if capture is None:
            return super().__call__(x, mask, cache)
        if mask is not None:
            raise ValueError("state capture supports unmasked passes only")
        B, L, _ = x.shape
        H, D, keep = self.num_heads, self.head_dim, self.conv_kernel_size - 1
        padded = []

        def conv(proj: mx.array, layer: nn.Conv1d, slot: int) -> mx.array:
            previous = cache[slot]
            if previous is None:
                previous = mx.zeros((B, keep, proj.shape[-1]), dtype=proj.dtype)
            conv_input = mx.concatenate([previous, proj], axis=1)  # (B, keep + L, C)
            cache[slot] = mx.contiguous(conv_input[:, -keep:])
            padded.append(conv_input)
            return nn.silu(layer(conv_input)).reshape(B, L, H, D)

        q = conv(self.q_proj(x), self.q_conv1d, 0)
        k = conv(self.k_proj(x), self.k_conv1d, 1)
        v = conv(self.v_proj(x), self.v_conv1d, 2)
        q, k = normalize_qk(q, k, inv_scale=D**-0.5, eps=1e-6)
        gate = self.f_proj(x).reshape(B, L, H, D)
        beta = self.b_proj(x).astype(mx.float32)
        state, ys, steps = cache[3], [], []
        for t in range(L):
            at = slice(t, t + 1)
            y, state = gated_delta_update(
                q[:, at],
                k[:, at],
                v[:, at],
                gate[:, at],
                beta[:, at],
                self.A_log.reshape(H, 1),
                self.dt_bias.reshape(H, D),
                state=state,
                use_kernel=not self.training,
                lower_bound=self.lower_bound,
            )  # y: (B, 1, H, D)
            ys.append(y)
            steps.append([p[:, t + 1 : t + 1 + keep] for p in padded] + [state])
        cache[3] = state
        cache.advance(L)
        capture.record(steps)
        out = self.o_norm(mx.concatenate(ys, axis=1))
        out_gate = self.g_proj(x).reshape(B, L, H, D).astype(mx.float32)
        out = out * mx.sigmoid(out_gate).astype(out.dtype)
        return self.o_proj(out.reshape(B, L, -1))


CAPTURING = {
    qwen3_5.GatedDeltaNet: Qwen3_5DeltaNet,
    qwen3_next.Qwen3NextGatedDeltaNet: Qwen3NextDeltaNet,
    nemotron_h.NemotronHMamba2Mixer: NemotronHMamba,
    bailing_hybrid.LinearAttention: BailingLightning,
    bailing_moe_v3.BailingKDA: BailingKDA,
}
MIXER_ATTRIBUTES = ("linear_attn", "mixer", "attention")


def install_capture(layers) -> None:
    """Switch every covered recurrent mixer in ``layers`` to its capturing subclass.

    Only the class changes (parameters and state are untouched); the subclass behaves
    exactly as mlx-lm's unless its cache requests a capture.
    """
    for layer in layers:
        for name in MIXER_ATTRIBUTES:
            mixer = getattr(layer, name, None)
            if type(mixer) in CAPTURING:
                mixer.__class__ = CAPTURING[type(mixer)]


# -- taps: trunk hidden states a block drafter reads ----------------------------------


class Taps:
    """The residual stream at some trunk layers, recorded during every trunk pass.

    ``ids`` are layer indices in the drafter's order: id l >= 0 is the output of
    decoder layer l (before the final norm; Hugging Face ``hidden_states[l + 1]``), and
    -1 is the embedding output, the input of layer 0 (DeepSpec ``common.py``, see
    ``/work/notes/dspark_spec.md`` §2.1). The tapped layers record as the pass runs, so
    no second trunk pass is needed; `collect` reads the last pass's values.
    """

    def __init__(self, ids):
        self.ids = tuple(ids)
        self.values = {}

    def layer_of(self, i: int) -> int:
        """The trunk layer whose pass records tap ``i`` (-1: layer 0's input)."""
        return 0 if i == -1 else i

    def record(self, index: int, x: mx.array, out: mx.array) -> None:
        """Layer ``index`` saw input ``x`` and gave ``out`` (both (B, L, H))."""
        if index == 0 and -1 in self.ids:
            self.values[-1] = x
        if index in self.ids:
            self.values[index] = out

    def collect(self, like: mx.array, group=None) -> mx.array:
        """``(B, L, n * H)``: the last pass's taps concatenated in ``ids`` order
        (and forgotten, so they hold no memory past the pass). ``group``: the
        ranks of a pipelined trunk, each of which recorded the taps of the layers
        it runs: summed over them (the others' zeros, the shape and dtype of the
        pass's output ``like``), so every rank has every tap; the sum runs after
        ``like``, whose pass ends on every rank with the same collective."""
        values, self.values = self.values, {}
        if group is None:
            return mx.concatenate([values[i] for i in self.ids], axis=-1)
        mine = [values.get(i, mx.zeros_like(like)) for i in self.ids]
        mine = mx.depends(mx.concatenate(mine, axis=-1), like)
        return mx.distributed.all_sum(mine, group=group)


class StreamInputTaps(Taps):
    """The input of each tapped layer, averaged over its hyper-connection streams:
    id i is ``mean(streams, hc)`` of layer i's input ``(B, L, hc, H)`` (the
    attention input of layer i, as DeepSeek-V4.1's DSpark reads it: the reference's
    ``Transformer.forward`` takes ``h.mean(dim=2)`` before block i; spec §2.1)."""

    def layer_of(self, i: int) -> int:
        return i

    def record(self, index: int, x: mx.array, out: mx.array) -> None:
        if index in self.ids:
            self.values[index] = mx.mean(x, axis=2)  # (B, L, H)


class TappedLayer:
    """Mixin over a trunk decoder layer class: records its input and output in
    ``tap_sink`` (a `Taps`) under its index ``tap_index``."""

    def __call__(self, x: mx.array, *args, **kwargs):
        out = super().__call__(x, *args, **kwargs)
        h = out if isinstance(out, mx.array) else out[0]
        self.tap_sink.record(self.tap_index, x, h)
        return out


_TAPPED = {}


def install_taps(layers, ids, kind=Taps) -> Taps:
    """Make the trunk ``layers`` that ``ids`` tap record into a new ``kind`` of
    `Taps` (only the class changes, as `install_capture` does; the layers compute
    as before). On a pipelined trunk, only the layers this rank runs (the others
    are None or gone: their taps come from their ranks, `Taps.collect`)."""
    taps = kind(ids)
    wanted = {taps.layer_of(i) for i in ids}
    for index in sorted(wanted):
        layer = layers[index] if index < len(layers) else None
        if layer is None:  # a pipelined trunk's layer another rank runs
            continue
        cls = type(layer)
        if not issubclass(cls, TappedLayer):
            if cls not in _TAPPED:
                _TAPPED[cls] = type(f"Tapped{cls.__name__}", (TappedLayer, cls), {})
            layer.__class__ = _TAPPED[cls]
        layer.tap_sink, layer.tap_index = taps, index
    return taps
