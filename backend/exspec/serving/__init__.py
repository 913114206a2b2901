"""Running the backend: the one install step (install), the exspec-serve launcher (launcher)
and the port allocator its servers share (ports). Copies files and runs processes; never
imports Triton."""
