"""The pure-torch Mamba kernel stand-ins (``cpu_shims``) against references written from the equations.

megatron-core's MambaMixer trains through ``mamba_ssm``'s fused conv + SSD scan, which has no CPU
build; the test bed stands it in. The references here are the slow obvious forms, written from the
Mamba-2 paper's definitions and independent of the stand-ins' chunked algebra:

* the selective SSM as its per-step recurrence, per head: ``state_t = exp(dt_t A) state_{t-1} +
  dt_t x_t B_t^T``, ``y_t = state_t C_t + D x_t`` (gated by silu(z_t)), the state zeroed where a new
  packed sequence starts;
* the depthwise causal conv1d as ``torch.nn.functional.conv1d`` (groups = channels, left padding)
  run on each packed sequence alone;
* the gated RMSNorm as ``torch.nn.functional.rms_norm`` on each group of features.

Tolerance: everything runs in float64. The stand-in reassociates the recurrence's sums (chunked
matrix products, exp of differences of cumulative sums instead of products of exps); an output is
a sum of at most length * d_state * headdim (< 500) terms of magnitude < 1e2, so rounding stays
below 500 * 1e2 * 2.2e-16 ~ 1e-11 (measured: at most 5e-14 over 300 random cases, outputs and
gradients up to 60 in size): ``ATOL = 1e-9`` leaves orders of margin, while a missed state reset
moves the first token of the next sequence by exp(dt A) * |state|, orders above it (the "seq_idx
off" example shows it). Gradients (what training uses) are compared the same way.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mtp_overlay.bed.runtime.mamba_kernels import (
    causal_conv1d_fn,
    mamba_chunk_scan_combined,
    mamba_split_conv1d_scan_combined,
    rms_norm_gated,
)

ATOL = 1e-9
PROPERTY = settings(max_examples=60, deadline=None)
DOUBLE = torch.float64


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tensors are tiny: torch's second intra-op thread only spins (on a shared 2-core machine,
    4x the CPU time of the tests themselves). Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_scan(x, dt, A, B, C, D=None, z=None, dt_bias=None, seq_idx=None, initial_states=None):
    """(y, final state): the Mamba-2 recurrence one time step after the other (dt through softplus).

    For every batch row and head h (reading group h // (heads / groups)): the state [headdim, d_state]
    starts from ``initial_states`` (else zero) and is zeroed at every step whose ``seq_idx`` differs
    from the step before; then ``state = exp(dt A) state + dt outer(x, B)``, ``y = state C + D x``,
    times silu(z).
    """
    batch, length, heads, headdim = x.shape
    groups, d_state = B.shape[2:]
    per_group = heads // groups
    state = torch.zeros(batch, heads, headdim, d_state, dtype=x.dtype) if initial_states is None else initial_states
    outputs = []
    for t in range(length):
        if t > 0 and seq_idx is not None:
            new_sequence = (seq_idx[:, t] != seq_idx[:, t - 1]).to(x.dtype)  # [batch]
            state = state * (1 - new_sequence)[:, None, None, None]
        step = F.softplus(dt[:, t] + (0 if dt_bias is None else dt_bias))  # [batch, heads]
        B_t, C_t = B[:, t].repeat_interleave(per_group, dim=1), C[:, t].repeat_interleave(per_group, dim=1)
        state = (torch.exp(step * A)[..., None, None] * state
                 + step[..., None, None] * x[:, t, :, :, None] * B_t[:, :, None, :])
        out = (state * C_t[:, :, None, :]).sum(-1)  # [batch, heads, headdim]
        if D is not None:
            out = out + (D[:, None] if D.dim() == 1 else D) * x[:, t]
        if z is not None:
            out = out * F.silu(z[:, t])
        outputs.append(out)
    return torch.stack(outputs, dim=1), state


def reference_conv(x, weight, bias, seq_idx):
    """Depthwise causal conv1d + silu of each packed sequence alone (torch's own conv1d)."""
    width = weight.shape[1]
    rows = []
    for b in range(x.shape[0]):
        pieces = []
        for sequence in torch.unique_consecutive(seq_idx[b]):
            part = x[b : b + 1, :, seq_idx[b] == sequence]
            conv = F.conv1d(part, weight[:, None, :], bias, padding=width - 1, groups=x.shape[1])
            pieces.append(F.silu(conv[..., : part.shape[-1]]))
        rows.append(torch.cat(pieces, dim=-1))
    return torch.cat(rows)


@st.composite
def packed_rows(draw, max_batch=2, max_length=20):
    """(batch, length, seq_idx [batch, length] int32): each row cut into sequences at random starts."""
    batch = draw(st.integers(1, max_batch))
    length = draw(st.integers(1, max_length))
    rows = []
    for _ in range(batch):
        starts = draw(st.sets(st.integers(1, length - 1), max_size=4)) if length > 1 else set()
        rows.append([sum(t >= start for start in starts) for t in range(length)])
    return batch, length, torch.tensor(rows, dtype=torch.int32)


@st.composite
def scan_cases(draw):
    batch, length, seq_idx = draw(packed_rows())
    groups = draw(st.integers(1, 2))
    heads = groups * draw(st.integers(1, 2))
    headdim, d_state = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=DOUBLE)

    d_shape = draw(st.sampled_from([None, (heads,), (heads, headdim)]))  # D per head, or per head and channel
    case = dict(
        x=randn(batch, length, heads, headdim), dt=randn(batch, length, heads),
        A=-(0.1 + 2 * torch.rand(heads, generator=generator, dtype=DOUBLE)),
        B=randn(batch, length, groups, d_state), C=randn(batch, length, groups, d_state),
        D=None if d_shape is None else randn(*d_shape),
        z=randn(batch, length, heads, headdim) if draw(st.booleans()) else None,
        dt_bias=randn(heads) if draw(st.booleans()) else None,
        initial_states=randn(batch, heads, headdim, d_state) if draw(st.booleans()) else None,
        seq_idx=seq_idx if draw(st.booleans()) else None,
    )
    return case, draw(st.integers(1, 9))


def gradients(output, inputs):
    """d <output, fixed random cotangent> / d inputs (None for inputs it does not use)."""
    cotangent = torch.randn(output.shape, generator=torch.Generator().manual_seed(0), dtype=output.dtype)
    return torch.autograd.grad((output * cotangent).sum(), inputs, allow_unused=True)


@PROPERTY
@given(scan_cases())
def test_chunked_scan_equals_the_recurrence_on_packed_rows(case_and_chunk):
    """Any heads / headdim / d_state / groups, chunk sizes that do and do not divide the length, packed
    boundaries anywhere (inside chunks or on their edges): outputs, final state and gradients."""
    case, chunk_size = case_and_chunk
    leaves = {name: value.requires_grad_() for name, value in case.items() if name != "seq_idx" and value is not None}
    y, final = mamba_chunk_scan_combined(chunk_size=chunk_size, dt_softplus=True, return_final_states=True, **case)
    reference, reference_final = reference_scan(**case)
    torch.testing.assert_close(y, reference, atol=ATOL, rtol=0)
    torch.testing.assert_close(final, reference_final, atol=ATOL, rtol=0)
    got = gradients(y, list(leaves.values()))
    want = gradients(reference, list(leaves.values()))
    for name, mine, theirs in zip(leaves, got, want):
        torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=0, msg=f"gradient of {name}")


