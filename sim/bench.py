import runpy

if __name__ == "__main__":
    runpy.run_module("servecap.sim.bench", run_name="__main__", alter_sys=True)
