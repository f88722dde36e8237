"""`pdd sim`: a discrete-event simulator of a PDD fleet, driven by the project's own policy code.

step_cost.py   seconds of one engine step (and of a run of decode steps), from a StepLoad
model_spec.py  a model's shape: parameters, FLOPs and KV bytes per token
workload.py    the requests a simulation replays (SimRequest, Workload)
chip.py        one instance's hardware: step costs, KV memory, price (Chip)
"""
