"""`python -m sim` from a checkout's root: runs `python -m servecap.sim` (the code is in servecap/sim/)."""
