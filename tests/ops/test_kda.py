"""KDA prefill and decode references against the token-by-token recurrence (an independent formulation).

The chunked reference (fp32) is compared with `kda_recurrent_naive` run in float64 on the same inputs, with
q/k normalisation, beta activation and the gate computed here from their formulas, not by the code under
test; flags, random batches and the GPU run use `kda_prefill_naive` (the same loop behind the op's signature).
Decode is checked by chaining `kda_decode` token by token against the prefill pipeline (short_conv, kda_prefill,
gated_rms_norm) over the whole sequence.
Tolerances (relative, per tensor): fp32 outputs and states 1e-5; bf16 outputs 1e-2 (a bf16 ulp is 2^-8, the
output cast costs at most half of that per element); states of bf16 runs 1e-5 (states stay fp32).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rocm_k3.ops import kda
from rocm_k3.ops.kda import KDAGateParams
from rocm_k3.ops.kda.naive import kda_prefill_naive, kda_recurrent_naive
from rocm_k3.ops.kda.reference import FACTOR_LIMIT
from tests.helpers import assert_rel, seeded
from tests.model_fixtures import one_thread  # noqa: F401 (autouse: one intra-op thread)

FP32_TOL = 1e-5
BF16_OUT_TOL = 1e-2
LENGTHS = (1, 63, 64, 65, 130, 200)


def _cu(lengths: list[int] | tuple[int, ...]) -> torch.Tensor:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32)


def _l2norm64(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()


def _gate64(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    H, K = f.shape[1], f.shape[2]
    x = f.double() + dt_bias.double().view(H, K)
    a = A_log.double().exp().view(H, 1)
    if lower_bound is None:
        return -a * torch.log1p(torch.exp(x))
    return lower_bound / (1.0 + torch.exp(-a * x))


class Case:
    """Random inputs of one varlen prefill call (raw gate input f + gate params, beta logits)."""

    def __init__(self, lengths, H, K, V, *, seed, dtype=torch.float32, lower_bound=-5.0, a_scale=1.0, slots=None):
        gen = seeded(seed)
        self.lengths, self.H, self.K, self.V = list(lengths), H, K, V
        T, N = sum(lengths), len(lengths)
        self.cu = _cu(lengths)
        self.q = torch.randn(T, H, K, generator=gen).to(dtype)
        self.k = torch.randn(T, H, K, generator=gen).to(dtype)
        self.v = torch.randn(T, H, V, generator=gen).to(dtype)
        self.f = torch.randn(T, H, K, generator=gen).to(dtype)
        self.beta = torch.randn(T, H, generator=gen).to(dtype)
        self.A_log = (torch.rand(H, generator=gen) * a_scale + 0.1).log()
        self.dt_bias = 0.5 * torch.randn(H * K, generator=gen)
        self.lower_bound = lower_bound
        self.slots = list(range(N)) if slots is None else list(slots)
        self.pool = torch.randn(max(self.slots) + 2, H, K, V, generator=gen)  # spare slot never used

    @property
    def gate_params(self) -> KDAGateParams:
        return KDAGateParams(self.A_log, self.dt_bias, self.lower_bound)

    def run(self, has_init, *, positions=None, gate_in_kernel=True, state=None):
        state = self.pool.clone() if state is None else state
        g = self.f if gate_in_kernel else _gate64(self.f, self.A_log, self.dt_bias, self.lower_bound).float()
        out = kda.kda_prefill(
            self.q, self.k, self.v, g, self.beta, self.cu, state,
            torch.tensor(self.slots, dtype=torch.int32), torch.tensor(has_init, dtype=torch.bool),
            gate_params=self.gate_params if gate_in_kernel else None,
            intermediate_positions=positions, backend="reference",
        )
        return out, state

    def naive(self, seq: int, has_init: bool, upto: int | None = None):
        """float64 recurrence over the first `upto` tokens (default all) of sequence `seq`."""
        start = int(self.cu[seq])
        end = start + (self.lengths[seq] if upto is None else upto)
        sl = slice(start, end)
        g = _gate64(self.f[sl], self.A_log, self.dt_bias, self.lower_bound)
        init = self.pool[self.slots[seq]].double() if has_init else None
        return kda_recurrent_naive(
            _l2norm64(self.q[sl]), _l2norm64(self.k[sl]), self.v[sl].double(), g,
            torch.sigmoid(self.beta[sl].double()), self.K**-0.5, init,
        )


def _has_init(n: int, mode: str) -> list[bool]:
    return [False] * n if mode == "noinit" else [i % 3 != 1 for i in range(n)]


@pytest.mark.parametrize("init", ["noinit", "init"])
@pytest.mark.parametrize(
    "H,K,V,lower_bound",
    [(1, 32, 32, -5.0), (3, 64, 64, -5.0), (3, 32, 32, None), (1, 64, 64, None), (3, 32, 64, -5.0)],
    ids=["H1-D32-safe", "H3-D64-safe", "H3-D32-softplus", "H1-D64-softplus", "H3-K32-V64-safe"],
)
def test_prefill_matches_recurrence(H, K, V, lower_bound, init):
    case = Case(LENGTHS, H, K, V, seed=H * 100 + K + V, lower_bound=lower_bound, slots=[4, 0, 6, 2, 5, 1])
    has = _has_init(len(LENGTHS), init)
    out, state = case.run(has)
    assert out.intermediate_states is None
    assert out.o.dtype == torch.float32 and out.o.shape == (sum(LENGTHS), H, V)
    for i, length in enumerate(LENGTHS):
        o_ref, s_ref = case.naive(i, has[i])
        sl = slice(int(case.cu[i]), int(case.cu[i + 1]))
        assert_rel(out.o[sl], o_ref, FP32_TOL, f"o of seq {i} (len {length})")
        assert_rel(state[case.slots[i]], s_ref, FP32_TOL, f"final state of seq {i} (len {length})")


def test_prefill_precomputed_gate_matches_gate_params():
    """g given as the fp32 log-decay (gate_params=None) gives the same result as the raw input + params."""
    case = Case((70, 5), 2, 32, 32, seed=7)
    has = [True, False]
    out_params, state_params = case.run(has)
    out_g, state_g = case.run(has, gate_in_kernel=False)
    assert_rel(out_g.o, out_params.o, FP32_TOL, "o")
    assert_rel(state_g, state_params, FP32_TOL, "state pool")


def test_prefill_strong_decay_stays_finite():
    """Softplus gate with large A: in-chunk log-decay sums reach the thousands; nothing over/underflows."""
    case = Case((150,), 2, 32, 32, seed=11, lower_bound=None, a_scale=50.0)
    out, state = case.run([True])
    g = _gate64(case.f, case.A_log, case.dt_bias, None)
    assert g.sum(0).min() < -1000  # the regime this test is about
    o_ref, s_ref = case.naive(0, True)
    assert_rel(out.o, o_ref, FP32_TOL, "o")
    assert_rel(state[0], s_ref, FP32_TOL, "final state")


def _weak_decay(case: Case) -> Case:
    """Per-token decay above -FACTOR_LIMIT / 64: every chunk stays within the limit (the factored products)."""
    case.A_log = torch.zeros_like(case.A_log)  # a = 1
    case.dt_bias = torch.full_like(case.dt_bias, -7.0)
    g = _gate64(case.f, case.A_log, case.dt_bias, case.lower_bound)
    assert -g.min() * 64 < FACTOR_LIMIT
    return case


def test_prefill_weak_decay_factored_products_match_recurrence():
    case = _weak_decay(Case((128, 5), 2, 32, 32, seed=13))
    out, state = case.run([False, True])
    for i in range(2):
        o_ref, s_ref = case.naive(i, i == 1)
        sl = slice(int(case.cu[i]), int(case.cu[i + 1]))
        assert_rel(out.o[sl], o_ref, FP32_TOL, f"o of seq {i}")
        assert_rel(state[case.slots[i]], s_ref, FP32_TOL, f"final state of seq {i}")


@pytest.mark.parametrize("decay", ["weak", "safe_gate"])
def test_prefill_gradients_match_recurrence(decay):
    """The reference is differentiable (training runs through it): the gradients of a weighted sum of its outputs
    with respect to every input match autograd through the float64 recurrence, on both product paths (weak:
    factored; safe gate: pairwise differences)."""
    case = Case((70,), 2, 16, 16, seed=17)
    if decay == "weak":
        _weak_decay(case)
    leaves = [t.clone().requires_grad_() for t in (case.q, case.k, case.v, case.f, case.beta)]
    weight = torch.randn(70, 2, 16, generator=seeded(3))
    q, k, v, f, beta = leaves
    out = kda.kda_prefill(q, k, v, f, beta, case.cu, torch.zeros(1, 2, 16, 16), torch.zeros(1, dtype=torch.int32),
                          torch.zeros(1, dtype=torch.bool), gate_params=case.gate_params, backend="reference")
    grads = torch.autograd.grad((out.o * weight).sum(), leaves)
    o_ref, _ = kda_recurrent_naive(_l2norm64(q), _l2norm64(k), v.double(), _gate64(f, case.A_log, case.dt_bias, -5.0),
                                   torch.sigmoid(beta.double()), 16**-0.5)
    refs = torch.autograd.grad((o_ref * weight.double()).sum(), leaves)
    for name, g, ref in zip("q k v f beta".split(), grads, refs):
        assert_rel(g, ref, 1e-4, f"d/d{name}")


def test_intermediate_states_match_recurrence():
    lengths = (1, 63, 64, 65, 130, 200)
    case = Case(lengths, 3, 32, 32, seed=21, slots=[2, 5, 0, 1, 4, 3])
    has = _has_init(len(lengths), "init")
    rows = [(5, 100), (4, 64), (0, 1), (3, 65), (3, 1), (4, 129), (5, 200), (1, 63), (5, 100), (4, 130), (2, 37)]
    positions = torch.tensor(rows, dtype=torch.int32)
    out, state = case.run(has, positions=positions)
    assert out.intermediate_states.shape == (len(rows), 3, 32, 32)
    for m, (seq, p) in enumerate(rows):
        _, s_ref = case.naive(seq, has[seq], upto=p)
        assert_rel(out.intermediate_states[m], s_ref, FP32_TOL, f"intermediate state {m} = (seq {seq}, p {p})")
    # splitting chunks at the positions must not change the outputs or the final states
    out_plain, state_plain = case.run(has)
    assert_rel(out.o, out_plain.o, FP32_TOL, "o with vs without intermediate positions")
    assert_rel(state, state_plain, FP32_TOL, "state pool with vs without intermediate positions")


@pytest.mark.parametrize(
    "qk_l2norm,beta_logits,scale",
    [(False, False, 0.3), (True, False, None), (False, True, 1.0), (True, True, 0.05)],
    ids=["raw-qk-raw-beta-s0.3", "l2norm-raw-beta", "raw-qk-beta-logits-s1", "default-flags-s0.05"],
)
def test_prefill_options_match_naive_twin(qk_l2norm, beta_logits, scale):
    """Every flag of kda_prefill against kda_prefill_naive (float64, token loop, its own preprocessing)."""
    lengths = (3, 64, 97)
    case = Case(lengths, 2, 32, 32, seed=81, slots=[1, 3, 0])
    if not qk_l2norm:  # keep |k|^2 near 1 so the un-normalised delta rule stays contractive
        case.q, case.k = case.q / 32**0.5, case.k / 32**0.5
    beta = case.beta if beta_logits else torch.sigmoid(case.beta)
    positions = torch.tensor([[1, 50], [2, 97], [0, 2]], dtype=torch.int32)
    args = (case.q, case.k, case.v, case.f, beta, case.cu)
    slots, has = torch.tensor(case.slots, dtype=torch.int32), torch.tensor([True, False, True])
    options = {"scale": scale, "gate_params": case.gate_params, "qk_l2norm": qk_l2norm, "beta_logits": beta_logits,
                   "intermediate_positions": positions}
    state, state_naive = case.pool.clone(), case.pool.clone()
    out = kda.kda_prefill(*args, state, slots, has, **options, backend="reference")
    ref = kda_prefill_naive(*args, state_naive, slots, has, **options)
    assert_rel(out.o, ref.o, FP32_TOL, "o")
    assert_rel(out.intermediate_states, ref.intermediate_states, FP32_TOL, "intermediate states")
    assert_rel(state, state_naive, FP32_TOL, "state pool")


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 130), min_size=1, max_size=4),
    H=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_prefill_random_batches_match_naive_twin(lengths, H, seed, data):
    """Random varlen batches (empty sequences included), random initial-state flags and positions."""
    N = len(lengths)
    case = Case(lengths, H, 16, 16, seed=seed, slots=list(range(N))[::-1])
    has = data.draw(st.lists(st.booleans(), min_size=N, max_size=N), label="has_initial_state")
    candidates = [(i, p) for i, n in enumerate(lengths) for p in range(1, n + 1)]
    rows = data.draw(st.lists(st.sampled_from(candidates), max_size=5), label="positions") if candidates else []
    positions = torch.tensor(rows, dtype=torch.int32).view(-1, 2)
    out, state = case.run(has, positions=positions)
    state_naive = case.pool.clone()
    ref = kda_prefill_naive(case.q, case.k, case.v, case.f, case.beta, case.cu, state_naive,
                            torch.tensor(case.slots, dtype=torch.int32), torch.tensor(has, dtype=torch.bool),
                            gate_params=case.gate_params, intermediate_positions=positions)
    assert_rel(out.o, ref.o, FP32_TOL, "o")
    assert_rel(out.intermediate_states, ref.intermediate_states, FP32_TOL, "intermediate states")
    assert_rel(state, state_naive, FP32_TOL, "state pool")


def test_intermediate_positions_empty():
    case = Case((10, 3), 1, 32, 32, seed=3)
    out, _ = case.run([False, False], positions=torch.zeros(0, 2, dtype=torch.int32))
    assert out.intermediate_states.shape == (0, 1, 32, 32)


def test_slot_indexing_and_untouched_slots():
    """Permuted, scattered slots of a non-contiguous pool (every other slot of a larger tensor); slots without
    initial state are never read (NaN there must not leak); everything not named in the call stays
    bit-identical."""
    lengths = (65, 1, 130)
    case = Case(lengths, 2, 32, 32, seed=31, slots=[6, 1, 3])
    backing = torch.randn(16, 2, 32, 32, generator=seeded(5))
    backing[2] = float("nan")  # pool slot 1: the slot of seq 1, which starts fresh
    before = backing.clone()
    state = backing[::2]  # [8, H, K, V], non-contiguous view
    assert not state.is_contiguous()
    case.pool = state.clone()
    has = [True, False, True]
    out, state = case.run(has, state=state)
    assert state.data_ptr() == backing.data_ptr(), "written in place into the caller's pool"
    assert torch.equal(backing[1::2], before[1::2]), "storage between the pool's slots changed"
    for slot in (0, 2, 4, 5, 7):
        assert torch.equal(state[slot], before[2 * slot]), f"slot {slot} is not in state_indices but changed"
    for i in range(len(lengths)):
        o_ref, s_ref = case.naive(i, has[i])
        sl = slice(int(case.cu[i]), int(case.cu[i + 1]))
        assert_rel(out.o[sl], o_ref, FP32_TOL, f"o of seq {i}")
        assert_rel(state[case.slots[i]], s_ref, FP32_TOL, f"state of seq {i} in slot {case.slots[i]}")


def test_empty_sequence_passes_state_through():
    case = Case((0, 20, 0), 1, 32, 32, seed=41, slots=[2, 0, 1])
    out, state = case.run([True, True, False])
    assert torch.equal(state[2], case.pool[2]), "a length-0 sequence with initial state keeps it"
    assert torch.equal(state[1], torch.zeros_like(state[1])), "a length-0 fresh sequence leaves a zero state"
    o_ref, s_ref = case.naive(1, True)
    assert_rel(out.o, o_ref, FP32_TOL, "o")
    assert_rel(state[0], s_ref, FP32_TOL, "state of seq 1")


def test_bf16_inputs():
    case = Case((90, 37), 2, 64, 64, seed=51, dtype=torch.bfloat16)
    has = [True, False]
    out, state = case.run(has)
    assert out.o.dtype == torch.bfloat16
    for i in range(2):
        o_ref, s_ref = case.naive(i, has[i])
        sl = slice(int(case.cu[i]), int(case.cu[i + 1]))
        assert_rel(out.o[sl], o_ref, BF16_OUT_TOL, f"bf16 o of seq {i}")
        assert_rel(state[case.slots[i]], s_ref, FP32_TOL, f"fp32 state of seq {i} from bf16 inputs")


# ---- decode: token-by-token kda_decode == the prefill pipeline over the whole sequence ----


class LayerInputs:
    """Pre-conv projections of N equal-length sequences for one KDA layer, and its parameters."""

    def __init__(self, N, T, H, K, W, *, seed, lower_bound):
        gen = seeded(seed)
        self.N, self.T, self.H, self.K, self.W = N, T, H, K, W
        self.qkv = torch.randn(N, T, 3 * H * K, generator=gen)
        self.f = torch.randn(N, T, H * K, generator=gen)
        self.beta = torch.randn(N, T, H, generator=gen)
        self.out_gate = torch.randn(N, T, H * K, generator=gen)
        self.conv_weight = 0.5 * torch.randn(3 * H * K, W, generator=gen)
        self.A_log = (torch.rand(H, generator=gen) + 0.1).log()
        self.dt_bias = 0.5 * torch.randn(H * K, generator=gen)
        self.o_norm_weight = 1.0 + 0.1 * torch.randn(K, generator=gen)
        self.lower_bound = lower_bound

    def prefill(self, start, end, conv_state, state, slots, has_init):
        """short_conv + split + (kda_gate inside) kda_prefill + gated_rms_norm over tokens [start, end)."""
        N, H, K, L = self.N, self.H, self.K, end - start

        def flat(x: torch.Tensor) -> torch.Tensor:  # [N, T, ...] -> [N*L, ...] over tokens [start, end)
            return x[:, start:end].reshape(N * L, *x.shape[2:])

        cu = torch.arange(N + 1, dtype=torch.int32) * L
        slot_t = torch.tensor(slots, dtype=torch.int32)
        has_t = torch.tensor(has_init, dtype=torch.bool)
        mixed = kda.short_conv(flat(self.qkv), self.conv_weight, cu, conv_state=conv_state,
                               state_indices=slot_t, has_initial_state=has_t, backend="reference")
        q, k, v = mixed.view(N * L, 3, H, K).unbind(1)
        out = kda.kda_prefill(q, k, v, flat(self.f).view(N * L, H, K), flat(self.beta), cu, state, slot_t, has_t,
                              gate_params=KDAGateParams(self.A_log, self.dt_bias, self.lower_bound),
                              backend="reference")
        y = kda.gated_rms_norm(out.o, flat(self.out_gate).view(N * L, H, K), self.o_norm_weight,
                               backend="reference")
        return y.view(N, L, H * K)

    def decode(self, t, conv_state, state, slots):
        return kda.kda_decode(
            self.qkv[:, t], self.f[:, t], self.beta[:, t], self.out_gate[:, t], self.conv_weight, conv_state,
            self.A_log, self.dt_bias, self.o_norm_weight, state, torch.tensor(slots, dtype=torch.int32),
            num_heads=self.H, lower_bound=self.lower_bound, backend="reference",
        )


@pytest.mark.parametrize("prefix", [0, 37], ids=lambda p: f"prefill{p}")
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["safe", "softplus"])
def test_decode_chain_matches_prefill(prefix, lower_bound):
    N, T, H, K, W, S = 2, 70, 2, 32, 4, 4
    layer = LayerInputs(N, T, H, K, W, seed=61 + prefix, lower_bound=lower_bound)
    slots = [3, 1]
    conv0 = torch.randn(S, 3 * H * K, W - 1, generator=seeded(1))
    state0 = torch.randn(S, H, K, K, generator=seeded(2))
    has_init = [True, False]
    conv_full, state_full = conv0.clone(), state0.clone()
    y_full = layer.prefill(0, T, conv_full, state_full, slots, has_init)  # [N, T, H*K]

    conv, state = conv0.clone(), state0.clone()
    for i, slot in enumerate(slots):  # decode always continues a state: a fresh sequence starts from zeros
        if not has_init[i]:
            conv[slot].zero_()
            state[slot].zero_()
    parts = []
    if prefix:
        parts.append(layer.prefill(0, prefix, conv, state, slots, [True, True]))
    for t in range(prefix, T):
        parts.append(layer.decode(t, conv, state, slots).unsqueeze(1))
    y_steps = torch.cat(parts, dim=1)
    assert_rel(y_steps, y_full, FP32_TOL, "decode chain output")
    for slot in slots:
        assert_rel(state[slot], state_full[slot], FP32_TOL, f"recurrent state of slot {slot}")
        assert torch.equal(conv[slot], conv_full[slot]), f"conv state of slot {slot} (raw inputs, must be exact)"
    for slot in set(range(S)) - set(slots):
        assert torch.equal(state[slot], state0[slot]) and torch.equal(conv[slot], conv0[slot])


def test_decode_bf16_matches_fp32():
    """bf16 activations through kda_decode: y within 1e-2 of the fp32 run on the same (rounded) inputs."""
    N, H, K, W, S = 3, 2, 32, 4, 5
    layer = LayerInputs(N, 1, H, K, W, seed=71, lower_bound=-5.0)
    slots = [4, 0, 2]
    conv0 = torch.randn(S, 3 * H * K, W - 1, generator=seeded(3)).bfloat16()
    state0 = torch.randn(S, H, K, K, generator=seeded(4))
    args = [x[:, 0].bfloat16() for x in (layer.qkv, layer.f, layer.beta, layer.out_gate)]
    conv_bf, state_bf = conv0.clone(), state0.clone()
    y_bf = kda.kda_decode(*args, layer.conv_weight.bfloat16(), conv_bf, layer.A_log, layer.dt_bias,
                          layer.o_norm_weight.bfloat16(), state_bf, torch.tensor(slots, dtype=torch.int32),
                          num_heads=H, lower_bound=-5.0, backend="reference")
    conv32, state32 = conv0.float(), state0.clone()
    y32 = kda.kda_decode(*[a.float() for a in args], layer.conv_weight.bfloat16().float(), conv32, layer.A_log,
                         layer.dt_bias, layer.o_norm_weight.bfloat16().float(), state32,
                         torch.tensor(slots, dtype=torch.int32), num_heads=H, lower_bound=-5.0,
                         backend="reference")
    assert y_bf.dtype == torch.bfloat16
    assert_rel(y_bf, y32, BF16_OUT_TOL, "bf16 decode output")
    assert_rel(state_bf, state32, FP32_TOL, "state pool")
    assert torch.equal(conv_bf.float(), conv32), "conv state holds the raw inputs"


# ---- the references are device-agnostic: same results on an NVIDIA GPU (cuda tier, run on the H200) ----


@pytest.mark.cuda
def test_reference_on_cuda_matches_naive():
    """Chunked prefill on the GPU (K = V = 128, several chunks, slots, intermediate positions) against the
    float64 token loop on the GPU; and kda_decode on the GPU against the same op on the CPU."""
    dev = torch.device("cuda")
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is meant to run in full fp32
    try:
        lengths = (300, 1, 64, 129)
        case = Case(lengths, 4, 128, 128, seed=91, slots=[3, 0, 5, 1])

        def to(t: torch.Tensor) -> torch.Tensor:
            return t.to(dev, copy=True)

        slots, has = torch.tensor(case.slots, dtype=torch.int32), torch.tensor([True, False, True, False])
        positions = torch.tensor([[0, 128], [0, 200], [3, 129], [2, 64]], dtype=torch.int32)
        args = [to(t) for t in (case.q, case.k, case.v, case.f, case.beta, case.cu)]
        params = KDAGateParams(to(case.A_log), to(case.dt_bias), -5.0)
        state, state_naive = to(case.pool), to(case.pool)
        out = kda.kda_prefill(*args, state, to(slots), to(has), gate_params=params,
                              intermediate_positions=to(positions), backend="reference")
        ref = kda_prefill_naive(*args, state_naive, to(slots), to(has), gate_params=params,
                                intermediate_positions=to(positions))
        assert out.o.is_cuda and out.intermediate_states.is_cuda
        assert_rel(out.o, ref.o, FP32_TOL, "o on cuda")
        assert_rel(out.intermediate_states, ref.intermediate_states, FP32_TOL, "intermediate states on cuda")
        assert_rel(state, state_naive, FP32_TOL, "state pool on cuda")

        layer = LayerInputs(3, 1, 4, 128, 4, seed=93, lower_bound=-5.0)
        conv0 = torch.randn(6, 3 * 4 * 128, 3, generator=seeded(5))
        state0 = torch.randn(6, 4, 128, 128, generator=seeded(6))
        step_slots = torch.tensor([4, 0, 2], dtype=torch.int32)
        results = []
        for device in (torch.device("cpu"), dev):
            conv, st = conv0.to(device, copy=True), state0.to(device, copy=True)
            y = kda.kda_decode(
                *[x[:, 0].to(device) for x in (layer.qkv, layer.f, layer.beta, layer.out_gate)],
                layer.conv_weight.to(device), conv, layer.A_log.to(device), layer.dt_bias.to(device),
                layer.o_norm_weight.to(device), st, step_slots.to(device), num_heads=4, lower_bound=-5.0,
                backend="reference",
            )
            results.append((y.cpu(), conv.cpu(), st.cpu()))
        (y_cpu, conv_cpu, st_cpu), (y_gpu, conv_gpu, st_gpu) = results
        assert_rel(y_gpu, y_cpu, FP32_TOL, "decode y, cuda vs cpu")
        assert_rel(st_gpu, st_cpu, FP32_TOL, "decode state, cuda vs cpu")
        assert torch.equal(conv_gpu, conv_cpu)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
