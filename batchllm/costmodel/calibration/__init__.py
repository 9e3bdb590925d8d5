"""Calibration: the cost model corrected by what this machine measures.

A profile (shipped, learnt on this machine, or analytic for a GPU) is a *prior*; a run's
own measurements (engine steps, loads, finished outputs) are evidence. Each concept has
its own small module, holds bounded state (sufficient statistics or counts, never every
step) and gives a posterior in the profile's own terms:

    latency.py   LatencyCalibration: the step-latency linear model refit from steps,
                 the prior counted as pseudo-steps whose share fades as steps arrive
    lengths.py   LengthCalibration: the output-length CDF from finished outputs,
                 censoring-aware (cut at max_tokens, or still running), prior as
                 pseudo-outputs
    loads.py     LoadCalibration: engine start cost per replica shape
    model.py     ModelCalibration: the three for one model -> a calibrated Profile
    store.py     ProfileStore: what runs measured, kept under $BATCHLLM_HOME and keyed
                 by hardware identity, model and engine settings

Nothing here imports vLLM or the planner; the runtime feeds these and re-plans with them.
"""
