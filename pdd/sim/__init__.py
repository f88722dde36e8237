"""`pdd sim`: a discrete-event simulator of a PDD fleet, driven by the project's own policy code.

Inputs
  model_spec.py   a model's shape (dense, MoE, hybrid attention): parameters, FLOPs, KV bytes per token
  step_cost.py    seconds of one engine step (and, in closed form, of a run of decode steps)
  chip.py         one instance's hardware (one chip or several): step costs, KV memory, price (Chip)
  profiles.py     hardware profiles and model shapes as data (profiles/, models/), roofline or calibrated
  calibrate.py    `pdd sim calibrate`: time the real engine here, fit a step-cost profile
  workload.py     the requests a simulation replays (SimRequest, Workload)
  agentic.py      the agentic generator `pdd bench e2e` uses; open and closed loop, fixed hit
  trace.py        Mooncake-format JSONL traces, read and written
  deployment.py   instances per role, their chips, the KV paths (same_dc, naive, pdd)

The simulation (simulator.py: simulate)
  events.py       the clock: a heap of (time, insertion order, callback)
  link.py         a network path: FIFO KV serialisation, propagation delay, seeded jitter
  instance.py     an engine's KV blocks and admission by blocks
  block_pool.py   its KV block pool: the engine's BlockPool exactly, in fewer steps per block
  prefill.py      P: chunked prefill within a token budget, KV streamed as it is computed
  decoder.py      D / MD / RLD: continuous batching, decode runs advanced in one event each
  router.py       the router service's route plan over loads, prefix indexes and link figures
  fleet.py        a request's life across P, the links and MD
  sharing.py      block arithmetic of prompt KV shared in flight (shared/engine/in_flight.py's rule)
  handoff.py      the relay's half: decode first, hand over by token IDs, the anomalous-traffic filter
  job.py          one request's state while it runs
  records.py      RequestRecord per request, SimResult with its summary()

Questions asked of it
  sla.py          the SLA a request and a run are held to
  goodput.py      SLA goodput (highest rate meeting the SLA) and BCR
  bathtub.py      goodput benefit against a baseline by prefix hit rate
  specs.py        command-line flags into deployments, workloads, SLAs and settings
  run.py          `pdd sim run`        plots.py  its figures
  validate.py     `pdd sim validate`   against `pdd bench e2e`'s measured runs
                  host_cpu.py  the measured host's CPU as the engines get it
  paper.py        `pdd sim paper`      the paper's fleet table beside ours, per scenario
  map.py          `pdd sim map`        where PDD pays: KV bytes/token x line x prefix hit
  plan.py         `pdd sim plan`       planner.py  the cheapest fleet meeting an SLA
  list_profiles.py `pdd sim profiles`  cli.py  the `pdd sim` dispatch
"""
