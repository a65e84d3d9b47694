"""``ModelRunner``: loads the model, owns the KV pool, and executes one scheduled step at a time.

Start-up: resolve device/dtype -> pick the OpSet for the runner mode (``runner/execution_plan.py``, the one place modes
are decided) -> load weights -> size the KV pool (``num_blocks`` override, else a GiB budget on CPU, else a fraction
of GPU memory minus weights and a profiled peak forward) -> preallocate it -> (hybrid) time cuBLAS against the
Triton GEMV per batch-1 weight shape -> capture CUDA graphs (graph/hybrid).

Per step (``launch``; ``execute`` = ``launch(...).result()``): forget finished requests, register new ones,
build flat tensors + attention metadata (``runner/input_batch.py``, block tables kept in persistent rows), run the
model over all chunks at once (decode-only steps replay a CUDA graph when one is captured), compute logits only for
sampling chunks, sample; ``result`` hands the tokens back and appends each to its request's ``SamplingRequest``.

Tensor parallelism (``runner/tp_worker.py``): rank 0 broadcasts each step to the worker ranks, and only it samples
(async scheduling: it also sends the sampled token tensor, for the workers' placeholders).

Async scheduling (``supports_async``, the CUDA default): ``launch`` returns as soon as the step is queued, the
tokens travel to pinned host memory behind an event, and the next step's chunks may carry placeholder token ids
(< 0) for tokens still being sampled; they are filled on the device from the previous launch's token tensor.
"""
from __future__ import annotations

import contextlib
import inspect
import logging

import torch

from strataserve import envs
from strataserve.config import EngineConfig
from strataserve.types.outputs import ModelRunnerOutput, SchedulerOutput
from strataserve.models.decoder import DecoderModel
from strataserve.models.hf_config import DecoderConfig, load_decoder_config
from strataserve.models.loader import load_model, resolve_device, resolve_dtype
from strataserve.runner.attention import allocate_kv_cache, kv_cache_bytes_per_block, TorchAttention
from strataserve.runner.base import ModelRunnerBase
from strataserve.runner.execution_plan import select_ops
from strataserve.kernels.kv_quant_ref import is_quantized
from strataserve.runner.cpu_attention import CpuPagedAttention
from strataserve.runner.input_batch import BlockTableRows, InputBatch, build_input_batch
from strataserve.runner.launched_step import LaunchedStep
from strataserve.runner.kv_quant import calibrate_kv_scales, resolve_kv_cache_dtype
from strataserve.runner.logits_mask import apply_token_bitmask
from strataserve.runner.prompt_logprobs import PromptRows, prompt_logprobs, prompt_rows
from strataserve.runner.pending_tokens import fill_placeholders
from strataserve.runner.sampler import Sampler, SamplingRequest
from strataserve.runner.token_history import TokenHistory
from strataserve.runner.tp_worker import RankSetup, setup
from strataserve.startup import Phases

log = logging.getLogger(__name__)
_SMALL_POOL = ("the KV cache holds %d tokens, fewer than max_model_len=%d: a sequence stops there (finish_reason "
               "length); raise --kv-cache-memory-gib (CPU) / --gpu-memory-utilization, or lower --max-model-len")

# "graph" mode (torch attention inside CUDA graphs): the widest context a captured decode step covers.
_GRAPH_TORCH_MAX_TOKENS = 2048


