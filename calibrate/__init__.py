"""`python -m calibrate` from a checkout's root: runs `python -m servecap.calibrate` (the code is in servecap/calibrate/)."""
