import runpy

runpy.run_module("servecap.validate", run_name="__main__", alter_sys=True)
