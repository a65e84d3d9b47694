"""``TritonOps``: the ``OpSet`` of ``runner/ops.py`` implemented with the Triton kernels of ``strataserve.kernels``.

Used by the ``triton`` (no graphs) and ``hybrid`` (inside CUDA graphs) runner modes. Every kernel is graph-safe:
launch shapes depend only on tensor shapes, never on tensor values, so a captured decode step replays correctly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from strataserve import envs
from strataserve.kernels._common import pdl_enabled
from strataserve.kernels.activation import silu_and_mul
from strataserve.kernels.decode_attention import DecodeRope, default_num_splits, paged_decode_attention
from strataserve.kernels.gemv import GemvConfig, gemv, gemv_rms_norm, gemv_silu_mul
from strataserve.kernels.kv_cache import store_kv
from strataserve.kernels.prefill_attention import prefill_attention
from strataserve.kernels.prefill_tiles import PREFILL_BLOCK_M
from strataserve.kernels.rms_norm import fused_add_rms_norm, rms_norm
from strataserve.kernels.rotary import apply_rotary
from strataserve.kernels.rotary_kv import rotary_store_kv
from strataserve.kernels.skinny_gemm import GemmConfig, skinny_gemm, skinny_gemm_silu_mul
from strataserve.runner.attention import AttentionMetadata, TorchAttention
from strataserve.runner.gemm_tuning import plan_rows
from strataserve.runner.ops import (add_rms_norm, unfused_attend, unfused_norm_linear, unfused_norm_mlp,
                                    unfused_silu_mul_linear)


# Adaptive decode splits (run 8, docs/gpu_notes.md) pay between one and four programs per SM: 64 rows of 576
# tokens run unsplit (+5.6% per 8B step over run 6's five splits) and 60 mixed rows match run 6; from ~1,400
# programs up, run 6's fixed two splits beat them on mixed lengths (1-4% in the kernel sweep), below one program
# per SM (batch 1) the reduce launch is cheaper than the in-kernel combine. The grid allows >= 4 splits.
ADAPTIVE_MIN_CAP = 4
ADAPTIVE_MAX_PROGRAMS_PER_SM = 4
#: decode attention's (block_n, num_warps, num_stages) per launch regime (``decode_config``). Run 21's probe
#: (docs/gpu_notes.md, 8B shape, 576-token rows): in the regime that splits every row (17-32 rows at 8 KV heads),
#: 32-key tiles with 2 warps and 3 stages ran 5-19% faster (they also let rows of ~192-token chunks split, the rule
#: being at least 4 key tiles per chunk). Elsewhere no configuration won everywhere: at 40-64 rows it lost 13-20%,
#: at 16 rows 6%, with fixed splits at 96 / 128 / 256 rows (0.6B shape) it moved +4.8% / -0.9% / -3.3% and
#: nano-vllm's workload did not gain; there run 6's (64, 4, 2) stays.
DECODE_CONFIGS: dict[str, tuple[int, int, int]] = {"small": (64, 4, 2), "split_all": (32, 2, 3),
                                                   "adaptive": (64, 4, 2), "large": (64, 4, 2)}
RUN6_DECODE_CONFIG = (64, 4, 2)


def decode_config(rows: int, kv_heads: int, num_sms: int) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages) of a decode-attention launch over ``rows`` rows: by its (row, KV head)
    programs against the SMs, the regimes of ``decode_launch`` and the kernel's ``split_all_below`` (2 per SM);
    ``STRATA_DECODE_ATTN_CONFIGS=0``: run 6's configuration for every launch."""
    if not envs.STRATA_DECODE_ATTN_CONFIGS:
        return RUN6_DECODE_CONFIG
    programs = rows * kv_heads
    regime = ("small" if programs < num_sms else "split_all" if programs < 2 * num_sms
              else "adaptive" if programs <= ADAPTIVE_MAX_PROGRAMS_PER_SM * num_sms else "large")
    return DECODE_CONFIGS[regime]


