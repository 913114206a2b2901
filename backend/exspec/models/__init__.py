"""Models: loading a pair, what the layouts can serve, the compiled forward, the real pair."""
