"""Each request's output length predicted from its prompt, per model (issue "Know each
answer's length before it is written"): hashed text features and cues (features.py), a
censoring-aware ridge fit of log length (censored_fit.py), the model as a shift per request
on a shared residual base (model.py), gated against the per-model CDF on held-out outputs
(gate.py), learnt from the outputs a model wrote on this machine (observations.py).

No vLLM, torch or transformers: the cost model's layer (numpy, scipy, scikit-learn).
"""
