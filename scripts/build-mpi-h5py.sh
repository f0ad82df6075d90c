#!/usr/bin/env bash
# Build an MPI-enabled h5py (driver="mpio") in its own virtual environment and run
# ferrompi's single-shared-file checkpoint tests with it, under Debian's MPICH.
#
#   sudo bash scripts/build-mpi-h5py.sh [VENV]       # default VENV: /opt/ferrompi-h5mpi
#
# What it does (Debian 12, about 6 minutes on 2 cores, almost all of it compiling):
#   1. apt-get install libhdf5-mpich-dev mpich (parallel HDF5 1.10 and MPICH 4.0);
#   2. a new venv with current pip/setuptools, numpy, cython, pkgconfig;
#   3. mpi4py from source against Debian's MPICH (MPICC=/usr/bin/mpicc.mpich);
#   4. h5py from source with HDF5_MPI=ON against Debian's parallel HDF5;
#   5. ferrompi (editable, --no-deps) and the test tools;
#   6. the checkpoint tests, in one process and under mpiexec.mpich -n 2 and 3
#      (skip them with RUN_TESTS=0).
#
# Never install the PyPI `mpich` wheel (ferrompi's [mpich] extra) into this venv, and
# never launch it with another implementation's mpiexec: two MPICH libraries in one
# process fail at the first communicator call. Debian's python3-h5py-mpi is built on
# Open MPI and needs numpy < 2, so it is not used.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-${VENV:-/opt/ferrompi-h5mpi}}
PYTHON=${PYTHON:-python3}
RUN_TESTS=${RUN_TESTS:-1}
JOBS=${JOBS:-$(nproc)}

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

step "Debian packages"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends libhdf5-mpich-dev mpich >/dev/null
dpkg-query -W -f='${Package} ${Version}\n' libhdf5-mpich-dev mpich

step "virtual environment $VENV"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --no-cache-dir)
"${PIP[@]}" -U pip setuptools wheel numpy cython pkgconfig

step "mpi4py from source (MPICC=/usr/bin/mpicc.mpich)"
MPICC=/usr/bin/mpicc.mpich "${PIP[@]}" --no-binary=mpi4py mpi4py

step "h5py from source (HDF5_MPI=ON, Debian's parallel HDF5)"
# Compile h5py's extensions in parallel: setuptools reads this extra config file.
extra=$(mktemp --suffix=.cfg)
trap 'rm -f "$extra"' EXIT
printf '[build_ext]\nparallel = %s\n' "$JOBS" >"$extra"
DIST_EXTRA_CONFIG=$extra HDF5_MPI=ON HDF5_DIR=/usr/lib/x86_64-linux-gnu/hdf5/mpich \
  CC=/usr/bin/mpicc.mpich "${PIP[@]}" --no-binary=h5py --no-build-isolation h5py

step "ferrompi and the test tools"
"${PIP[@]}" pytest pytest-mpi pytest-timeout hypothesis
"${PIP[@]}" --no-deps -e "$ROOT"
"$VENV/bin/python" - <<'EOF'
import h5py, mpi4py, numpy
from mpi4py import MPI
assert h5py.get_config().mpi, "h5py was built without MPI"
print("h5py", h5py.__version__, "HDF5", h5py.version.hdf5_version, "mpi", h5py.get_config().mpi)
print("mpi4py", mpi4py.__version__, "numpy", numpy.__version__)
print(MPI.Get_library_version().splitlines()[0])
EOF

if [ "$RUN_TESTS" = 1 ]; then
  cd "$ROOT"
  export FERROMPI_TIMEOUT=${FERROMPI_TIMEOUT:-60} MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-600}
  PYTEST=("$VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout=300
    --timeout-method=thread)
  step "tests, one process (HDF5 1.10 of Debian underneath)"
  "${PYTEST[@]}" tests/test_checkpoint_single.py tests/test_checkpoint_files.py
  for n in 2 3; do
    step "tests under mpiexec.mpich -n $n"
    mpiexec.mpich -n "$n" "${PYTEST[@]}" --with-mpi tests/test_checkpoint_single.py \
      tests/test_checkpoint.py
  done
fi
step "done: $VENV"
