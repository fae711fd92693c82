#!/usr/bin/env bash
# Everything a GPU machine is lent for, in one call: the checks of docs/gpu.md ("Checking a GPU
# machine") one after the other, each under its own time limit, each one's output in OUT, and a
# one-line verdict per step in OUT/summary.txt. A step that fails does not stop the next.
#
# The GPU machine has no Rust toolchain: build here and carry the two binaries.
#
#   cargo build --profile dist -p nemo-dag                                # target/dist/nemo-dag
#   cargo test --profile dist -p nemo-dag-kernels --lib --no-run          # its path is printed
#   bench/gpu_session.sh [OUT]        # on the GPU machine, from the repository root
#
# BIN and KERNEL_TESTS name the binaries if they are elsewhere. The libraries (NVRTC 13.0,
# cuBLASLt 13, NCCL 2) and the CUDA headers are looked for in the Python environment's nvidia
# wheels and under /usr/local/cuda; what is found is printed, what is missing fails the step
# that needs it, with the reason.
#
# Steps, and their limits: 8 minutes 35 s together, and with the 10 s each may take to die
# after its limit 9 minutes 45 s, inside one call of at most 10 minutes. Measured on an H200 on 2026-11-28
# (three calls, before the profile ran twice and before synccheck and the compiled step):
# gpu-check 107 to 143 s, bench 17 to 25, one profile pass 34 to 45, kernels 2 and their
# racecheck 13 to 14, memcheck 28 to 32, ops 2 to 3; racecheck over gpu-check was stopped at
# its 90 s (it had reached the DPO part), as it was on an H100 (then over the kernels' unit
# tests), so it runs only when STEPS names it.
#   gpu-check   the trainer against the CPU, cuBLASLt, NCCL, decoding, speed    155 s
#   bench       bench/gpu_bench.py: the same models in PyTorch eager, same GPU,
#               beside gpu-check's figures, and PyTorch's attention alone        50 s
#   profile     gpu-check's speed part for one step with every launch timed
#               (NEMO_DAG_KERNEL_TIMES), the CPU not timed: where a step goes;
#               then again with the attention's tiles copied without cp.async
#               (NEMO_DAG_CUDA_DEFINES=ATTN_ASYNC=0), to set the two side by side 100 s
#   kernels     every kernel's unit tests on the GPU (NEMO_DAG_KERNEL_TESTS_ON),
#               then compute-sanitizer racecheck and synccheck over the
#               tensor-core attention's                                          60 s
#   memcheck    compute-sanitizer memcheck over gpu-check without timing         40 s
#   ops         bench/gpu_ops.yaml on the CPU and with vars.device=cuda           15 s
#   compiled    bench/gpu_bench.py --compiled-only: torch.compile's twins        95 s
#   racecheck   compute-sanitizer racecheck over gpu-check (only when named)     90 s
# STEPS="kernels gpu-check bench" runs only those steps, in the order above (bench and
# compiled read gpu-check's JSON, so they need gpu-check before them).
# At most 8 files come back from the machine: the JSON report stays there, its figures are in
# gpu-check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-session}}
mkdir -p "$out"
bin=$(realpath "${BIN:-target/dist/nemo-dag}")
kernel_tests=${KERNEL_TESTS:-$(find target/dist/deps -maxdepth 1 -type f -executable \
    -name 'nemo_dag_kernels-*' 2>/dev/null | head -n 1)}
: >"$out/summary.txt"

# The libraries' directories, from the wheels PyTorch's image carries or a CUDA install.
site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)
roots=("$site/nvidia" /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/lib/x86_64-linux-gnu)
dirs=""
for lib in libnvrtc.so.13 libcublasLt.so.13 libnccl.so.2; do
    found=$(find "${roots[@]}" -name "$lib" 2>/dev/null | head -n 1)
    echo "$lib: ${found:-not found}" | tee -a "$out/summary.txt"
    [[ -n $found ]] && dirs="$dirs:$(dirname "$found")"
