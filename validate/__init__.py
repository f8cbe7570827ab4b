"""`python -m validate` from a checkout's root: runs `python -m servecap.validate` (the code is in servecap/validate/)."""