@PROPERTY
@given(packed_rows(), st.integers(1, 12), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_causal_conv1d_equals_torch_conv1d_on_each_sequence(row, channels, width, seed):
    batch, length, seq_idx = row
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, length, generator=generator, dtype=DOUBLE, requires_grad=True)
    weight = torch.randn(channels, width, generator=generator, dtype=DOUBLE, requires_grad=True)
    bias = torch.randn(channels, generator=generator, dtype=DOUBLE, requires_grad=True)
    out = causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation="silu")
    reference = reference_conv(x, weight, bias, seq_idx)
    torch.testing.assert_close(out, reference, atol=ATOL, rtol=0)
    for mine, theirs in zip(gradients(out, [x, weight, bias]), gradients(reference, [x, weight, bias])):
        torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=0)


@PROPERTY
@given(scan_cases(), st.integers(1, 4), st.booleans())
def test_split_conv1d_scan_is_conv_then_scan_then_gate(case_and_chunk, width, per_channel_d):
    """The fused entry point megatron-core's training step calls (``ssm/mamba_mixer.py:755``): zxbcdt
    split into z | xBC | dt, xBC through the per-sequence conv + silu, the recurrence, gated by z."""
    case, chunk_size = case_and_chunk
    x, B = case["x"], case["B"]
    batch, length, heads, headdim = x.shape
    groups, d_state = B.shape[2:]
    dim, state_width = heads * headdim, 2 * groups * d_state
    generator = torch.Generator().manual_seed(1)
    zxbcdt = torch.randn(batch, length, 2 * dim + state_width + heads, generator=generator, dtype=DOUBLE)
    weight = torch.randn(dim + state_width, width, generator=generator, dtype=DOUBLE)
    bias = torch.randn(dim + state_width, generator=generator, dtype=DOUBLE)
    dt_bias, A = torch.randn(heads, generator=generator, dtype=DOUBLE), case["A"]
    D = torch.randn(heads, headdim, generator=generator, dtype=DOUBLE) if per_channel_d else torch.randn(
        heads, generator=generator, dtype=DOUBLE)
    seq_idx = case["seq_idx"] if case["seq_idx"] is not None else torch.zeros(batch, length, dtype=torch.int32)
    leaves = [tensor.requires_grad_() for tensor in (zxbcdt, weight, bias, dt_bias, A, D)]
    y = mamba_split_conv1d_scan_combined(zxbcdt, weight, bias, dt_bias, A, D, chunk_size, seq_idx=seq_idx,
                                         headdim=None if per_channel_d else headdim, ngroups=groups)

    z, xbc, dt = zxbcdt.split([dim, dim + state_width, heads], dim=-1)
    xbc = reference_conv(xbc.transpose(1, 2), weight, bias, seq_idx).transpose(1, 2)
    xs, Bs, Cs = xbc.split([dim, state_width // 2, state_width // 2], dim=-1)
    shape = (batch, length, heads, headdim)
    reference, _ = reference_scan(xs.reshape(shape), dt, A, Bs.reshape(batch, length, groups, d_state),
                                  Cs.reshape(batch, length, groups, d_state), D=D, z=z.reshape(shape), dt_bias=dt_bias,
                                  seq_idx=seq_idx)
    reference = reference.reshape(batch, length, dim)
    torch.testing.assert_close(y, reference, atol=ATOL, rtol=0)
    for mine, theirs in zip(gradients(y, leaves), gradients(reference, leaves)):
        torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=0)


@PROPERTY
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 5), st.sampled_from(["none", "after", "before"]),
       st.integers(0, 2**31 - 1))
