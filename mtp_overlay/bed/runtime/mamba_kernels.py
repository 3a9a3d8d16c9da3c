"""Pure-torch stand-ins for the kernels megatron-core's Mamba layers need (rows of the CPU shims' table).

Mamba ('M') layers (``mamba_shims``): megatron-core's ``MambaMixer`` needs ``mamba_ssm``'s Triton
kernels, which do not run on a CPU, and refuses to build without them (``ssm/mamba_mixer.py:202``).
Pure-torch stand-ins, each checked against a reference written from the equations
(tests/testbed/test_mamba_stand_ins.py), take the names ``mamba_mixer`` looks the kernels up by:
``mamba_split_conv1d_scan_combined`` (the training step's fused depthwise causal conv + Mamba-2 SSD
chunked scan, with per-sequence resets from ``seq_idx``), ``mamba_chunk_scan_combined`` (the unfused
path's scan), the gated ``RMSNormGated``; plus the version answers a packed step asks for and, for
packed rows under CP, TE's ``thd_get_partitioned_indices``. No module is faked in ``sys.modules``.
"""

import functools
import importlib.util
import types

from .cp_attention import row_positions
from .shim import Shim, having


MAMBA_MIXER = "megatron.core.ssm.mamba_mixer"
MAMBA_CONTEXT_PARALLEL = "megatron.core.ssm.mamba_context_parallel"
# the releases the stand-ins answer for in megatron-core's version checks: the first mamba_ssm and
# causal_conv1d whose kernels take ``seq_idx`` (what ``_check_mamba_sequence_packing_support`` asks
# of a packed training step, ``ssm/mamba_mixer.py:1500-1501``); its inference minimums are higher
MAMBA_STAND_IN_VERSIONS = {"mamba_ssm": "2.0.0", "causal_conv1d": "1.4.0"}
# the names a training step looks up in mamba_mixer; a release that does not define them all without
# mamba_ssm (0.16.1 leaves the scan functions undefined) gets no Mamba stand-in at all
MAMBA_KERNEL_NAMES = ("HAVE_MAMBA_SSM", "mamba_split_conv1d_scan_combined", "RMSNormGated", "ExtendedRMSNorm")
# Transformer Engine release whose ``thd_get_partitioned_indices`` the THD CP stand-in answers for
# (``ssm/mamba_context_parallel.py:377,415`` ask for at least this one)
TE_THD_STAND_IN_VERSION = "1.10.0"


