"""Layer 3, the LLM engine. One role per module:

core (token ids only, runs in the engine-core process or in-process):
  request.py          Request state, stop rules, prompt-length check
  block_pool.py       fixed-size KV blocks, reference counts, prefix cache with LRU eviction
  kv_cache_manager.py per-request block tables; the scheduler's only view of the pool
  scheduler.py        continuous batching, chunked prefill, preemption -> SchedulerOutput
  engine_core.py      scheduler + model runner, one step() at a time
front end (text, runs in the API process or in-process):
  input_processor.py  prompt validation / tokenisation
  detokenizer.py      incremental detokenisation and stop strings
  output_processor.py EngineCoreOutputs -> RequestOutput (n > 1, delta / final, logprobs, metrics)
  llm_engine.py, llm.py   offline synchronous engine and the vLLM-style ``LLM``
  core_client.py      CoreClient contract + InprocCoreClient (mp_client.py: the multi-process one)
  async_llm.py        AsyncLLM: streaming generate / abort for the HTTP server
"""
