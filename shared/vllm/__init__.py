"""vLLM engines in pdd's roles. vLLM is imported only in this package, so nothing else in pdd
needs it.

- engine.py: `VllmEngine`, vLLM's v1 LLMEngine in the service's process behind pdd's engine seam
  (shared/engine/seam.py); requests.py translates requests and outputs, sampling.py pdd's
  sampling params into vLLM's, checkpoint.py gives vLLM a checkpoint directory (and says which
  models it cannot load).
- connector.py: a KV connector (vLLM v1's KVConnectorBase_V1, kv_both) that saves and loads KV
  as pdd's 16-token blocks named by pdd's chained hashes (the pure planning in plan.py; vLLM's
  CPU cache as pdd's layout in cache_layout.py), so prefill's exporter, the bulk channel, the
  router's prefix index and MD's decode-side prefix cache see the same blocks whichever engine
  runs a role.
- memory_store.py: the blocks a service holds (LRU, pins, events), store_calls.py the seam's
  block calls over it; block_store.py: a directory store between separate processes.
- The handoff by token IDs: MD's request is the prompt plus the tokens the relay produced; the
  connector loads the prompt's blocks and vLLM computes the relayed tokens in one pass.
"""