def mamba_shims():
    """The Shims that let megatron-core's own MambaMixer/MambaLayer train without mamba_ssm.

    megatron-core's ``ssm/mamba_mixer.py`` imports the kernels inside ``try`` (lines 61-93): without
    ``mamba_ssm`` it sets ``HAVE_MAMBA_SSM = False``, the kernel names to None, ``RMSNormGated`` to a
    MagicMock and builds ``ExtendedRMSNorm`` on that mock (line 111); ``MambaMixer.__init__`` then
    raises ImportError (line 202). The stand-ins are put on those module attributes while the shims
    are installed, and only there: no ``mamba_ssm`` or ``causal_conv1d`` module is created, nothing
    enters ``sys.modules``, and ``uninstall()`` restores every original (flag, None, mock). Replaced:

    * ``HAVE_MAMBA_SSM`` (line 75/93, read at line 202): True.
    * ``mamba_split_conv1d_scan_combined`` (line 72; the training step calls it, line 755):
      `mamba_split_conv1d_scan_combined` below.
    * ``mamba_chunk_scan_combined`` (line 71; the unfused path, ``use_mamba_mem_eff_path=False``,
      line 1063): `mamba_chunk_scan_combined`.
    * ``RMSNormGated`` / ``ExtendedRMSNorm`` (lines 69, 111; built at line 417, called at 779 and
      1093): `rms_norm_gated` (upstream's ExtendedRMSNorm only adds a checkpoint sharding method).
    * ``is_mamba_min_version`` / ``is_causal_conv1d_min_version`` as mamba_mixer sees them (lines
      1502-1505, packed rows): answer for ``MAMBA_STAND_IN_VERSIONS``.
    * THD under context parallelism, ``ssm/mamba_context_parallel.py``: its ``tex`` (line 24, TE's
      torch extension) gets `thd_get_partitioned_indices` alone, its ``is_te_min_version`` answers
      for ``TE_THD_STAND_IN_VERSION``.

    Left as they are: ``causal_conv1d_fn`` (None: the unfused path runs upstream's own
    ``F.conv1d``, line 914 through ``mamba_context_parallel.py:213``), the dynamic-inference
    kernels (megatron-core's own Triton ops) and ``MAMBA_HAS_STATE_DTYPE`` (False: no
    ``state_dtype`` argument). [] where the module does not import or real mamba_ssm kernels are
    installed (``HAVE_MAMBA_SSM`` already True), and where megatron-core leaves one of
    ``MAMBA_KERNEL_NAMES`` undefined without mamba_ssm (a half stand-in would build a mixer that fails
    mid-step; stock's refusal is clearer).
    """
    try:
        mixer = importlib.import_module(MAMBA_MIXER)
    except ImportError:
        return []
    defined = vars(mixer)
    if defined.get("HAVE_MAMBA_SSM", True) or not all(name in defined for name in MAMBA_KERNEL_NAMES):
        return []
    norm = rms_norm_gated()
    wanted = {
        "HAVE_MAMBA_SSM": True,
        "mamba_split_conv1d_scan_combined": mamba_split_conv1d_scan_combined,
        "mamba_chunk_scan_combined": mamba_chunk_scan_combined,
        "RMSNormGated": norm,
        "ExtendedRMSNorm": norm,
        "is_mamba_min_version": functools.partial(_stand_in_version_at_least, MAMBA_STAND_IN_VERSIONS["mamba_ssm"]),
        "is_causal_conv1d_min_version": functools.partial(
            _stand_in_version_at_least, MAMBA_STAND_IN_VERSIONS["causal_conv1d"]
        ),
    }
    shims = [Shim(mixer, name, value) for name, value in wanted.items() if name in defined]
    for context_parallel in having(MAMBA_CONTEXT_PARALLEL, "tex"):
        if vars(context_parallel)["tex"] is None and "is_te_min_version" in vars(context_parallel):
            shims += [
                Shim(context_parallel, "tex", _thd_partitioning_stand_in()),
                Shim(context_parallel, "is_te_min_version",
                     functools.partial(_stand_in_version_at_least, TE_THD_STAND_IN_VERSION)),
            ]
    return shims


def _stand_in_version_at_least(stand_in, version, check_equality=True):
    """megatron-core's ``is_*_min_version(version, check_equality)`` for a stand-in of release ``stand_in``."""
    from packaging.version import Version

    return Version(stand_in) >= Version(version) if check_equality else Version(stand_in) > Version(version)


def _thd_partitioning_stand_in():
    """``transformer_engine_torch`` as ``mamba_context_parallel`` uses it: `thd_get_partitioned_indices`
    only; any other attribute raises AttributeError naming the stand-in."""
    stand_in = types.ModuleType("transformer_engine_torch", "CPU stand-in: thd_get_partitioned_indices only")

    def missing(attribute):
        raise AttributeError(
            f"transformer_engine_torch.{attribute}: Transformer Engine is not installed (CPU stand-in)"
        )

    vars(stand_in).update(thd_get_partitioned_indices=thd_get_partitioned_indices, __getattr__=missing)
    return stand_in


