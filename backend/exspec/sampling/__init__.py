"""Sampling: the sampler and its noise, logits processing, logprobs, structured outputs."""
