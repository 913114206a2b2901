"""Speculation: the Proposer interface and one module per proposer; draft stop, vocabularies."""
