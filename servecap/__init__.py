"""servecap: capacity planning for LLM serving. `servecap COMMAND ...` (or `python -m servecap COMMAND ...`) runs
one of the packages' command lines: sim, engine, calibrate, traces, validate."""
