"""`python -m engine` from a checkout's root: runs `python -m servecap.engine` (the code is in servecap/engine/)."""
