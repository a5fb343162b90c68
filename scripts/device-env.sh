# Source this on the GPU device machine (repo root): installs the carried wheels (.whl/,
# torch_memory_saver) into /tmp/site and puts them and src/ on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
handoff() { python3 -m handoff "$@"; }
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm --format=csv,noheader
# The hardware preset the runs plan with: the lent card may be an H100 or an H200.
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then HW=h200; else HW=h100-sxm; fi
export HW