done
export LD_LIBRARY_PATH="${dirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
header=$(find "$site/nvidia" /usr/local/cuda/include -name cuda_bf16.h 2>/dev/null | head -n 1)
[[ -n $header ]] && export NEMO_DAG_CUDA_HOME=$(dirname "$(dirname "$header")")
echo "NEMO_DAG_CUDA_HOME: ${NEMO_DAG_CUDA_HOME:-not found}" | tee -a "$out/summary.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    | tee -a "$out/summary.txt"

# step NAME SECONDS COMMAND...: runs it into OUT/NAME.log and records its exit status (unless
# STEPS leaves it out).
step() {
    local name=$1 limit=$2
    shift 2
    if [[ -n ${STEPS:-} && " $STEPS " != *" $name "* ]]; then
        return
    fi
    echo "== $name (at most ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
    tail -n 25 "$out/$name.log"
}

work=$(mktemp -d)
step gpu-check 155 "$bin" gpu-check --json "$work/check.json" --speed-steps 10
step bench 50 python3 bench/gpu_bench.py --report "$work/check.json" --steps 10 --no-compile
step profile 100 bash -c "export NEMO_DAG_KERNEL_TIMES=1
    '$bin' gpu-check --speed-steps 1 --speed-cpu-steps 0; first=\$?
    echo '== the same, the attention tiles copied without cp.async (ATTN_ASYNC=0)'
    NEMO_DAG_CUDA_DEFINES=ATTN_ASYNC=0 '$bin' gpu-check --speed-steps 1 --speed-cpu-steps 0
    exit \$((first | \$?))"
if [[ -n $kernel_tests ]]; then
    # Then the tensor-core attention's unit test under racecheck and synccheck: its tiles
    # share memory between warps through a two-stage cp.async pipeline, and it is the newest
    # kernel that does.
    step kernels 60 bash -c "set -e; export NEMO_DAG_KERNEL_TESTS_ON=cuda
        '$kernel_tests' --test-threads 1
        for tool in racecheck synccheck; do
            compute-sanitizer --tool \$tool --report-api-errors no --error-exitcode 4 \\
                '$kernel_tests' the_tensor_core --test-threads 1
        done"
else
    echo "kernels: no kernels' test binary (KERNEL_TESTS)" | tee -a "$out/summary.txt"
fi
# NCCL's start probes its kernel images with calls that fail (no kernel image for this device)
# and carries on; those API errors are not ours, and an error of a call of ours fails gpu-check
# itself. Memory errors are still all reported.
step memcheck 40 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
    "$bin" gpu-check --speed-steps 0
# Two stores: the device is not part of a key, so one store would find the GPU run cached.
mkdir "$work/cpu" "$work/gpu"
cp bench/gpu_ops.yaml "$work/cpu/ops.yaml"
cp bench/gpu_ops.yaml "$work/gpu/ops.yaml"
# Each run prints its stages' losses and the eval's perplexity, to be read side by side.
step ops 15 bash -c "set -e; cd '$work/cpu'; '$bin' run ops.yaml; cd '$work/gpu'
    '$bin' run ops.yaml vars.device=cuda; grep -h 'device' .nemo-dag/artifacts/*/log.txt"
# Last, as the longest: each twin compiles before it is timed.
step compiled 95 python3 bench/gpu_bench.py --report "$work/check.json" --steps 10 --compiled-only
# Over gpu-check too, which runs every kernel with __shared__ memory at a trainer's shapes and
# the decoder's: racecheck over the kernels' unit tests, many small launches each, did not get
# through the attention tests in 50 s. Only when STEPS names it: it has never finished in 90 s.
if [[ " ${STEPS:-} " == *" racecheck "* ]]; then
    step racecheck 90 compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 4 \
        "$bin" gpu-check --speed-steps 0
fi
echo "== summary"
cat "$out/summary.txt"
