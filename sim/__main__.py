import runpy

runpy.run_module("servecap.sim", run_name="__main__", alter_sys=True)