def decode_launch(rows: int, kv_heads: int, num_sms: int, programs_per_sm: int, split_target: int,
                  padded: bool = False) -> tuple[int, int]:
    """(num_splits, split_target) of the decode-attention launch for ``rows`` decode rows: fixed per batch size,
    so a CUDA graph captured for that size stays valid; split_target 0 = the fixed split count of run 6.
    ``padded``: the rows are a fixed grid, most of them padding (a mixed-step graph), so the kernel chooses each
    real row's split count whatever the grid size (run 9: one split per row of a 256-row grid with ~25 real rows
    cost ~0.6 ms of an 8B mixed step)."""
    splits = default_num_splits(rows, kv_heads, num_sms, programs_per_sm=programs_per_sm)
    if split_target and (padded or num_sms <= rows * kv_heads <= ADAPTIVE_MAX_PROGRAMS_PER_SM * num_sms):
        return max(splits, ADAPTIVE_MIN_CAP), split_target
    return splits, 0


class TritonAttention:
    """Paged attention with Triton kernels: KV store, split-KV decode, prefill over cached prefixes."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, num_sms: int | None = None,
                 long_first: bool = True, split_target: int = 0) -> None:
        """``long_first`` (default): decode rows launch longest first with ~16 programs per SM (more splits);
        off: run 5's launch (rows in order, ~2 programs per SM), the benchmarks' "before". ``split_target`` > 0:
        for batch sizes of one to four programs per SM (``decode_launch``), each row's split count is chosen in
        the kernel from its length against the step's (equal rows run unsplit), aiming at that many programs per
        SM, with the split reduce inside the kernel (``kernels/decode_attention.py``)."""
        self.reverse, self.programs_per_sm = (True, 16) if long_first else (False, 2)
        self.split_target = split_target
        self._semaphores: torch.Tensor | None = None  # the adaptive kernel's tickets, left zeroed by every launch
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.num_sms = num_sms or (torch.cuda.get_device_properties(0).multi_processor_count
                                   if torch.cuda.is_available() else 8)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.kv_scales: torch.Tensor | None = None
        # meta=None: tests, memory profiling, and the fp8/int8 scale calibration (its ``kv_observer``)
        self._no_cache = TorchAttention(num_heads, num_kv_heads, head_dim)

    @property
    def kv_observer(self):
        return self._no_cache.kv_observer

    @kv_observer.setter
    def kv_observer(self, fn) -> None:
        self._no_cache.kv_observer = fn

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                      kv_scales: torch.Tensor | None = None) -> None:
        self.kv_caches = kv_caches
        self.kv_scales = kv_scales

    def layer_scales(self, layer_idx: int) -> dict[str, torch.Tensor]:
        """The kernels' ``k_scale``/``v_scale`` keywords for one layer (none for a float cache)."""
        if self.kv_scales is None:
            return {}
        return {"k_scale": self.kv_scales[layer_idx, 0], "v_scale": self.kv_scales[layer_idx, 1]}

    def rope_in_kernel(self, decode_rows: int, device: torch.device) -> bool:
        """Whether a decode-only step of this many rows should rotate and store inside decode attention: launches
        with PDL (``pdl_enabled``), where the kernel prefetches its first key tile before the wait: batch 1 with
        fixed splits (fewer programs than SMs), or up to ``STRATA_DECODE_ROPE_MAX_ROWS`` rows. Run 18, batch 1:
        -0.4% per 8B step, -1.2% at the Qwen3-0.6B shape (without the prefetch it lost ~1% there); at batch 64
        without PDL or the prefetch the separate kernel was faster (+0.8% / +2.6% when fused)."""
        if self.kv_scales is not None or not pdl_enabled(device, decode_rows):
            return False
        if decode_rows > 1:
            return decode_rows <= envs.STRATA_DECODE_ROPE_MAX_ROWS
        return decode_launch(1, self.num_kv_heads, self.num_sms, self.programs_per_sm, self.split_target)[1] == 0

    def _tickets(self, n: int, device: torch.device) -> torch.Tensor | None:
        if not self.split_target:
            return None
        if self._semaphores is None or self._semaphores.numel() < n or self._semaphores.device != device:
            # allocated once for the largest batch seen (first use is warm-up / the largest graph bucket)
            self._semaphores = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        return self._semaphores

    def forward(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata | None, kv_stored: bool = False,
                rope: DecodeRope | None = None) -> torch.Tensor:
        """``kv_stored``: this step's k/v are already in their slots (``rotary_store_kv`` wrote them). ``rope``
        (a decode-only step): q and k are not rotated yet, and the decode kernel rotates, stores and attends."""
        if meta is None:
            return self._no_cache.forward(layer_idx, q, k, v, None)
        t = q.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q3, k3, v3 = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
        k_cache, v_cache = self.kv_caches[layer_idx]
        sc = self.layer_scales(layer_idx)
        if not kv_stored and rope is None:
            store_kv(k3, v3, k_cache, v_cache, meta.slot_mapping, **sc)
        out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
        nd = meta.num_decode_tokens
        if nd:
            splits, target = decode_launch(nd, hkv, self.num_sms, self.programs_per_sm, self.split_target,
                                           padded=meta.decode_rows_padded)
            block_n, warps, stages = decode_config(nd, hkv, self.num_sms)
            paged_decode_attention(q3[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                   self.scale, num_splits=splits, out=out[:nd], reverse=self.reverse,
                                   block_n=block_n, num_warps=warps, num_stages=stages,
                                   split_target=target, num_sms=self.num_sms,
                                   semaphores=self._tickets(nd * hkv, q.device) if target else None, rope=rope,
                                   **sc)
        if meta.prefills or meta.prefill_tiles is not None:
            assert meta.prefill_seq_lens is not None, "build_input_batch sets prefill_seq_lens once per step"
            max_q = max((seg.query_len for seg in meta.prefills), default=0)
            prefill_attention(q3, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                              meta.prefill_seq_lens, max_q, self.scale, out=out, tiles=meta.prefill_tiles,
                              block_m=PREFILL_BLOCK_M, **sc)
        return out.view(t, hq * d)


def _one_row(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous()


class TritonOps:
    """Triton kernels behind the ``OpSet`` protocol (same semantics as ``TorchOps``).

    One-row matmuls (batch-1 decode): ``gemv_plan`` maps a weight shape [N, K] to the GEMV configuration that
    beat cuBLAS on it (``runner/gemv_tuning.py`` measures that at start-up); other shapes keep cuBLAS.
    ``use_gemv`` forces the default GEMV for every shape (tests). ``prologue_plan`` maps ``("norm", shape)`` /
    ``("silu", shape)`` to the GEMV configuration that, with the RMSNorm (+ residual add) / SiLU-and-mul before
    the projection as its prologue, beat that op's own launch + the plain matmul (measured at start-up too).
    ``fused_rope_kv`` (default on): (q/k norm,) rotary and the KV store in one kernel; off, the unfused sequence
    (the before/after switch of the benchmarks). ``rope_in_attention`` (default ``STRATA_DECODE_ROPE_IN_ATTENTION``):
    in a small decode-only step over a float cache (``TritonAttention.rope_in_kernel``), that kernel's work runs
    inside decode attention instead. ``gemm_plan`` maps ``(row class, shape)`` to the few-rows Triton GEMM
    configuration that beat cuBLAS for matmuls of 2-64 rows (``runner/gemm_tuning.py``, also at start-up);
    ``silu_plan`` maps ``(row class, gate_up shape)`` to the configuration whose SiLU-and-mul epilogue beat that
    matmul's own choice + the activation's launch.
    """

    name = "triton"

    def __init__(self, attention: TritonAttention, use_gemv: bool = False,
                 gemv_plan: dict[tuple[int, int], GemvConfig] | None = None, fused_rope_kv: bool = True,
                 prologue_plan: dict[tuple[str, tuple[int, int]], GemvConfig] | None = None,
                 rope_in_attention: bool | None = None,
                 gemm_plan: dict[tuple[int, tuple[int, int]], GemmConfig] | None = None,
                 silu_plan: dict[tuple[int, tuple[int, int]], GemmConfig] | None = None) -> None:
        self.attention = attention
        self.gemm_plan = dict(gemm_plan or {})
        self.silu_plan = dict(silu_plan or {})
        self._tickets: torch.Tensor | None = None  # the split GEMMs' in-kernel combine (each launch leaves zeros)
        self.rope_in_attention = (envs.STRATA_DECODE_ROPE_IN_ATTENTION if rope_in_attention is None
                                  else rope_in_attention)
        self.use_gemv = use_gemv
        self.gemv_plan = dict(gemv_plan or {})
        self.prologue_plan = dict(prologue_plan or {})
        self.fused_rope_kv = fused_rope_kv

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if _one_row(x):
            config = self.gemv_plan.get(tuple(weight.shape)) or (GemvConfig() if self.use_gemv else None)
            if config is not None:
                return gemv(x, weight, bias, config)
        elif self.gemm_plan and x.dim() == 2 and x.stride(1) == 1:
            config = self.gemm_plan.get((plan_rows(x.shape[0]), tuple(weight.shape)))
            if config is not None:
                return skinny_gemm(x, weight, bias, config, tickets=self._gemm_tickets(x.device))
        return F.linear(x, weight, bias)

    def _gemm_tickets(self, device: torch.device) -> torch.Tensor:
        if self._tickets is None or self._tickets.device != device:
            self._tickets = torch.zeros(1 << 16, dtype=torch.int32, device=device)
        return self._tickets

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        config = self.prologue_plan.get(("norm", tuple(weight.shape)))
        if (config is not None and _one_row(x) and norm_weight.dtype == x.dtype
                and (residual is None or residual.is_contiguous())):
            return gemv_rms_norm(x, residual, norm_weight, eps, weight, bias, config)
        return unfused_norm_linear(self, x, residual, norm_weight, eps, weight, bias)

    def silu_mul_linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        config = self.prologue_plan.get(("silu", tuple(weight.shape)))
        if config is not None and _one_row(x):
            return gemv_silu_mul(x, weight, config=config)
        return unfused_silu_mul_linear(self, x, weight)

    def norm_mlp(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                 gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        config = (self.silu_plan.get((plan_rows(x.shape[0]), tuple(gate_up_weight.shape)))
                  if self.silu_plan and x.dim() == 2 and x.stride(1) == 1 else None)
        if config is None:  # batch 1 fuses the activation into down's prologue instead (silu_mul_linear)
            return unfused_norm_mlp(self, x, residual, norm_weight, eps, gate_up_weight, down_weight)
        h, residual = add_rms_norm(self, x, residual, norm_weight, eps)
        return self.linear(skinny_gemm_silu_mul(h, gate_up_weight, config), down_weight), residual

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # in place: residual <- x + residual, x <- norm(residual) (the protocol allows reusing their storage)
        return fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def apply_rotary(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                     cos_sin_cache: torch.Tensor) -> None:
        apply_rotary(q, k, positions, cos_sin_cache, head_dim=head_dim)

    def rotate_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                  cos_sin_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(Qwen3's q/k norm +) rotary, in place, one launch, no KV store (attention without a paged cache)."""
        return apply_rotary(q, k, positions, cos_sin_cache, head_dim, q_norm, k_norm, eps)

    def attend(self, layer_idx: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               head_dim: int, cos_sin_cache: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
               eps: float, meta: AttentionMetadata | None) -> torch.Tensor:
        att = self.attention
        if not self.fused_rope_kv:
            return unfused_attend(self, layer_idx, positions, q, k, v, head_dim, cos_sin_cache, q_norm, k_norm, eps,
                                  meta)
        if meta is None or cos_sin_cache.shape[1] != head_dim:  # no cache to store into / partial rotary
            q, k = self.rotate_qk(positions, q, k, head_dim, cos_sin_cache, q_norm, k_norm, eps)
            return att.forward(layer_idx, q, k, v, meta)
        t = q.shape[0]
        if (self.rope_in_attention and meta.num_decode_tokens == t and not meta.prefills
                and meta.prefill_tiles is None and att.rope_in_kernel(t, q.device)):  # rotary + store inside
            hkv = att.num_kv_heads
            rope = DecodeRope(positions, k.view(t, hkv, head_dim), v.view(t, hkv, head_dim), cos_sin_cache,
                              meta.slot_mapping, q_norm, k_norm, eps)
            return att.forward(layer_idx, q, k, v, meta, rope=rope)
        k_cache, v_cache = att.kv_caches[layer_idx]
        # one launch: (q/k norm,) rotary of q in place, rotated k and v straight into their cache slots
        rotary_store_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, meta.slot_mapping, head_dim,
                        q_norm, k_norm, eps, **att.layer_scales(layer_idx))
        return att.forward(layer_idx, q, k, v, meta, kv_stored=True)