class ModelRunner(ModelRunnerBase):
    def __init__(self, config: EngineConfig, sampler: Sampler | None = None,
                 async_scheduling: bool | None = None, tp: RankSetup | None = None) -> None:
        """``tp``: a worker rank's tensor-parallel setup (rank 0 makes its own, starting the workers)."""
        mc = config.model
        self.config = config
        #: start-up phases and their seconds (``strata serve`` prints them)
        self.startup = Phases()
        full_config = load_decoder_config(mc.model)
        device = resolve_device(mc.device)
        #: the engine may schedule step N+1 before step N's tokens reach the host (EngineCore reads this). Default:
        #: CUDA unless STRATA_ASYNC_SCHEDULING=0; off on CPU (tests force it there). Workers get rank 0's choice.
        if async_scheduling is None:
            async_scheduling = device.type == "cuda" and envs.STRATA_ASYNC_SCHEDULING
        self.supports_async = async_scheduling
        self.tp_setup = tp or setup(config, full_config, device, async_scheduling=async_scheduling)
        self.device, self.tp, self.tp_control = self.tp_setup.device, self.tp_setup.tp, self.tp_setup.control
        try:
            self._build(config, full_config, sampler)
        except BaseException:
            if self.tp_setup.workers is not None:  # leave no worker behind a failed start
                self.tp_setup.workers.stop(self.tp_control)
            raise

    def _build(self, config: EngineConfig, full_config: DecoderConfig, sampler: Sampler | None) -> None:
        mc = config.model
        if self.device.type == "cuda":  # the context's creation, timed apart from the weights
            with self.startup.time("CUDA init"):
                torch.empty(1, device=self.device)
        #: this rank's share of the model (its heads and MLP width; the checkpoint's config when not split)
        self.model_config = self.tp.local_config(full_config)
        self.dtype = resolve_dtype(mc.dtype, self.model_config, self.device)
        self.block_size = config.cache.block_size
        # the in-place CPU paged-attention kernel reads model-dtype caches; fp8/int8 caches take the torch path
        self.plan = select_ops(config.runner.mode, self.model_config, self.device, config.scheduler.max_num_seqs,
                               cpu_kernel=config.cache.kv_cache_dtype == "auto", dtype=self.dtype)
        #: the CPU engine's work-sharing threads (``runner/cpu_pool.py``; float32 models only, see ``select_ops``)
        self.cpu_pool = getattr(self.plan.ops, "pool", None)
        # only the torch backend reads the per-group / per-segment views; kernel backends skip building them
        self._torch_views = isinstance(self.plan.ops.attention, TorchAttention)
        #: sliding window masked in attention: the eager backends (torch masks, CPU kernel bounds); elsewhere the
        #: context is capped
        masks_window = self._torch_views or isinstance(self.plan.ops.attention, CpuPagedAttention)
        self.sliding_window = (self.model_config.sliding_window if self.model_config.window_every_layer
                               and masks_window and not self.plan.cuda_graphs else None)
        self.max_model_len = self._max_model_len(mc.max_model_len)
        #: KV storage dtype: the model dtype, or fp8/int8 with per-head scales (``runner/kv_quant.py``)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype, self.device,
                                                     kernels=not self._torch_views,
                                                     head_dim=self.model_config.head_dim)
        torch.manual_seed(mc.seed)  # vLLM's seed: unseeded sampling and dummy weights repeat from run to run
        with self.startup.time("weights"):
            self.model: DecoderModel = load_model(mc.model, self.dtype, self.device, self.plan.ops,
                                                  self.max_model_len, self.tp, mc.load_format)
        with self.startup.time("KV sizing"):
            self.num_blocks = self._num_blocks()
            if self.tp_control is not None:  # every rank's pool holds the blocks the one scheduler hands out
                self.num_blocks = self.tp_control.min_int(self.num_blocks)
        if self.num_blocks * self.block_size < self.max_model_len:  # vLLM refuses to start; we serve, and say so
            log.warning(_SMALL_POOL, self.num_blocks * self.block_size, self.max_model_len)
        with self.startup.time("KV allocation"):
            # One spare block past the pool: CUDA-graph padding rows write their K/V there, never a real block.
            self.kv_caches = allocate_kv_cache(self.model_config.num_layers, self.num_blocks + 1, self.block_size,
                                               self.model_config.num_kv_heads, self.model_config.head_dim,
                                               self.kv_cache_dtype, self.device)
        with self.startup.time("KV scales"):  # fp8/int8: per-layer, per-head scales from a calibration forward
            self.kv_scales = (calibrate_kv_scales(self.model, self.kv_cache_dtype, min(
                512, self.max_model_len, config.scheduler.max_num_batched_tokens), mc.seed)
                if is_quantized(self.kv_cache_dtype) else None)
        self.plan.ops.attention.bind_kv_cache(self.kv_caches, self.kv_scales)
        #: ids that end generation according to config.json + generation_config.json
        self.eos_token_ids: tuple[int, ...] = self.model_config.eos_token_ids
        self.sampler = sampler if sampler is not None else Sampler()
        self.requests: dict[str, SamplingRequest] = {}
        self._rows = BlockTableRows(config.scheduler.max_num_seqs, -(-self.max_model_len // self.block_size))
        self._last: tuple[torch.Tensor, dict[str, int]] | None = None  # last launch's token tensor, row per id
        self.token_history: TokenHistory | None = None  # penalised requests' token counts (async, made on first use)
        self._history_ok = "history" in inspect.signature(self.sampler.sample).parameters  # a custom sampler's may not
        #: all-greedy graph steps take the argmax captured in the graph (a custom sampler sees every step instead)
        self._graph_argmax = envs.STRATA_GRAPH_ARGMAX and type(self.sampler) is Sampler
        with self.startup.time("GEMV tuning"):
            self.gemv_choices = self._tune_gemv() if self.plan.mode == "hybrid" else []
        with self.startup.time("CUDA graphs"):
            self.graphs = self._capture_graphs() if self.plan.cuda_graphs else None
        #: steps with prompt tokens replay per-bucket graphs too, captured on first use (``runner/mixed_graph.py``);
        #: Triton attention only (its kernels take the fixed-grid forms), one rank (no collectives in them)
        self.mixed = (self._mixed_graphs() if self.plan.mode == "hybrid" and self.tp.size == 1
                      and envs.STRATA_MIXED_GRAPHS else None)

    # ------------------------------------------------------------------ start-up
    def _max_model_len(self, requested: int | None) -> int:
        cfg = self.model_config
        limit = cfg.max_model_len if self.sliding_window is not None or cfg.sliding_window is None \
            else cfg.full_attention_len
        if requested is None:
            return limit
        if requested > limit:
            raise ValueError(f"max_model_len={requested} exceeds what the model supports ({limit}, from "
                             "config.json max_position_embeddings; sliding_window where the window is not masked: "
                             "runner mode eager masks Mistral's); lower it")
        return requested

    def _num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        cfg = self.model_config
        per_block = kv_cache_bytes_per_block(cfg.num_layers, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                                             self.kv_cache_dtype)
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget()
            what = f"gpu_memory_utilization={cache.gpu_memory_utilization}"
        else:
            budget = int(cache.kv_cache_memory_gib * (1 << 30))
            what = f"kv_cache_memory_gib={cache.kv_cache_memory_gib}"
        blocks = budget // per_block - 1  # minus the spare block
        if blocks < 2:
            raise ValueError(f"{what} leaves room for {max(blocks, 0)} KV blocks ({per_block} bytes each); "
                             "raise it, or lower max_num_batched_tokens / max_num_seqs")
        gain = self.dtype.itemsize / self.kv_cache_dtype.itemsize
        log.info("KV cache: %d blocks x %d tokens in %s (%.1fx the blocks of a %s cache)", blocks, self.block_size,
                 str(self.kv_cache_dtype).replace("torch.", ""), gain, str(self.dtype).replace("torch.", ""))
        return int(blocks)


    @torch.inference_mode()
    def _cuda_kv_budget(self) -> int:
        """Bytes for the KV pool: util x total, minus the peak of a max-size forward + sampling, minus memory
        other processes or non-torch allocations hold."""
        sched = self.config.scheduler
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = sched.max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device) % self.max_model_len
        hidden = self.model(ids, pos, None)
        logits = self.model.compute_logits(hidden[: min(n, sched.max_num_seqs)])
        _ = torch.log_softmax(logits, dim=-1), logits.clone()  # the sampler's working copies
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del hidden, logits, _
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)
        return int(total * self.config.cache.gpu_memory_utilization) - peak - others

    def _tune_gemv(self) -> list:
        """Batch-1 matmuls: cuBLAS or the Triton GEMV per weight shape, then the norms / SiLU-mul before them as
        GEMV prologues where that is faster; then cuBLAS or the few-rows Triton GEMM for 2-64 rows. Measured now
        (before graph capture)."""
        from strataserve.runner.gemm_tuning import apply_gemm_tuning
        from strataserve.runner.gemv_tuning import apply_tuning

        choices = apply_tuning(self.model, self.plan.ops) if envs.STRATA_GEMV_TUNE else []
        return choices + (apply_gemm_tuning(self.model, self.plan.ops) if envs.STRATA_GEMM_TUNE else [])

    def _graph_step(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor):
        """The decode step the CUDA graphs capture (capturable: no host sync, value-independent launches)."""
        from strataserve.runner.cuda_graph import decode_metadata

        model = self.model
        meta = decode_metadata(slot_mapping, block_tables, context_lens, self.block_size,
                               torch_views=self._torch_views)
        # the lm_head's output in the model dtype: ``compute_logits`` minus its float32 copy, which ``_logits``
        # makes only for the rows that need it; plus every row's argmax (the greedy token), read while the logits
        # are fresh in L2, so an all-greedy step needs nothing after the replay but a gather
        logits = model.logits(model(input_ids, positions, meta))
        if not self._graph_argmax:
            return logits
        from strataserve.kernels.argmax import greedy_tokens

        return logits, greedy_tokens(logits)

    def _capture_graphs(self):  # -> CudaGraphDecoder
        from strataserve.runner.cuda_graph import STARTUP_SIZES, CudaGraphDecoder

        bs = self.block_size
        triton = self.plan.mode == "hybrid"
        pad_slot = -1 if triton else self.num_blocks * bs  # the spare block
        max_bs = min(self.config.runner.cuda_graph_max_bs, self.config.scheduler.max_num_seqs)
        cols = -(-self.max_model_len // bs)
        if not triton:
            # torch attention gathers every column of the captured width for every row; beyond
            # _GRAPH_TORCH_MAX_TOKENS of context the decode step runs eagerly instead (can_run says no)
            cols = min(cols, -(-_GRAPH_TORCH_MAX_TOKENS // bs))
        graphs = CudaGraphDecoder(self._graph_step, max_bs, cols, self.device, pad_slot=pad_slot)
        defer = self.config.runner.defer_cuda_graphs and self.tp.size == 1  # (ranks capture in lockstep)
        seconds = graphs.capture(STARTUP_SIZES if defer else None)
        log.info("captured %d of %d decode CUDA graphs (batch <= %d) in %.2f s%s", len(graphs.graphs),
                 len(graphs.sizes), graphs.max_bs, seconds, "; the rest while idle" if graphs.missing() else "")
        return graphs

    def _mixed_graphs(self):  # -> MixedStepGraphs
        from strataserve.runner.mixed_graph import MixedStepGraphs

        sched = self.config.scheduler
        return MixedStepGraphs(self.model, sched.max_num_batched_tokens, sched.max_num_seqs,
                               envs.STRATA_MIXED_GRAPH_MAX_PREFILLS, -(-self.max_model_len // self.block_size),
                               self.model_config.hidden_size, self.dtype, self.device)

    @property
    def mixed_step_graphs(self) -> bool:
        """Whether steps with prompt tokens replay graphs, so a step's time is its device work (the step budget's
        automatic target depends on it: ``engine/step_budget.py``)."""
        return self.mixed is not None

    def idle_work(self) -> bool:
        """One piece of deferred start-up work while the engine has nothing to run (a decode graph bucket, then a
        mixed-step graph bucket); True while more remains."""
        if self.graphs is not None and self.graphs.missing():
            self.graphs.capture_next()
            return True
        return self.mixed.capture_next() if self.mixed is not None else False

    # ------------------------------------------------------------------ per step
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(scheduler_output).result()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Queue one step's device work and return at once; ``result()`` waits for its tokens.

        Chunk token ids < 0 are tokens the previous launch is still sampling: they are taken from its token
        tensor on the device, so step N+1 can be queued before step N's tokens reach the host."""
        if self.tp_setup.workers is not None:
            self.tp_control.broadcast_step(scheduler_output)  # type: ignore[union-attr]
        for rid in scheduler_output.finished_req_ids:
            self._drop(rid)
            self._rows.forget(rid)
        eos = self.model_config.eos_primary()
        for nr in scheduler_output.new_requests:
            self._drop(nr.req_id)  # re-sent after preemption: its device history is rebuilt from these lists
            self.requests[nr.req_id] = SamplingRequest(nr.sampling_params, list(nr.prompt_token_ids),
                                                       list(nr.output_token_ids), eos)
        chunks = scheduler_output.chunks
        if not chunks:
            return LaunchedStep([], [], None, [], [])
        batch = build_input_batch(chunks, self.block_size, self.device, self.dtype, self._torch_views, self._rows,
                                  self.sliding_window, tile_map=self.plan.ops.name == "triton")
        fill_placeholders(batch, chunks, self._last, self.device)
        req_ids = [chunks[i].req_id for i in batch.sample_chunk_ids]
        reqs = [self.requests[r] for r in req_ids]
        prompt = prompt_rows(chunks, batch, self.requests)
        plain = all(r.plain_greedy for r in reqs)
        structured = scheduler_output.structured
        # the graph's argmax is the answer only when no grammar mask has to be applied to the logits first
        logits, tokens, prompt_lps = self._logits(batch, plain, prompt, graph_argmax=plain and structured is None)
        if self.tp.rank > 0:  # a worker rank: rank 0 samples (and sends the tokens the next step may need)
            if self.supports_async and req_ids:
                self._last = (self.tp.receive_tokens(len(req_ids), self.device),
                              {rid: j for j, rid in enumerate(req_ids)})
            return LaunchedStep([], [], None, [], [])
        if logits is None and tokens is None:
            return LaunchedStep([], [], None, [], [], prompt_lps)
        if tokens is not None:  # all plain greedy: the graph's argmax is the sampler's answer
            logprobs: list = [None] * len(reqs)
            ids = None if self.supports_async else tokens.tolist()
        else:
            if structured is not None:  # wait for the grammar worker only now, after the forward
                mask = structured.result()
                apply_token_bitmask(logits, mask.rows, mask.bitmask)
            if not self.supports_async:  # synchronous: the sampler's host lists, as any Sampler subclass returns them
                with self.cpu_pool.torch_released() if self.cpu_pool is not None else contextlib.nullcontext():
                    ids, logprobs = self.sampler(logits, reqs)
            elif self._history_ok and any(r.params.uses_penalties for r in reqs):  # counts kept on the device
                self.token_history = self.token_history or TokenHistory(logits.shape[1], self.device)
                tokens, logprobs = self.sampler.sample(logits, reqs, self.token_history)
                self.token_history.record(reqs, tokens)
            else:
                tokens, logprobs = self.sampler.sample(logits, reqs)
        for r in reqs:  # positions the next launch must not reuse, though these tokens are not back yet
            r.num_sampled += 1
        if not self.supports_async:
            return LaunchedStep(req_ids, reqs, None, logprobs, ids, prompt_lps)
        if self.tp.size > 1:  # the workers fill the next step's placeholders from these too
            tokens = self.tp.send_tokens(tokens)
        self._last = (tokens, {rid: j for j, rid in enumerate(req_ids)})
        step = LaunchedStep(req_ids, reqs, tokens, logprobs, None, prompt_lps)
        step.copy_to_host()
        return step

    def _drop(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is not None and self.token_history is not None:
            self.token_history.release(req)

    def _logits(self, batch: InputBatch, plain_greedy: bool = False, prompt: PromptRows | None = None, *,
                graph_argmax: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None, dict | None]:
        """``(logits, None, plp)``: float32 logits of the sampling chunks in chunk order (None if none samples; KV
        is written anyway); ``(None, tokens, plp)``: their greedy tokens, taken from the graph's argmax (allowed by
        ``graph_argmax``). ``plp``: the prompt logprobs of ``prompt``'s rows (None without).

        Decode-only steps that fit a captured graph replay it (the graph computes logits for every row, so the
        lm_head runs inside it too); everything else runs eagerly with logits only for the sampled rows.
        ``plain_greedy`` (every sampled row only takes an argmax): the graph's model-dtype rows are gathered as
        they are (the argmax of bf16 logits equals that of their exact float32 copy), which skips a float32 pass
        and halves the gather and the argmax's read: ~12 B less traffic per vocabulary entry per row.
        """
        meta = batch.attn_meta
        t = batch.input_ids.shape[0]
        if (self.graphs is not None and meta.num_decode_tokens == t
                and self.graphs.can_run(t, meta.decode_block_tables.shape[1])):
            out = self.graphs.run(batch.input_ids, batch.positions, meta.slot_mapping, meta.decode_block_tables,
                                  meta.decode_context_lens)
            all_logits, argmax = out if isinstance(out, tuple) else (out, None)
            plp = None if prompt is None else prompt_logprobs(all_logits.index_select(0, prompt.flat_rows).float(),
                                                               prompt)
            if not batch.sample_chunk_ids:
                return None, None, plp
            if graph_argmax and argmax is not None:
                return None, argmax.index_select(0, batch.logits_indices), plp
            rows = all_logits.index_select(0, batch.logits_indices)
            return (rows if plain_greedy else rows.float()), None, plp
        hidden = (self.mixed.run(batch.input_ids, batch.positions, meta)
                  if self.mixed is not None and self.mixed.can_run(meta, t) else None)
        if hidden is None:
            hidden = self.model(batch.input_ids, batch.positions, meta)
        plp = None if prompt is None else prompt_logprobs(
            self.model.compute_logits(hidden.index_select(0, prompt.flat_rows)), prompt)
        if not batch.sample_chunk_ids:
            return None, None, plp
        return self.model.compute_logits(hidden.index_select(0, batch.logits_indices)), None, plp

    def shutdown(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        if getattr(self, "mixed", None) is not None:
            self.mixed.close()  # type: ignore[union-attr]
            self.mixed = None
        workers, self.tp_setup.workers = self.tp_setup.workers, None
        if workers is not None:
            workers.stop(self.tp_control)
        self.plan.ops.attention.bind_kv_cache([])
        self.kv_caches = []
        self.requests.clear()
        self._last = None
        if hasattr(self, "model"):
            del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
