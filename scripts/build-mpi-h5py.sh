#!/usr/bin/env bash
# An MPI-enabled h5py (driver="mpio") in its own virtual environment, and ferrompi's
# single-shared-file checkpoint tests run with it under Debian's MPICH.
#
#   bash scripts/build-mpi-h5py.sh [VENV]     # as root; default VENV: .venv-h5mpi
#
# scripts/test.sh runs this as its "MPI h5py" stage. The environment is built once
# (Debian 12, 2 cores: about 5 minutes, almost all of it compiling) and reused while
# its h5py still reports MPI:
#   1. apt-get install libhdf5-mpich-dev mpich (parallel HDF5 1.10 and MPICH 4.0);
#   2. a new venv with current pip/setuptools, numpy, cython, pkgconfig;
#   3. mpi4py (MPI4PY_VERSION, default 4.1.2) from source against Debian's MPICH
#      (MPICC=/usr/bin/mpicc.mpich): PyPI's mpi4py wheel looks for libmpi.so.12,
#      which Debian names libmpich.so.12;
#   4. h5py (H5PY_VERSION, default 3.16.0) from source with HDF5_MPI=ON against
#      Debian's parallel HDF5;
#   5. ferrompi (editable, --no-deps), its other dependencies (ml_dtypes; also added
#      to a reused environment), and the test tools.
# Then the checkpoint tests, in one process and under `mpiexec.mpich -n N` for N in
# MPI_SIZES (default "2 3 4"; RUN_TESTS=0 skips them). Exits non-zero if a step or a
# test run failed.
#
# Never install the PyPI `mpich` wheel (ferrompi's [mpich] extra) into this venv, and
# never launch it with another implementation's mpiexec: two MPICH libraries in one
# process fail at the first communicator call. Debian's python3-h5py-mpi is built on
# Open MPI and needs numpy < 2, so it is not used.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-${VENV:-.venv-h5mpi}}
PYTHON=${PYTHON:-python3}
RUN_TESTS=${RUN_TESTS:-1}
MPI_SIZES=${MPI_SIZES:-"2 3 4"}
JOBS=${JOBS:-$(nproc)}
# Versions built and tested here against Debian 12's HDF5 1.10.8 and MPICH 4.0.2
# (newer h5py releases may drop support for that HDF5).
H5PY_VERSION=${H5PY_VERSION:-3.16.0}
MPI4PY_VERSION=${MPI4PY_VERSION:-4.1.2}
cd "$ROOT"

step() { echo; echo "=== $* ($(date -u +%H:%M:%S))"; }

report() { # the environment's versions; fails unless its h5py has MPI
  "$VENV/bin/python" - <<'PY'
import h5py, mpi4py, numpy
from mpi4py import MPI
assert h5py.get_config().mpi, "h5py was built without MPI"
print("h5py", h5py.__version__, "HDF5", h5py.version.hdf5_version, "mpi", h5py.get_config().mpi)
print("mpi4py", mpi4py.__version__, "numpy", numpy.__version__)
print(MPI.Get_library_version().splitlines()[0])
PY
}

if [ -x "$VENV/bin/python" ] && command -v mpiexec.mpich >/dev/null && report 2>/dev/null; then
  step "reusing $VENV"
else
  step "Debian packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends libhdf5-mpich-dev mpich >/dev/null
  dpkg-query -W -f='${Package} ${Version}\n' libhdf5-mpich-dev mpich

  step "virtual environment $VENV"
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip install -q --no-cache-dir)
  "${PIP[@]}" -U pip setuptools wheel numpy cython pkgconfig

  step "mpi4py from source (MPICC=/usr/bin/mpicc.mpich)"
  MPICC=/usr/bin/mpicc.mpich "${PIP[@]}" --no-binary=mpi4py "mpi4py==$MPI4PY_VERSION"

  step "h5py from source (HDF5_MPI=ON, Debian's parallel HDF5)"
  # Compile h5py's extensions in parallel: setuptools reads this extra config file.
  extra=$(mktemp --suffix=.cfg)
  trap 'rm -f "$extra"' EXIT
  printf '[build_ext]\nparallel = %s\n' "$JOBS" >"$extra"
  DIST_EXTRA_CONFIG=$extra HDF5_MPI=ON HDF5_DIR=/usr/lib/x86_64-linux-gnu/hdf5/mpich \
    CC=/usr/bin/mpicc.mpich "${PIP[@]}" --no-binary=h5py --no-build-isolation "h5py==$H5PY_VERSION"

  step "ferrompi and the test tools"
  "${PIP[@]}" pytest pytest-mpi pytest-timeout hypothesis
  "${PIP[@]}" --no-deps -e "$ROOT"
  report
fi

# ferrompi's pure-Python dependencies beyond mpi4py, h5py and numpy (built above):
# installed here too when the environment is reused, since they may be newer than it.
if ! "$VENV/bin/python" -c "import ml_dtypes" 2>/dev/null; then
  step "ferrompi's other dependencies"
  "$VENV/bin/python" -m pip install -q --no-cache-dir "ml_dtypes>=0.4"
fi

if [ "$RUN_TESTS" = 1 ]; then
  export FERROMPI_TIMEOUT=${FERROMPI_TIMEOUT:-60} MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-600}
  PYTEST=("$VENV/bin/python" -m pytest -q -p no:cacheprovider --timeout=300
    --timeout-method=thread)
  status=0
  step "tests, one process (HDF5 1.10 of Debian underneath)"
  "${PYTEST[@]}" tests/test_checkpoint_single.py tests/test_checkpoint_files.py || status=1
  for n in $MPI_SIZES; do
    step "tests under mpiexec.mpich -n $n"
    mpiexec.mpich -n "$n" "${PYTEST[@]}" --with-mpi tests/test_checkpoint_single.py \
      tests/test_checkpoint.py || status=1
  done
  exit "$status"
fi
step "done: $VENV"
