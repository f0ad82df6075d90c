#!/usr/bin/env bash
# ferrompi on a machine with an NVIDIA GPU: cupy arrays through every call, both paths.
#
#   bash scripts/gpu-check.sh
#
# 1. installs cupy for CUDA 12 unless PYTHON already imports cupy (pip install
#    cupy-cuda12x; CUPY_PACKAGE=cupy-cuda13x or cupy-cuda11x for another CUDA
#    major version);
# 2. prints what the MPI library says about CUDA (fm.cuda_aware() and why);
# 3. runs tests/test_gpu.py: plain pytest (simulated ranks, always staged), then
#    under mpiexec -n 2 with FERROMPI_CUDA_AWARE=0 (staged through pinned host
#    memory) and =1 (device pointers straight to MPI; those tests skip, saying
#    why, when the library answers that it is not CUDA-aware, as the PyPI
#    MPICH wheel does);
# 4. prints the benchmark's GPU row (benchmarks/run.py --ops allreduce_cupy).
#
# Both ranks may share GPU 0; with more GPUs, rank r uses GPU r % count.
# Environment: PYTHON (default .venv/bin/python, else python3; ferrompi must be
# installed in it with its dev extras, e.g. pip install -e '.[dev,mpich]'),
# MPIEXEC (default: the mpiexec next to PYTHON, else mpiexec on PATH).
# Runs every stage; exits non-zero if any failed.
set -u
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
MPIEXEC=${MPIEXEC:-$(dirname "$PYTHON")/mpiexec}
[ -x "$MPIEXEC" ] || MPIEXEC=mpiexec
export MPIEXEC_TIMEOUT=${MPIEXEC_TIMEOUT:-900}  # a hung job ends
export FERROMPI_TIMEOUT=${FERROMPI_TIMEOUT:-60}
export PYTHONUNBUFFERED=1

failed=()
stage() {
    echo
    echo "=== $1"
    shift
    "$@" || failed+=("$*")
}

nvidia-smi -L || echo "(nvidia-smi failed: the GPU tests will skip, saying why)"
if ! "$PYTHON" -c 'import cupy' 2>/dev/null; then
    stage "install cupy" "$PYTHON" -m pip install --quiet "${CUPY_PACKAGE:-cupy-cuda12x}"
fi
stage "what MPI says" "$PYTHON" -c '
import cupy, ferrompi as fm
print("cupy", cupy.__version__, "-", cupy.cuda.runtime.getDeviceCount(), "CUDA device(s)")
print("fm.cuda_aware():", fm.cuda_aware(), "-", fm.gpu.cuda_aware_reason())'

TESTS=(-m pytest -q -rs -p no:cacheprovider --timeout=300 --timeout-method=thread tests/test_gpu.py)
stage "tests, simulated ranks" "$PYTHON" "${TESTS[@]}"
for mode in 0 1; do
    stage "tests, mpiexec -n 2, FERROMPI_CUDA_AWARE=$mode" \
        "$MPIEXEC" -n 2 env FERROMPI_CUDA_AWARE=$mode "$PYTHON" "${TESTS[@]}" --with-mpi
done
stage "benchmark GPU row (allreduce, float32)" "$MPIEXEC" -n 2 "$PYTHON" benchmarks/run.py \
    --ops allreduce_cupy --no-torch --sizes 4,64KiB,1MiB,16MiB,64MiB

echo
if [ ${#failed[@]} -eq 0 ]; then
    echo "gpu-check: every stage passed"
else
    printf 'gpu-check: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
