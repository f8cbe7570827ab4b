import runpy

runpy.run_module("servecap.traces", run_name="__main__", alter_sys=True)