def thd_get_partitioned_indices(cu_seqlens, total_tokens, cp_size, cp_rank):
    """Stand-in for TE's ``tex.thd_get_partitioned_indices`` (``ssm/mamba_context_parallel.py:392,430``).

    The positions of a packed row of ``total_tokens`` slots that CP rank ``cp_rank`` holds: chunks r
    and 2*cp-1-r of each padded sequence (``cu_seqlens``, each length a multiple of 2*cp), in that
    order: the layout the test bed's CP sharding uses (``mtp_overlay.mtp.cp_local_indices``).
    """
    import torch

    if total_tokens % cp_size:
        raise ValueError(f"total_tokens={total_tokens} is not a multiple of cp_size={cp_size}")
    cu = torch.as_tensor(cu_seqlens).to(torch.int64)
    return row_positions(cu, total_tokens // cp_size, cp_size, cp_rank)


def mamba_split_conv1d_scan_combined(
    zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, initial_states=None, seq_idx=None,
    dt_limit=(0.0, float("inf")), return_final_states=False, activation="silu", rmsnorm_weight=None,
    rmsnorm_eps=1e-6, outproj_weight=None, outproj_bias=None, headdim=None, ngroups=1, norm_before_gate=True,
):
    """Stand-in for ``mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined``.

    What megatron-core's training step calls (``ssm/mamba_mixer.py:755``): ``zxbcdt`` [b, l,
    2*d + 2*g*n + h] (d = h * headdim) splits into the gate z [b, l, d], the conv input xBC [b, l,
    d + 2*g*n] and dt [b, l, h]; xBC goes through the depthwise causal conv (`causal_conv1d_fn`,
    ``conv1d_weight`` [d + 2*g*n, w], its activation) and splits into x, B, C; the SSD scan
    (`mamba_chunk_scan_combined`, ``dt_softplus=True``, ``D``, ``dt_bias``, ``seq_idx``) gives y,
    gated by silu(z). Returns y [b, l, d]. ``D``: [h] (``headdim`` given) or [h, headdim].
    ``norm_before_gate`` only matters with ``rmsnorm_weight``; megatron-core never passes that,
    ``outproj_*`` or ``return_final_states`` (it applies its own norm and out_proj): refused.
    """
    import torch

    for name, value in (("rmsnorm_weight", rmsnorm_weight), ("outproj_weight", outproj_weight),
                        ("outproj_bias", outproj_bias)):
        if value is not None:
            raise NotImplementedError(f"mamba_split_conv1d_scan_combined stand-in: {name} is not supported "
                                      "(megatron-core's training step passes None)")
    if return_final_states:
        raise NotImplementedError("mamba_split_conv1d_scan_combined stand-in: return_final_states is not supported")
    if D.dim() == 1:
        if headdim is None:
            raise ValueError(f"mamba_split_conv1d_scan_combined: D of shape {tuple(D.shape)} (per head) needs headdim")
        heads = D.shape[0]
    elif D.dim() == 2:
        heads, headdim = D.shape
    else:
        raise ValueError(
            f"mamba_split_conv1d_scan_combined: D must be [heads] or [heads, headdim], got {tuple(D.shape)}"
        )
    dim = heads * headdim
    batch, length, width = zxbcdt.shape
    state_width = conv1d_weight.shape[0] - dim  # 2 * ngroups * d_state
    if state_width <= 0 or state_width % (2 * ngroups):
        raise ValueError(
            f"mamba_split_conv1d_scan_combined: conv1d_weight has {conv1d_weight.shape[0]} channels, expected "
            f"{dim} (heads * headdim) + 2 * ngroups({ngroups}) * d_state"
        )
    d_state = state_width // (2 * ngroups)
    if width != 2 * dim + state_width + heads:
        raise ValueError(
            f"mamba_split_conv1d_scan_combined: zxbcdt's last dimension must be 2*{dim} + 2*{ngroups}*{d_state} + "
            f"{heads} = {2 * dim + state_width + heads} (z, xBC, dt), got {width}"
        )
    z, xbc, dt = torch.split(zxbcdt, [dim, dim + state_width, heads], dim=-1)
    xbc = causal_conv1d_fn(xbc.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx, activation=activation)
    x, B, C = torch.split(xbc.transpose(1, 2), [dim, state_width // 2, state_width // 2], dim=-1)
    y = mamba_chunk_scan_combined(
        x.reshape(batch, length, heads, headdim), dt, A, B.reshape(batch, length, ngroups, d_state),
        C.reshape(batch, length, ngroups, d_state), chunk_size, D=D, z=z.reshape(batch, length, heads, headdim),
        dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit,
    )
    return y.reshape(batch, length, dim)


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None):
    """Stand-in for ``causal_conv1d.causal_conv1d_fn`` (the conv inside the fused scan above).

    Depthwise causal convolution: ``out[b, c, t] = bias[c] + sum_k weight[c, k] * x[b, c, t - w + 1 + k]``
    over the taps inside the row and, with ``seq_idx`` [b, l], inside token t's own sequence (a
    packed row's sequences do not see each other). x: [b, channels, l]; weight: [channels, w];
    activation None, "silu" or "swish" (silu).
    """
    import torch
    import torch.nn.functional as F

    if activation not in (None, "silu", "swish"):
        raise ValueError(f"causal_conv1d_fn: activation must be None, 'silu' or 'swish', got {activation!r}")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(
            f"causal_conv1d_fn: x must be [batch, channels, length] and weight [channels, width], got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    width = weight.shape[1]
    windows = F.pad(x, (width - 1, 0)).unfold(-1, width, 1)  # [b, c, l, w]: tap k reads t - w + 1 + k
    if seq_idx is not None:
        sequence = _check_seq_idx(seq_idx, x.shape[0], x.shape[2])
        tap_sequence = F.pad(sequence, (width - 1, 0), value=-1).unfold(-1, width, 1)  # [b, l, w]
        windows = windows * (tap_sequence == sequence[..., None])[:, None].to(windows.dtype)
    out = torch.einsum("bclw,cw->bcl", windows, weight)
    if bias is not None:
        out = out + bias[:, None]
    return out if activation is None else F.silu(out)


def mamba_chunk_scan_combined(
    x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
    return_varlen_states=False,
):
    """Stand-in for ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``: Mamba-2's SSD scan.

    Per head h, with A[h] < 0 and dt = softplus(dt + dt_bias) (``dt_softplus``; clamped to
    ``dt_limit`` when one is set), the selective state-space recurrence over time t
    ``state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T``, ``y_t = state_t C_t + D x_t``, gated by
    silu(z_t) when ``z`` is given, computed chunk by chunk as the paper's state-space duality
    prescribes: within a chunk of ``chunk_size`` steps, the masked "attention" form (the decay between
    two steps is exp of the difference of their cumulative dt*A); across chunks, each chunk's final
    state carried into the next. With ``seq_idx`` [b, l] (non-decreasing sequence ids of a packed
    row) the state starts from zero at every new sequence: steps of different sequences never
    interact, within a chunk or across. ``initial_states`` [b, h, headdim, n] is the state before
    step 0 (its sequence: the row's first). Shapes: x [b, l, h, headdim], dt [b, l, h], A [h], B/C
    [b, l, g, n] (g groups of heads share them), D [h] or [h, headdim], z like x. Returns y like x
    (and the final state [b, h, headdim, n] with ``return_final_states``). Computed in float32 (float64
    inputs stay float64), y cast to x's dtype. ``cu_seqlens`` / ``return_varlen_states`` (inference)
    are refused.
    """
    import torch
    import torch.nn.functional as F

    if cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError("mamba_chunk_scan_combined stand-in: cu_seqlens / return_varlen_states "
                                  "(varlen inference states) are not supported")
    batch, length, heads, headdim = _check_scan_shapes(x, dt, A, B, C, D, z, dt_bias, initial_states, chunk_size)
    groups, d_state = B.shape[2], B.shape[3]
    compute = torch.promote_types(x.dtype, torch.float32)
    dt = dt.to(compute)
    if dt_bias is not None:
        dt = dt + dt_bias.to(compute)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    sequence = (torch.zeros(batch, length, dtype=torch.int64, device=x.device) if seq_idx is None
                else _check_seq_idx(seq_idx, batch, length))

    # pad to whole chunks: a padded step has dt = 0 (no decay, no input) and the last step's sequence
    pad = -length % chunk_size
    chunks = (length + pad) // chunk_size

    def chunked(tensor, repeat_last=False):
        """[b, l, ...] -> [b, chunks, chunk_size, ...]; padded steps are zeros, or repeat the last step."""
        tail = tensor[:, -1:] if repeat_last else torch.zeros_like(tensor[:, :1])
        tensor = torch.cat([tensor, tail.expand(-1, pad, *tensor.shape[2:])], dim=1)
        return tensor.reshape(batch, chunks, chunk_size, *tensor.shape[2:])

    x_c = chunked(x.to(compute))  # [b, c, q, h, p]
    dt_c = chunked(dt)  # [b, c, q, h]
    per_group = heads // groups  # head h reads group h // per_group
    B_c = chunked(B.to(compute).repeat_interleave(per_group, dim=2))  # [b, c, q, h, n]
    C_c = chunked(C.to(compute).repeat_interleave(per_group, dim=2))
    seq_c = chunked(sequence, repeat_last=True)  # [b, c, q]
    log_decay = (dt_c * A.to(compute)).cumsum(dim=2)  # [b, c, q, h]: sum of dt*A up to step t of its chunk

    # within each chunk: y_t += sum_{s <= t, same sequence} (C_t . B_s) exp(cum_t - cum_s) dt_s x_s
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    together = causal & (seq_c[:, :, :, None] == seq_c[:, :, None, :])  # [b, c, t, s]
    gap = log_decay[:, :, :, None, :] - log_decay[:, :, None, :, :]  # [b, c, t, s, h]
    decay = gap.masked_fill(~together[..., None], float("-inf")).exp()
    scores = torch.einsum("bcthn,bcshn->bctsh", C_c, B_c) * decay
    y = torch.einsum("bctsh,bcsh,bcshp->bcthp", scores, dt_c, x_c)

    # each chunk's own contribution to the state at its end: its steps in its last step's sequence
    last_sequence = seq_c[:, :, -1]  # [b, c]
    to_end = (log_decay[:, :, -1:, :] - log_decay).exp() * (seq_c == last_sequence[..., None])[..., None]
    chunk_states = torch.einsum("bcsh,bcsh,bcshn,bcshp->bchpn", to_end, dt_c, B_c, x_c)

    # across chunks: the state entering chunk c reaches its steps that are still in its sequence
    state = (x.new_zeros(batch, heads, headdim, d_state, dtype=compute) if initial_states is None
             else initial_states.to(compute))
    state_sequence = seq_c[:, 0, 0]  # the initial state belongs to the row's first sequence
    carried = []
    for c in range(chunks):
        reaches = (seq_c[:, c] == state_sequence[:, None]).to(compute)  # [b, q]
        from_state = torch.einsum("bthn,bhpn->bthp", C_c[:, c], state)
        carried.append(from_state * (log_decay[:, c].exp() * reaches[..., None])[..., None])
        survives = (last_sequence[:, c] == state_sequence).to(compute)  # [b]: no new sequence in chunk c
        state = state * (log_decay[:, c, -1].exp() * survives[:, None])[..., None, None] + chunk_states[:, c]
        state_sequence = last_sequence[:, c]
    y = (y + torch.stack(carried, dim=1)).reshape(batch, chunks * chunk_size, heads, headdim)[:, :length]

    if D is not None:
        y = y + x.to(compute) * (D.to(compute)[:, None] if D.dim() == 1 else D.to(compute))
    if z is not None:
        y = y * F.silu(z.to(compute))
    y = y.to(x.dtype)
    return (y, state) if return_final_states else y


def _check_scan_shapes(x, dt, A, B, C, D, z, dt_bias, initial_states, chunk_size):
    """(batch, length, heads, headdim) of a scan's arguments; ValueError naming the one that does not fit."""
    if x.dim() != 4 or x.shape[1] < 1:
        raise ValueError(
            f"mamba_chunk_scan_combined: x must be [batch, length >= 1, heads, headdim], got {tuple(x.shape)}"
        )
    batch, length, heads, headdim = x.shape
    if B.dim() != 4 or B.shape[:2] != (batch, length) or heads % B.shape[2]:
        raise ValueError(
            f"mamba_chunk_scan_combined: B must be [batch, length, groups, d_state] with groups dividing "
            f"heads={heads}, got {tuple(B.shape)} for x {tuple(x.shape)}"
        )
    groups, d_state = B.shape[2], B.shape[3]
    expected = {
        "dt": (dt, (batch, length, heads)), "A": (A, (heads,)), "C": (C, (batch, length, groups, d_state)),
        "z": (z, tuple(x.shape)), "dt_bias": (dt_bias, (heads,)),
        "initial_states": (initial_states, (batch, heads, headdim, d_state)),
    }
    for name, (tensor, shape) in expected.items():
        if tensor is not None and tuple(tensor.shape) != shape:
            raise ValueError(f"mamba_chunk_scan_combined: {name} must have shape {shape}, got {tuple(tensor.shape)}")
    if D is not None and tuple(D.shape) not in ((heads,), (heads, headdim)):
        raise ValueError(
            f"mamba_chunk_scan_combined: D must be [{heads}] or [{heads}, {headdim}], got {tuple(D.shape)}"
        )
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"mamba_chunk_scan_combined: chunk_size must be a positive int, got {chunk_size!r}")
    return batch, length, heads, headdim


def _check_seq_idx(seq_idx, batch, length):
    """``seq_idx`` as int64 [batch, length]; ValueError unless that shape and non-decreasing along each row."""
    import torch

    if tuple(seq_idx.shape) != (batch, length):
        raise ValueError(f"seq_idx must have shape ({batch}, {length}) (batch, length), got {tuple(seq_idx.shape)}")
    sequence = seq_idx.to(torch.int64)
    if bool((sequence.diff(dim=-1) < 0).any()):
        raise ValueError("seq_idx must be non-decreasing along each row (the sequence index of each packed token)")
    return sequence


@functools.cache
def rms_norm_gated():
    """Stand-in class for ``mamba_ssm.ops.triton.layernorm_gated.RMSNorm`` (RMSNormGated in megatron-core).

    ``RMSNormGated(hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None,
    dtype=None)``, weight initialised to ones, no bias; ``forward(x, z=None)``: with ``z`` and not
    ``norm_before_gate`` the input is first gated by silu(z); then each group of ``group_size``
    features (all of them when None) is divided by its root mean square (plus ``eps`` inside the
    root) and scaled by the weight; with ``z`` and ``norm_before_gate`` the output is gated after.
    Computed in float32, returned in x's dtype. megatron-core builds it per TP rank over the local
    d_inner with one group per local Mamba group (``ssm/mamba_mixer.py:417``).
    """
    import torch
    import torch.nn.functional as F

    class RMSNormGated(torch.nn.Module):
        def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
            super().__init__()
            group_size = hidden_size if group_size is None else group_size
            if hidden_size % group_size:
                raise ValueError(f"RMSNormGated: group_size {group_size} must divide hidden_size {hidden_size}")
            self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
            self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
            self.register_parameter("bias", None)

        def forward(self, x, z=None):
            compute = torch.promote_types(x.dtype, torch.float32)
            out = x.to(compute)
            if z is not None and not self.norm_before_gate:
                out = out * F.silu(z.to(compute))
            grouped = out.reshape(*out.shape[:-1], -1, self.group_size)
            grouped = grouped * torch.rsqrt(grouped.pow(2).mean(dim=-1, keepdim=True) + self.eps)
            out = grouped.reshape(out.shape) * self.weight.to(compute)
            if z is not None and self.norm_before_gate:
                out = out * F.silu(z.to(compute))
            return out.to(x.dtype)

    RMSNormGated.__module__ = __name__
    RMSNormGated.__qualname__ = "RMSNormGated"
    return RMSNormGated
