"""`python -m traces` from a checkout's root: runs `python -m servecap.traces` (the code is in servecap/traces/)."""
