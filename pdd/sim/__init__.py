"""`pdd sim`: a discrete-event simulator of a PDD fleet, driven by the project's own policy code.

hardware/    what a step costs and what a chip holds
  model_spec.py    a model's shape (dense, MoE, hybrid or compressed attention): parameters, FLOPs, KV bytes per token
  step_cost.py     seconds of one engine step (and, in closed form, of a run of decode steps)
  chip.py          one instance's hardware (one chip or several): step costs, KV memory, price, batch cap
  profiles.py      hardware profiles and model shapes as data (profiles/, models/), roofline or calibrated
  calibrate.py     `pdd sim calibrate`: time the real engine here, fit a step-cost profile
  list_profiles.py `pdd sim profiles`

fleet/       the simulation (simulator.py: simulate)
  events.py        the clock: a heap of (time, insertion order, callback)
  link.py          a network path: FIFO KV serialisation, propagation delay, seeded jitter
  deployment.py    instances per role, their chips, the KV paths (same_dc, naive, pdd)
  instance.py      an engine's KV blocks and admission by blocks (block_pool.py: the engine's BlockPool)
  prefill.py       P: chunked prefill within a token budget, KV streamed as it is computed
  decoder.py       D / MD / RLD: continuous batching, decode runs advanced in one event each
  router.py        the router service's route plan over loads, prefix indexes and link figures
  requests.py      a request's life across P, the links and the decoders (Fleet)
  md_side.py       MD's side: blocks shared in flight (sharing.py), landing, extend, decode
  handoff.py       the relay's half: decode first, hand over by token IDs, the anomalous-traffic filter
  job.py           one request's state while it runs
  records.py       RequestRecord per request, SimResult with its summary()

workloads/   what is served
  workload.py      the requests a simulation replays (SimRequest, Workload)
  agentic.py       the agentic generator `pdd bench e2e` uses; open and closed loop, fixed hit
  trace.py         Mooncake-format JSONL traces, read and written (traces/: a sample)

studies/     the questions asked of it, and their reports
  sla.py           the SLA a request and a run are held to
  goodput.py       SLA goodput (highest rate meeting the SLA) and BCR, from steady-state probes
  bathtub.py       goodput benefit against a baseline by prefix hit rate
  specs.py         command-line flags into deployments, workloads, SLAs and settings
  run.py           `pdd sim run`        plots.py  its figures
  validate.py      `pdd sim validate`   against `pdd bench e2e`'s measured runs (host_cpu.py)
  paper.py         `pdd sim paper`      the paper's fleet table beside ours, per scenario
  map.py           `pdd sim map`        where PDD pays
  plan.py          `pdd sim plan`       planner.py  the cheapest fleet meeting an SLA
cli.py         the `pdd sim` dispatch
"""
