"""KV caches: EQSPEC's padded layout, EXSPEC's block store and its cache of full blocks."""
