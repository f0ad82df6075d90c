#!/usr/bin/env bash
# torch's own distributed conformance suite (DistributedTest._DistTestBase), every
# process group a "ferrompi" group: tests/torch_suite/distributed_suite.py.
#
#   bash scripts/torch-suite.sh            # from the repository root
#
# Under gloo's name (every test torch runs for gloo), then under "mpi"'s (the tests
# only torch's MPI backend runs, from 3 ranks as torch ran them), in these modes:
#   * torch's harness (MultiProcessTestCase's _start_processes, its exit codes and
#     file rendezvous) at 2 and 3 ranks, its processes forked from a server that
#     has imported torch's suite: with spawn (TestDistBackendWithSpawn) each test's
#     processes import the suite, 5 s, before a 0.5 s test, which makes 18 minutes
#     at 2 ranks and about 25 at 3 on 2 cores;
#   * with TORCH_SUITE_SPAWN=1, also torch's TestDistBackendWithSpawn at 2 ranks;
#   * mpiexec -n 3 and -n 4, each rank running every test in its own process (4: the
#     tests that need exactly 4 ranks).
# Exits non-zero if any run fails. Environment: PY (default .venv/bin/python),
# MPIEXEC (default .venv/bin/mpiexec), TEST_TIMEOUT (seconds per test, 300),
# MPI_RUN_TIMEOUT (seconds per mpiexec run, 1200), PYTEST_ARGS (extra arguments),
# TORCH_SUITE_SPAWN (1: add the spawn run).
set -u
cd "$(dirname "$0")/.."

PY=${PY:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-.venv/bin/mpiexec}
TEST_TIMEOUT=${TEST_TIMEOUT:-300}
MPI_RUN_TIMEOUT=${MPI_RUN_TIMEOUT:-1200}
PYTEST_ARGS=${PYTEST_ARGS:-}

if ! "$PY" -c "import torch, expecttest" 2>/dev/null; then
  echo "torch (or expecttest) not installed: torch's suite skipped"
  exit 0
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
suite=tests/torch_suite/distributed_suite.py
args=(--noconftest -p no:ferrompi -q -rfE --timeout="$TEST_TIMEOUT" --timeout-method=thread)
modes=("Forkserver 2" "Forkserver 3" "mpiexec 3" "mpiexec 4")
if [ "${TORCH_SUITE_SPAWN:-0}" = 1 ]; then
  modes=("Spawn 2" "${modes[@]}")
fi
status=0
for names in gloo mpi; do
  for mode in "${modes[@]}"; do
    how=${mode% *} size=${mode#* }
    if [ "$names" = mpi ] && [ "$size" -lt 3 ]; then
      continue # torch ran its MPI backend at 3 ranks: its group tests take ranks 1 and 2
    fi
    echo "--- BACKEND=$names, $how, $size ranks"
    run=(env -u MASTER_ADDR -u MASTER_PORT BACKEND="$names" WORLD_SIZE="$size"
      TEMP_DIR="$dir" INIT_METHOD="file://$dir/init" FERROMPI_FLIGHT_DIR="$dir")
    if [ "$how" = mpiexec ]; then
      run+=(MPIEXEC_TIMEOUT="$MPI_RUN_TIMEOUT" "$MPIEXEC" -n "$size" "$PY" -m pytest "${args[@]}"
        "$suite::TestDistBackendUnderMpiexec")
    else
      run+=("$PY" -m pytest "${args[@]}" "$suite::TestDistBackendWith$how")
    fi
    # shellcheck disable=SC2086
    "${run[@]}" $PYTEST_ARGS || status=1
  done
done
exit "$status"
