"""exspec-bench: the paper's comparison (autoregressive, EQSPEC, EXSPEC, Hugging Face baselines).

cli (the run and its arguments), methods (one runner per method), equivalence (the greedy
reference and divergence report), ideal (the analytic ideal from measured forward costs),
report (results.md and throughput.png). Tooling only: the engine never imports it.
"""
