"""The demos (`make demo`) and the tiny seeded model pairs the tests, the benchmark and the
demos build in code: engine (the engine side by side with the target alone), server (the
backend in a real tritonserver, as a client sees it), tiny (the pairs)."""
