import runpy

runpy.run_module("servecap.engine", run_name="__main__", alter_sys=True)
