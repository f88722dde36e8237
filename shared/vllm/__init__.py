"""vLLM engines in pdd's roles: a KV connector (vLLM v1's KVConnectorBase_V1) that moves KV as
pdd's block groups, named by pdd's chained hashes, and pdd's sampling params as vLLM's
(sampling.py). vLLM is imported only in this package, so nothing else in pdd needs it.

What there is: a local block store (block_store.py, one file per vLLM block) between a vLLM
producer, which saves each prompt's full blocks, and a vLLM consumer, which loads the leading
blocks it finds and computes only the rest (connector.py; the pure planning in plan.py; vLLM's
CPU cache as pdd's layout in cache_layout.py).

How it maps onto pdd's mechanisms later:
- The store stands in for the KV bulk channel (shared/kv). P (a vLLM kv_producer) exports each
  prompt block as it is computed, as prefill's exporter does, into KVClient.send_blocks toward
  MD over the WAN and RLD over the local path, only the blocks MD lacks; MD and RLD (vLLM
  kv_consumers) import what their receiver landed (prompt_kv), and get_num_new_matched_tokens
  answers from the blocks landed so far (asynchronously, `load_kv_async`, while they are in flight).
- The names are pdd's: a vLLM block is named by the chained hash of its last 16-token pdd block
  (shared/kv/vllm_blocks.py), and its group is, as a view, the group of its pdd blocks
  (shared/kv/device_blocks.py), so pdd's router, prefix-hit routing and MD's decode-side prefix
  cache see the same hashes whichever engine runs a role.
- The handoff by token IDs is a consumer request whose tokens are the prompt plus the tokens RLD
  relayed: the connector loads the prompt's blocks and vLLM computes the relayed tokens in one
  extend pass, as MD's extend does.
"""
