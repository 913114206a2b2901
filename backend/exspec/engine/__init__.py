"""The tick: LLMEngine, the pool and its scheduler, the model runner, a sequence, a group."""
