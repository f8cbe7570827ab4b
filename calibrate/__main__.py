import runpy

runpy.run_module("servecap.calibrate", run_name="__main__", alter_sys=True)