def test_gated_rms_norm_is_torch_rms_norm_per_group(groups, group_size, tokens, gate, seed):
    generator = torch.Generator().manual_seed(seed)
    hidden = groups * group_size
    norm = rms_norm_gated()(hidden, eps=1e-5, group_size=group_size, norm_before_gate=gate == "before", dtype=DOUBLE)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=generator, dtype=DOUBLE))
    x = torch.randn(tokens, 2, hidden, generator=generator, dtype=DOUBLE)
    z = None if gate == "none" else torch.randn(tokens, 2, hidden, generator=generator, dtype=DOUBLE)
    gated = x * F.silu(z) if gate == "after" else x  # norm_before_gate=False gates the input
    grouped = gated.reshape(tokens, 2, groups, group_size)
    reference = F.rms_norm(grouped, (group_size,), eps=1e-5).reshape(x.shape) * norm.weight
    if gate == "before":
        reference = reference * F.silu(z)
    torch.testing.assert_close(norm(x, z), reference, atol=ATOL, rtol=0)
    assert norm.bias is None and [name for name, _ in norm.named_parameters()] == ["weight"]


def test_without_the_sequence_starts_the_state_runs_on_into_the_next_sequence():
    """What the resets are for: the same row with seq_idx dropped differs from each sequence alone,
    first at the second sequence's first token; with seq_idx it equals each sequence scanned alone."""
    generator = torch.Generator().manual_seed(3)
    x, dt, B, C = (torch.randn(*shape, generator=generator, dtype=DOUBLE)
                   for shape in ((1, 12, 2, 2), (1, 12, 2), (1, 12, 1, 3), (1, 12, 1, 3)))
    A = -torch.ones(2, dtype=DOUBLE)
    seq_idx = torch.tensor([[0] * 5 + [1] * 7], dtype=torch.int32)
    packed = mamba_chunk_scan_combined(x, dt, A, B, C, 4, seq_idx=seq_idx, dt_softplus=True)
    alone = torch.cat([mamba_chunk_scan_combined(x[:, s], dt[:, s], A, B[:, s], C[:, s], 4, dt_softplus=True)
                       for s in (slice(0, 5), slice(5, 12))], dim=1)
    leaking = mamba_chunk_scan_combined(x, dt, A, B, C, 4, dt_softplus=True)
    torch.testing.assert_close(packed, alone, atol=ATOL, rtol=0)
    torch.testing.assert_close(leaking[:, :5], alone[:, :5], atol=ATOL, rtol=0)
    assert (leaking[:, 5] - alone[:, 5]).abs().max() > 1e-3


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda a: mamba_chunk_scan_combined(**a, cu_seqlens=torch.tensor([0, 4])),
         "cu_seqlens / return_varlen_states"),
        (lambda a: mamba_chunk_scan_combined(**dict(a, seq_idx=torch.tensor([[1, 0, 0, 0]]))), "non-decreasing"),
        (lambda a: mamba_chunk_scan_combined(**dict(a, seq_idx=torch.zeros(1, 3))),
         r"seq_idx must have shape \(1, 4\)"),
        (lambda a: mamba_chunk_scan_combined(**dict(a, A=torch.ones(3))), r"A must have shape \(2,\)"),
        (lambda a: mamba_chunk_scan_combined(**dict(a, chunk_size=0)), "chunk_size must be a positive int"),
        (lambda a: causal_conv1d_fn(torch.zeros(1, 2, 4), torch.zeros(2, 3), activation="relu"), "activation must be"),
        (lambda a: mamba_split_conv1d_scan_combined(torch.zeros(1, 4, 9), torch.zeros(6, 4), None, None, -torch.ones(1),
                                                    torch.ones(1), 4, headdim=2, rmsnorm_weight=torch.ones(2)),
         "rmsnorm_weight is not supported"),
        (lambda a: mamba_split_conv1d_scan_combined(torch.zeros(1, 4, 10), torch.zeros(6, 4), None, None,
                                                    -torch.ones(1), torch.ones(1), 4, headdim=2),
         r"zxbcdt's last dimension must be .* = 9"),
    ],
)
def test_bad_arguments_are_refused_naming_them(call, message):
    arguments = dict(x=torch.zeros(1, 4, 2, 1), dt=torch.zeros(1, 4, 2), A=-torch.ones(2), B=torch.zeros(1, 4, 1, 3),
                     C=torch.zeros(1, 4, 1, 3), chunk_size=2)
    with pytest.raises((ValueError, NotImplementedError), match=message):
        call(arguments)
