"""Sampler correctness against straightforward per-row references (numpy float64) and HF's repetition processor."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from strataserve.types.sampling import SamplingParams as SP
from strataserve.runner.penalties import apply_penalties
from strataserve.runner.sampler import Sampler, SamplingRequest, row_argmax
from strataserve.runner.sampling_filters import filtered_logits

V = 64


def _logits(rows: int, vocab: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def _req(params: SP, out: list[int] | None = None, prompt: list[int] | None = None, eos: int | None = None) -> SamplingRequest:
    return SamplingRequest(params, prompt if prompt is not None else [1, 2, 3], list(out or []), eos)


def ref_filtered_probs(x: np.ndarray, p: SP) -> np.ndarray:
    """Per-row reference: temperature, then min-p, then top-k (ties kept), then top-p on the renormalised rest."""
    z = x.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep = np.ones_like(probs, dtype=bool)
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    if 0 < p.top_k < len(z) and keep.sum() > p.top_k:
        kth = np.sort(z[keep])[::-1][p.top_k - 1]
        keep &= z >= kth
    if p.top_p < 1.0:
        q = np.where(keep, probs, 0.0)
        q /= q.sum()
        order = np.argsort(-q, kind="stable")
        before = np.cumsum(q[order]) - q[order]
        keep[order[before >= p.top_p]] = False
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


FILTER_CASES = [
    SP(temperature=1.0),
    SP(temperature=0.5),
    SP(temperature=1.7),
    SP(temperature=1.0, top_k=1),
    SP(temperature=0.8, top_k=5),
    SP(temperature=1.0, top_p=0.5),
    SP(temperature=1.3, top_p=0.9),
    SP(temperature=1.0, min_p=0.2),
    SP(temperature=0.9, min_p=0.05, top_k=10, top_p=0.8),
    SP(temperature=1.0, top_k=20, top_p=0.95),
    SP(temperature=1.0, top_k=0),
]


def test_greedy_is_argmax_of_raw_logits() -> None:
    x = _logits(7, seed=1)
    toks, lps = Sampler()(x, [_req(SP(temperature=0.0)) for _ in range(7)])
    assert toks == x.argmax(-1).tolist()
    assert lps == [None] * 7


@pytest.mark.parametrize("sort_top_p", [False, True])  # the CPU's candidate search, the accelerators' full sort
def test_filtered_distribution_matches_reference_in_one_mixed_batch(sort_top_p) -> None:
    x = _logits(len(FILTER_CASES), seed=2)
    got = filtered_logits(x, FILTER_CASES, sort_top_p).softmax(-1).double().numpy()
    for i, p in enumerate(FILTER_CASES):
        want = ref_filtered_probs(x[i].numpy(), p)
        np.testing.assert_allclose(got[i], want, atol=2e-6, err_msg=str(p))
        # The filters really removed something where they should (guards against a vacuous reference).
        assert ((want > 0).sum() < V) == (p.top_k not in (0, -1) or p.top_p < 1 or p.min_p > 0)


@pytest.mark.parametrize("sort_top_p", [False, True])
def test_top_p_cutoff_search_over_large_vocab_matches_reference(sort_top_p) -> None:
    """Peaky, medium and flat rows: the cut-off is found among 64 candidates, among 1024, or by a full sort."""
    vocab = 20_000
    cases = [
        (8.0, SP(top_p=0.9)),
        (4.0, SP(top_p=0.95)),
        (0.3, SP(top_p=0.5)),
        (3.0, SP(top_k=100)),
        (3.0, SP(top_k=100, top_p=0.8)),
        (0.5, SP(top_k=2000, top_p=0.7)),
        (8.0, SP(top_k=3000)),
        (8.0, SP(min_p=0.01, top_p=0.99)),
        (1.0, SP()),
    ]
    x = torch.cat([_logits(1, vocab=vocab, seed=20 + i, scale=sc) for i, (sc, _) in enumerate(cases)])
    params = [p for _, p in cases]
    got = filtered_logits(x, params, sort_top_p).softmax(-1).double().numpy()
    sizes = []
    for i, p in enumerate(params):
        want = ref_filtered_probs(x[i].numpy(), p)
        np.testing.assert_allclose(got[i], want, atol=1e-6, err_msg=str(p))
        sizes.append(int((want > 0).sum()))
    assert sizes[0] < 64 < sizes[1] < 1024 < sizes[2], sizes  # all three search depths are used


def test_temperature_scales_logits() -> None:
    x = _logits(3, seed=3)
    got = Sampler.filtered_logits(x, [SP(temperature=t) for t in (0.25, 1.0, 4.0)]).softmax(-1)
    for i, t in enumerate((0.25, 1.0, 4.0)):
        torch.testing.assert_close(got[i], torch.softmax(x[i] / t, -1))


@pytest.mark.parametrize("params", [SP(top_k=3), SP(top_p=0.3), SP(min_p=0.3), SP(top_k=8, top_p=0.6, min_p=0.1, temperature=2.0)])
def test_filters_never_pick_masked_token(params: SP) -> None:
    x = _logits(1, seed=4)
    support = set(np.nonzero(ref_filtered_probs(x[0].numpy(), params))[0].tolist())
    assert 1 <= len(support) < V
    n = 600
    toks, _ = Sampler()(x.expand(n, V).contiguous(), [_req(SP(**{**_fields(params), "seed": s})) for s in range(n)])
    assert set(toks) <= support
    assert len(set(toks)) == len(support) or len(support) > 20  # small supports get fully explored


def _fields(p: SP) -> dict:
    return {k: getattr(p, k) for k in ("temperature", "top_k", "top_p", "min_p")}


def _chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    exp = probs * counts.sum()
    m = exp > 0
    assert counts[~m].sum() == 0, "drew a zero-probability token"
    return float((((counts - exp) ** 2)[m] / exp[m]).sum())


@pytest.mark.parametrize("seeded", [False, True])
def test_empirical_frequencies_match_target(seeded: bool) -> None:
    vocab = 8
    params = SP(temperature=0.7, top_k=6)
    x = _logits(1, vocab=vocab, seed=5, scale=1.0)
    target = ref_filtered_probs(x[0].numpy(), params)
    n = 40_000
    torch.manual_seed(1234)
    reqs = [_req(SP(temperature=0.7, top_k=6, seed=s if seeded else None)) for s in range(n)]
    toks, _ = Sampler()(x.expand(n, vocab).contiguous(), reqs)
    counts = np.bincount(toks, minlength=vocab).astype(np.float64)
    # 5 degrees of freedom (6 tokens in the support); 20.5 is the 0.999 quantile.
    assert _chi_square(counts, target) < 20.5


def test_seeded_stream_positions_are_independent() -> None:
    """One seeded request over many steps also follows the target (the per-step mixing is not degenerate)."""
    vocab = 4
    x = torch.tensor([[0.0, 0.5, 1.0, -1.0]])
    target = torch.softmax(x[0].double(), -1).numpy()
    sampler = Sampler()
    req = _req(SP(seed=7))
    for _ in range(8000):
        tok, _ = sampler(x, [req])
        req.output_token_ids.append(tok[0])
    assert _chi_square(np.bincount(req.output_token_ids, minlength=vocab).astype(np.float64), target) < 16.3  # df 3, 0.999


def test_seed_reproducible_across_batch_composition_and_preemption() -> None:
    sampler = Sampler()
    params = SP(temperature=1.0, top_p=0.95, seed=42)
    steps = 12
    logits_per_step = [_logits(1, seed=100 + s, scale=0.5) for s in range(steps)]

    def run(batch_size: int, seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        out: list[int] = []
        for s in range(steps):
            others = [_req(SP(temperature=float(rng.uniform(0.5, 1.5)), seed=None if k % 2 else int(rng.integers(1e6)))) for k in range(batch_size - 1)]
            pos = int(rng.integers(batch_size))
            reqs = others[:pos] + [_req(params, out=list(out))] + others[pos:]
            x = _logits(batch_size, seed=seed * 1000 + s, scale=0.5)
            x[pos] = logits_per_step[s][0]
            toks, _ = sampler(x, reqs)
            out.append(toks[pos])
        return out

    alone = run(1, 0)
    assert run(5, 1) == alone
    assert run(17, 2) == alone
    assert len(set(alone)) > 3  # it did sample, not argmax every time
    # Recompute after preemption: a fresh request object carrying the earlier outputs draws the same next token.
    resumed = [sampler(logits_per_step[s], [_req(params, out=alone[:s])])[0][0] for s in range(steps)]
    assert resumed == alone
    other_seed = [sampler(logits_per_step[s], [_req(SP(temperature=1.0, top_p=0.95, seed=43), out=alone[:s])])[0][0] for s in range(steps)]
    assert other_seed != alone


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_n() -> None:
    x = _logits(4, seed=6)
    params = [SP(temperature=0.0, logprobs=3), SP(temperature=1.0, logprobs=0), SP(temperature=0.0), SP(temperature=2.0, top_k=5, logprobs=5, presence_penalty=1.0)]
    toks, lps = Sampler()(x, [_req(p, out=[0, 1, 2]) for p in params])
    ref = torch.log_softmax(x.double(), -1)
    assert lps[2] is None
    for i in (0, 1, 3):
        lp = lps[i]
        assert lp is not None and lp.token_id == toks[i]
        assert lp.logprob == pytest.approx(ref[i, toks[i]].item(), abs=1e-5)
        assert lp.rank == int((ref[i] > ref[i, toks[i]]).sum()) + 1
        n = params[i].logprobs
        order = torch.argsort(ref[i], descending=True)[:n]
        assert lp.top_token_ids == order.tolist()
        np.testing.assert_allclose(lp.top_logprobs, ref[i, order].numpy(), atol=1e-5)
    assert lps[0].rank == 1


def test_repetition_penalty_matches_transformers() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    x = _logits(3, seed=7)
    prompts = [[1, 5, 5, 9], [2, 3], [0, 63, 10]]
    outputs = [[9, 12], [], [40, 40, 40]]
    for penalty in (0.7, 1.3):
        ours = x.clone()
        apply_penalties(ours, prompts, outputs, [penalty] * 3, [0.0] * 3, [0.0] * 3)
        for i in range(3):
            ids = torch.tensor([prompts[i] + outputs[i]])
            hf = RepetitionPenaltyLogitsProcessor(penalty)(ids, x[i : i + 1].clone())
            torch.testing.assert_close(ours[i], hf[0])
        assert not torch.equal(ours, x)


def test_frequency_presence_penalties_hand_computed() -> None:
    x = _logits(2, seed=8)
    prompts = [[3, 3, 4], [7]]
    outputs = [[4, 4, 4, 9], [7, 1]]
    ours = x.clone()
    apply_penalties(ours, prompts, outputs, [1.0, 1.0], [0.5, -0.25], [1.5, 0.0])
    want = x.clone()
    want[0, 4] -= 3 * 0.5 + 1.5
    want[0, 9] -= 1 * 0.5 + 1.5
    want[1, 7] -= 1 * -0.25
    want[1, 1] -= 1 * -0.25
    torch.testing.assert_close(ours, want)  # prompt-only tokens (3, and 7's prompt copy) are not counted


def test_all_penalties_combined_in_sampler_on_some_rows() -> None:
    x = torch.zeros(3, 6)
    x[:, 2] = 2.0
    x[:, 4] = 1.9
    reqs = [
        _req(SP(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.1), out=[2], prompt=[0]),
        _req(SP(temperature=0.0), out=[2, 2]),
        _req(SP(temperature=0.0, presence_penalty=0.05), out=[2], prompt=[4]),
    ]
    toks, _ = Sampler()(x.clone(), reqs)
    # row 0: 2.0/1.2 - 0.1 = 1.567 < 1.9;  row 1 untouched;  row 2: 2.0 - 0.05 = 1.95 > 1.9 (prompt tokens ignored)
    assert toks == [4, 2, 2]


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    x = torch.zeros(4, 8)
    x[:, 7] = 10.0  # eos
    x[:, 5] = 9.0  # stop token id
    x[:, 1] = 8.0
    p = SP(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    reqs = [
        _req(p, out=[], eos=7),
        _req(p, out=[1, 1], eos=7),  # reached: eos allowed
        _req(SP(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True), out=[1], eos=7),
        _req(SP(temperature=0.0), out=[], eos=7),
    ]
    raw = x.clone()
    toks, lps = Sampler()(x, reqs)
    assert toks == [1, 7, 7, 7]
    assert torch.equal(x, raw)  # the caller's logits are never modified
    toks, _ = Sampler()(x[:1].expand(200, 8), [_req(SP(temperature=1.0, min_tokens=3, stop_token_ids=[5], seed=s), eos=7) for s in range(200)])
    assert 5 not in toks and 7 not in toks


def test_min_tokens_yields_when_only_stops_are_left() -> None:
    """A complete grammar masks every token but the stops: min_tokens then lets them through (a row with nothing
    to sample would draw an arbitrary token), in the greedy and the sampled path; other rows keep the ban."""
    x = torch.full((3, 8), float("-inf"))
    x[:, 7], x[:, 5] = 1.0, 2.0  # only eos and the stop id left
    x[2, 3] = 0.0  # one more token: the ban holds
    p = SP(temperature=0.0, min_tokens=4, stop_token_ids=[5])
    reqs = [_req(p, eos=7), _req(SP(temperature=0.8, min_tokens=4, stop_token_ids=[5], seed=1), eos=7), _req(p, eos=7)]
    toks, _ = Sampler()(x.clone(), reqs)
    assert toks[0] == 5 and toks[1] in (5, 7) and toks[2] == 3


def test_bad_shape_is_rejected() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        Sampler()(torch.zeros(2, 4), [_req(SP())])


def test_half_precision_logits_and_large_vocab() -> None:
    x = _logits(3, vocab=151_936, seed=9).half()
    reqs = [_req(SP(temperature=0.0, logprobs=2)), _req(SP(top_p=0.9, top_k=40, seed=1)), _req(SP(min_p=0.1, seed=2, repetition_penalty=1.1), out=[5])]
    toks, lps = Sampler()(x, reqs)
    assert toks[0] == int(x[0].float().argmax())
    probs = Sampler.filtered_logits(x[1:2].float(), [reqs[1].params]).softmax(-1)
    assert probs[0, toks[1]] > 0 and int((probs > 0).sum()) <= 40
    assert lps[0] is not None and lps[0].top_token_ids[0] == toks[0]


def test_nan_logits_and_out_of_vocab_ids_stay_in_range() -> None:
    x = _logits(3, seed=10)
    x[1] = float("nan")
    reqs = [_req(SP(seed=1)), _req(SP(seed=2, top_p=0.9)), _req(SP(repetition_penalty=1.5, seed=3), out=[V + 5, 3], prompt=[V, 4])]
    toks, _ = Sampler()(x, reqs)
    assert all(0 <= t < V for t in toks)
    pen = x[2:3].clone()
    apply_penalties(pen, [[V, 4]], [[V + 5, 3]], [1.5], [0.0], [0.0])  # ids beyond the vocabulary are ignored
    changed = (pen != x[2:3]).nonzero()[:, 1].tolist()
    assert changed == [3, 4]


@pytest.mark.parametrize("sort_top_p", [False, True])
def test_random_parameter_sweep_matches_reference(sort_top_p) -> None:
    """100 rows with random filter settings in one batch (rows also differ in which search depth they need)."""
    rng = np.random.default_rng(11)
    vocab = 300
    params = [
        SP(
            temperature=float(rng.uniform(0.2, 2.0)),
            top_k=int(rng.choice([-1, 0, 1, 2, 7, 50, 64, 65, 299, 300])),
            top_p=float(rng.choice([1.0, rng.uniform(0.05, 1.0)])),
            min_p=float(rng.choice([0.0, rng.uniform(0.0, 0.5)])),
        )
        for _ in range(100)
    ]
    x = torch.from_numpy(rng.normal(size=(100, vocab)) * rng.uniform(0.3, 6.0, size=(100, 1))).float()
    got = filtered_logits(x, params, sort_top_p).softmax(-1).double().numpy()
    for i, p in enumerate(params):
        np.testing.assert_allclose(got[i], ref_filtered_probs(x[i].numpy(), p), atol=1e-5, err_msg=str(p))


def test_plain_greedy_fast_path_only_when_nothing_else_reads_the_row() -> None:
    plain = [SP(temperature=0.0), SP(temperature=0.0, min_tokens=2, ignore_eos=True)]
    not_plain = [SP(temperature=0.0, repetition_penalty=1.5), SP(temperature=0.0, logprobs=1),
                 SP(temperature=0.0, min_tokens=2), SP(temperature=0.7)]
    assert all(_req(p).plain_greedy for p in plain)
    assert not any(_req(p).plain_greedy for p in not_plain)
    # one penalised row in the batch: the whole batch takes the general path and the penalty applies
    x = torch.zeros(2, 6)
    x[:, 3] = 2.0
    x[:, 4] = 1.9
    reqs = [_req(SP(temperature=0.0)), _req(SP(temperature=0.0, repetition_penalty=2.0), prompt=[3])]
    tokens, lps = Sampler().sample(x, reqs)
    assert isinstance(tokens, torch.Tensor) and tokens.tolist() == [3, 4] and lps == [None, None]


def test_logit_bias_matches_transformers_sequence_bias() -> None:
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    from strataserve.runner.penalties import add_bias

    x = _logits(3, seed=11)
    biases = [{5: 3.5, 40: -100.0}, {}, {0: 100.0, 63: -2.25, 64: 7.0}]  # 64 is outside the vocabulary: skipped
    ours = x.clone()
    add_bias(ours, [0, 1, 2], biases)
    for i, bias in enumerate(biases):
        inside = {(t,): b for t, b in bias.items() if t < V}
        want = SequenceBiasLogitsProcessor(inside)(torch.tensor([[1, 2]]), x[i : i + 1].clone())[0] if inside else x[i]
        torch.testing.assert_close(ours[i], want)


def test_logit_bias_steers_sampling_and_logprobs_stay_raw() -> None:
    x = _logits(4, seed=12)
    top = x.argmax(dim=-1).tolist()
    reqs = [_req(SP(temperature=0.0, logit_bias={"7": 100})),  # forced
            _req(SP(temperature=0.0, logit_bias={top[1]: -100}, logprobs=1)),  # the argmax banned: the runner-up
            _req(SP(temperature=0.0)),
            _req(SP(temperature=0.8, seed=3, logit_bias={9: 100, 1000: 5}))]  # sampled; 1000 is out of vocab
    assert not reqs[0].plain_greedy and reqs[2].plain_greedy
    raw = x.clone()
    toks, lps = Sampler()(x, reqs)
    assert toks[0] == 7 and toks[2] == top[2] and toks[3] == 9
    assert toks[1] == x[1].topk(2).indices[1].item()
    assert torch.equal(x, raw)  # the caller's logits are never modified
    assert lps[1].logprob == pytest.approx(torch.log_softmax(raw[1], -1)[toks[1]].item(), abs=1e-6)


@pytest.mark.parametrize("bias,needle", [({"a": 1}, "token ids"), ({"-3": 1}, ">= 0"), ({"3": 101}, "[-100, 100]"),
                                         ({"3": True}, "[-100, 100]"), ({"3": "1"}, "[-100, 100]")])
def test_logit_bias_bad_values_name_the_fault(bias, needle) -> None:
    with pytest.raises(ValueError, match="logit_bias") as err:
        SP(logit_bias=bias)
    assert needle in str(err.value)
    assert SP(logit_bias={"12": -1.5, 3: 2}).logit_bias == {12: -1.5, 3: 2.0} and SP(logit_bias={}).logit_bias is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_torch_argmax_with_ties_infinities_and_nan(dtype) -> None:
    """The CPU route (``max(...).indices``) keeps argmax's rule: the first index of the largest value, NaN largest."""
    x = torch.randint(0, 4, (64, 512), generator=torch.Generator().manual_seed(1)).to(dtype)  # ties in every row
    x[3, 200], x[3, 100] = float("nan"), float("nan")
    x[5, 7], x[6] = float("inf"), float("-inf")
    got = row_argmax(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[3] == 100 and got[5] == 7 and got[6] == 0


@pytest.mark.parametrize("cols", [1, 15, 64, 65, 191, 4096, 151936])
def test_row_argmax_c_pass_matches_argmax_on_strided_rows(cols) -> None:
    """float32 on CPU takes the C pass (cpu_layer_ops.c): rows of a wider matrix (a row stride past the width),
    the largest value in the unvectorised tail, signed-zero ties, a row of -inf, NaN after the largest value."""
    gen = torch.Generator().manual_seed(cols)
    wide = torch.randn(40, cols + 7, generator=gen)
    x = wide[:, :cols]
    x[1, -1] = 100.0  # in the tail past the last full vector
    x[2] = torch.where(torch.arange(cols) % 3 == 0, 0.0, -1.0)
    x[2, cols // 2] = -0.0  # ties between 0.0 and -0.0: the first wins
    x[3] = float("-inf")
    x[4, 0], x[4, -1] = 50.0, float("nan")
    x[5] = torch.randint(0, 3, (cols,), generator=gen).float()  # many ties
    assert x.stride(0) == cols + 7
    got = row_argmax(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1))
    if cols > 1:
        assert got[1] == cols - 1 and got[4] == cols - 1
    assert got[3] == 0


def test_row_argmax_takes_the_c_pass_unless_switched_off(monkeypatch) -> None:
    """The C pass is what runs for float32 on CPU (a broken library would be noticed), and
    STRATA_CPU_LAYER_OPS=0 leaves torch's max."""
    from strataserve import envs
    from strataserve.runner import cpu_kernel

    calls = []
    lib = cpu_kernel.load_layer_ops()
    assert lib is not None, "the test machine has a C compiler"

    class Spy:
        def strata_row_argmax(self, *args):
            calls.append(args)
            return lib.strata_row_argmax(*args)

    monkeypatch.setattr(cpu_kernel, "load_layer_ops", lambda: Spy())
    x = torch.randn(8, 300, generator=torch.Generator().manual_seed(0))
    assert torch.equal(row_argmax(x), x.argmax(-1)) and len(calls) == 1
    monkeypatch.setattr(envs, "STRATA_CPU_LAYER_OPS", False)
    assert torch.equal(row_argmax(x), x.argmax(-1)) and len(calls) == 1


def test_bad_words_match_transformers_no_bad_words_and_allowed_ids_mask() -> None:
    """vLLM's bad_words rule is HF's NoBadWordsLogitsProcessor over the output tokens: a one-token word is always
    banned, a longer one at its last token when the output ends with the rest. allowed_token_ids keep only those."""
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor

    words = [[5], [7, 8], [9, 10, 11], [12, 13]]
    outputs = [[], [3, 7], [1, 9, 10], [7, 12]]
    x = _logits(len(outputs), seed=21)
    reqs = [_req(SP(temperature=0.0, bad_words_token_ids=words), out) for out in outputs]
    assert not reqs[0].plain_greedy
    ours = Sampler._processed(x, reqs)
    for i, out in enumerate(outputs):
        ref = NoBadWordsLogitsProcessor(words, eos_token_id=63)(torch.tensor([[2, *out]]), x[i : i + 1].clone())[0]
        assert torch.equal(torch.isinf(ours[i]), torch.isinf(ref)), i
    allowed = [3, 17, 40]
    y = _logits(10, seed=22)
    toks, _ = Sampler()(y, [_req(SP(temperature=0.0, allowed_token_ids=allowed))] * 2
                        + [_req(SP(temperature=0.9, seed=s, allowed_token_ids=allowed)) for s in range(8)])
    assert set(toks) <= set(allowed) and len(set(toks[2:])) > 1
    assert toks[0] == allowed[int(y[0, allowed].argmax())]


@pytest.mark.parametrize("kwargs,needle", [({"allowed_token_ids": []}, "allowed_token_ids"),
                                           ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
                                           ({"bad_words": [""]}, "bad_words"),
                                           ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")])
def test_vllm_extras_bad_values_name_the_fault(kwargs, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        SP(**kwargs)


def test_bans_that_leave_nothing_yield_to_the_allowed_ids_not_the_whole_vocabulary() -> None:
    """min_tokens / stop ids / bad words banning every allowed id: the row samples among the allowed ids (as a
    complete grammar's row does among its stops), never outside them."""
    x = _logits(2, seed=23)
    reqs = [_req(SP(temperature=0.0, allowed_token_ids=[10], stop_token_ids=[10], min_tokens=2)),
            _req(SP(temperature=0.7, seed=1, allowed_token_ids=[2, 5], bad_words_token_ids=[[5]], min_tokens=3),
                 eos=2)]
    assert Sampler()(x, reqs)[0] == [10, 2]
