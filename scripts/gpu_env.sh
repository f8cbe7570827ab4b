# Source at the start of every command on the GPU machine: the carried wheels (simpy is not in its image). Make them
# here once, then carry .whl/: `pip download --no-deps -d .whl simpy tqdm`. Without them the command stops here,
# before a refresh or a plan spends the GPU's time on a run that cannot simulate.
if ! ls .whl/*.whl > /dev/null 2>&1; then
  echo "gpu_env: no wheels in .whl/ (carry it; make it with: pip download --no-deps -d .whl simpy tqdm)" >&2; exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import simpy, tqdm" || { echo "gpu_env: simpy or tqdm does not import after installing .whl/" >&2; exit 2; }
