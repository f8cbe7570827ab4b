"""`python -m engine.kernels.bench` from a checkout's root (the code is in servecap/engine/kernels/)."""
