#!/usr/bin/env bash
# One run on the GPU machine: versions, the stand-in build, tests/gpu with coverage of
# aiodla/runtime/_cuda.py, compute-sanitizer over the stand-in (tests/gpu/sanitize), then
# the GPU benchmark. Run from the repository root:
#
#     bash tests/gpu/device_run.sh                       # every step
#     STEPS="build sanitize" bash tests/gpu/device_run.sh  # only those (build first)
#     STEPS="build pytest kernels datapath" bash tests/gpu/device_run.sh  # the data path
#     PACK=1 STEPS="build isolated" bash tests/gpu/device_run.sh  # decoding processes:
#         NVDEC's pictures across CUDA IPC, sixteen streams against reader threads
#     PACK=1 STEPS="build threaded depths poolsync" bash tests/gpu/device_run.sh  # ring
#         depths for sixteen NVDEC streams, ThreadedDecoder's hold on the GIL, the pool
#         test both ways under synccheck; one archive
#     STEPS="build profile video poolsync" bash tests/gpu/device_run.sh  # camera to boxes,
#         the loop thread sampled; and, as below, the cameras' questions
#     STEPS="build pytest video poolsync shared" bash tests/gpu/device_run.sh  # cameras:
#         the open questions of "Cameras in" and issue 45 (about 9 minutes by the steps'
#         earlier timings; not yet run as one call)
#
# Wheels the image lacks travel in .whl/ (installed one by one); PyAV and PyNvVideoCodec,
# too large together for wheels within the carry limit, may travel as their installed
# files, packed: .whlvid/videosite.tar.xz (made with `pip install --no-deps --target DIR
# --python-version 3.12 --only-binary=:all: av pynvvideocodec` and tar cJf of DIR).
#
# Everything worth keeping goes under $OUT (default ./device-out): the build log, the
# pytest log and JUnit XML, the coverage reports, the sanitizer's logs and verdict, the
# benchmark's JSON and log. A failing step never stops the later ones; the summary at
# the end says what failed. Each step has its own time limit; all of them together take
# up to about 24 minutes, so a single bounded call (10 minutes) runs a subset through STEPS.

set -u
set -o pipefail
export PYTHONUNBUFFERED=1

OUT="${OUT:-$PWD/device-out}"
mkdir -p "$OUT"
REPO="$PWD"
STANDIN_DIR=/tmp/aiodla-standin
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export COVERAGE_FILE=/tmp/aiodla-gpu.coverage
STEPS="${STEPS:-build pytest sanitize bench kernels detect datapath faults isolation threads}"
declare -A STATUS

wanted() { [[ " $STEPS " == *" $1 "* ]]; }

step() {  # step NAME SECONDS COMMAND...: run, log to $OUT/NAME.log, remember the exit code
    local name="$1" limit="$2"
    shift 2
    echo
    echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s) ==="
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=$?
    STATUS[$name]=$rc
    echo "=== $name: exit $rc"
}

echo "=== versions"
{
    python3 --version
    python3 -c "import cuda.bindings, numpy; print('cuda-bindings', cuda.bindings.__version__); print('numpy', numpy.__version__)"
    python3 -c "import pytest; print('pytest', pytest.__version__)"
    nvcc --version | tail -n 2
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
} 2>&1 | tee "$OUT/versions.log"

if [ -d .whl ] && compgen -G ".whl/*.whl" > /dev/null; then
    echo "=== installing carried wheels: $(ls .whl)"
    # One wheel at a time: a wheel for other Pythons (backports-asyncio-runner is for
    # < 3.12, and the device machine has 3.12) must not stop the others installing.
    STATUS[wheels]=0
    for wheel in .whl/*.whl; do
        python3 -m pip install -q --no-index --no-deps --target /tmp/site "$wheel" \
            || echo "=== skipped $wheel (not for this Python)"
    done
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
    python3 -c "import pytest_asyncio" || STATUS[wheels]=1
fi

if [ -f .whlvid/videosite.tar.xz ]; then
    mkdir -p /tmp/site && tar xJf .whlvid/videosite.tar.xz -C /tmp/site
    [[ ":$PYTHONPATH:" == *":/tmp/site:"* ]] || export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

wanted build && step build 240 python3 -m aiodla.emulator.standin_build "$STANDIN_DIR"
if [ "${STATUS[build]:-1}" = 0 ] && [ -f "$STANDIN_DIR/libcudla.so.1" ]; then
    export AIODLA_STANDIN_LIB="$STANDIN_DIR/libcudla.so.1"  # tests and benchmark reuse it
fi

# pyproject's addopts carry --strict-config and pytest-timeout's `timeout` key: without
# that plugin here, drop them rather than fail on configuration.
PYTEST_ARGS=(-p no:cacheprovider -rA)
if python3 -c "import pytest_timeout" 2> /dev/null; then
    PYTEST_ARGS+=(--timeout=240)
else
    PYTEST_ARGS+=(-o "addopts=-ra --strict-markers" -W "ignore::pytest.PytestConfigWarning")
fi
if wanted pytest; then
    step pytest 330 python3 -m pytest tests/gpu "${PYTEST_ARGS[@]}" \
        --junitxml="$OUT/pytest-gpu.xml" \
        --cov=aiodla --cov-branch --cov-report=term-missing:skip-covered \
        --cov-report=xml:"$OUT/coverage.xml"
    python3 -m coverage report -m --include='aiodla/runtime/_cuda.py' 2>&1 | tee "$OUT/coverage-cuda.txt"
    python3 -m coverage report -m --include='aiodla/*' > "$OUT/coverage-all.txt" 2>&1
fi

# compute-sanitizer memcheck (leak checking), racecheck and synccheck over a plain C
# cuDLA program and over tests/gpu: fails on any report outside the deliberate trap.
if wanted sanitize && [ -n "${AIODLA_STANDIN_LIB:-}" ]; then
    # SAN_LIMIT: each sanitized command's bound (s); TOOLS (sanitize.sh) picks the tools.
    step sanitize $((${SAN_LIMIT:-270} + 60)) bash tests/gpu/sanitize/sanitize.sh \
        "$AIODLA_STANDIN_LIB" "$OUT/sanitizer" "${SAN_LIMIT:-270}"
    tar czf "$OUT/sanitizer-logs.tgz" -C "$OUT" sanitizer && rm -rf "$OUT/sanitizer"
fi

wanted bench && step bench 200 python3 benchmarks/bench_gpu.py "$OUT/bench-gpu.json"
# The GPU data path: kernels against a device-to-device copy, then the engine with
# 640x640 frames (host and device conversion, host and device inputs, 1080p camera
# frames) against the ideal, a 32x32 model's CPU per request and the loop's lag.
wanted kernels && step kernels 240 bash -c "python3 benchmarks/bench_convert_kernels.py \
    && python3 benchmarks/bench_preprocess_kernels.py"
# The detector's post-processing kernels against a D2D copy of YOLOv5s' heads (<= 0.1 ms).
wanted detect && step detect 240 python3 benchmarks/bench_detect_kernels.py \
    --json "$OUT/detect-kernels.json"
wanted datapath && step datapath 420 python3 benchmarks/bench_data_path.py \
    "$OUT/data-path-gpu.json" --gpu --repeats 3 --seconds 1.5
# A DLA fault surfacing on the stream (the stand-in's trap) and the runtime's view of it.
wanted faults && step faults 180 bash -c "python3 -m pytest tests/gpu/test_standin_faults_gpu.py \
    ${PYTEST_ARGS[*]} && python3 tests/gpu/test_standin_faults_gpu.py runtime"
# Engine(isolation="process") with the CUDA runtime in its worker: throughput at 1 ms and
# light-load latency against the in-process engine (interleaved), then recovery from 20
# DLA faults surfacing on the stream (the stand-in's trap).
wanted isolation && step isolation 420 python3 benchmarks/bench_isolation.py --runtime cuda \
    --repeats "${ROUNDS:-5}" --seconds 1.5 --faults 20 --json "$OUT/isolation-gpu.json"
# CPU per request by thread against BASE_TREE (a directory holding an older aiodla),
# interleaved, then a profile of the loop and the poller at 1 ms.
if wanted threads; then
    step threads 420 bash -c "python3 benchmarks/compare_threads.py --runtime cuda \
        --base '${BASE_TREE:-$REPO}' --new '$REPO' --rounds ${ROUNDS:-3} --seconds 1 \
        --json '$OUT/threads-compare-cuda.json' \
        && python3 benchmarks/bench_threads.py --runtime cuda --profile \
        --profile-service 1e-3 --profile-out /tmp/profile-cuda-1000us"
fi

# Camera to boxes against the small model: each one's loop thread sampled by py-spy
# (its wheel carried in .whl/), native frames included, so that the CUDA calls under the
# loop's Python show (cProfile, on 3.12, profiles every thread and inflates small calls).
# Only the load's stacks count: the requests (the benchmark's worker) and the
# completions reaching the loop, not the imports and the engine's opening.
if wanted profile; then
    SPY=/tmp/site/bin/py-spy
    step profile 150 bash -c "for case in small boxes; do $SPY record --threads --native \
        --rate 500 --format raw -o \"$OUT/spy-\$case.txt\" -- python3 \
        benchmarks/profile_loop_gpu.py --only \$case --no-cprofile --seconds 3 \
        && python3 tools/spy_threads.py \"$OUT/spy-\$case.txt\" --under worker \
        --under on_completions --under _after_batch --under _post --idle epoll_wait \
        --thread MainThread --threads 1 --top 40 > \"$OUT/spy-\$case-loop.txt\"; done"
fi
# Cameras: where the nvdec thread's CPU goes and whether PyNvVideoCodec's Decode keeps
# the GIL from other threads; sixteen 1080p30 streams through NVDEC and, beside them,
# through PyAV (which lets go of the GIL while decoding).
if wanted video; then
    step video 300 bash -c "python3 benchmarks/bench_nvdec_phases.py --repeats 2 --frames 150 \
        --seconds 2 --json '$OUT/nvdec-phases.json' \
        && python3 benchmarks/bench_video.py '$OUT/video-16-streams-nvdec.json' --gpu \
        --streams 16 --seconds 8 --decoder nvdec \
        && python3 benchmarks/bench_video.py '$OUT/video-16-streams-ffmpeg.json' --gpu \
        --streams 16 --seconds 8 --decoder ffmpeg"
fi
# PyNvVideoCodec's ThreadedDecoder (decoding on its own C++ thread): does taking its
# pictures keep the GIL from the loop less than demux + Decode in Python does, and does
# it open rtsp:// at all? (the first of the two ways out of sixteen streams' shortfall)
wanted threaded && step threaded 150 python3 benchmarks/bench_nvdec_phases.py --repeats 1 \
    --frames 150 --seconds 2 --threaded --json "$OUT/nvdec-threaded.json"
# Decoding processes (VideoSource(isolation="process")): NVDEC's pictures across CUDA
# IPC equal the ffmpeg decoder's, then sixteen 1080p30 streams: each decoder on reader
# threads and in processes of their own, and NVDEC on threads again with the task at
# 3.0 ms instead of 3.8 (room on the cores: is the shortfall the cores' or the host's?).
# RUNS="decoder-isolation-task ..." runs those only.
if wanted isolated; then
    step isolated 420 bash -c "python3 -m pytest tests/gpu/test_video_nvdec_gpu.py \
        ${PYTEST_ARGS[*]} -q; for run in \${RUNS:-nvdec-thread-3.8 nvdec-thread-3.0 \
        ffmpeg-thread-3.8 ffmpeg-process-3.8 nvdec-process-3.8}; do \
        IFS=- read decoder isolation task <<< \$run; \
        timeout 60 python3 benchmarks/bench_video.py \"$OUT/streams-\$run.json\" --gpu \
        --streams 16 --seconds 8 --decoder \$decoder --isolation \$isolation \
        --task-ms \$task | grep -E '\"(isolation|decoder|task_ms|median|loop_lag_p99_ms|host_cores)\"'; \
        done"
fi
# Where sixteen streams' frames are lost: each run reports how late the streams woke,
# a thread of its own's lateness, the collector's pauses and the loop's long callbacks
# (benchmarks/_stalls.py), with every camera's clock aligned (the worst case) and
# staggered as independent cameras run, and with the levers an application holds
# (gc.freeze, the interpreter's switch interval). STALLS="name:decoder:flags;..." overrides.
if wanted stalls; then
    step stalls 480 bash -c "IFS=';' read -ra runs <<< \"\${STALLS:-aligned:nvdec:;\
staggered:nvdec:--stagger;frozen:nvdec:--stagger --gc-freeze;\
switch1ms:nvdec:--stagger --switch-interval-ms 1;ffmpeg:ffmpeg:--stagger;\
ffmpeg-process:ffmpeg:--stagger --isolation process}\"; for run in \"\${runs[@]}\"; do \
        IFS=: read name decoder flags <<< \"\$run\"; echo \"--- \$name\"; \
        timeout 70 python3 benchmarks/bench_video.py \"$OUT/stalls-\$name.json\" --gpu \
        --streams 16 --seconds 8 --decoder \$decoder \$flags > /dev/null; python3 -c \
        \"import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in ('fps', \
        'dropped_late', 'dropped_pipeline_full', 'core_busy_fraction', 'host_cores')}); \
        [print(k, d[k]) for k in ('streams_woke', 'lock_probe_late', 'collector')]; \
        [print(' ', c) for c in d['slow_callbacks'][:6]]\" \"$OUT/stalls-\$name.json\"; done"
fi
# The pool-memory test under synccheck with the tool's host backtraces on (its default):
# it fails, on the tool's kept frames (step frames, and sanitize.sh's note on them).
if wanted poolsync; then
    SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
    step poolsync 90 "$SAN" --tool synccheck --target-processes all --print-limit 1000 \
        python3 -m pytest "${PYTEST_ARGS[@]}" \
        tests/gpu/test_data_path_gpu.py::TestOrderingAndMemory::test_pool_memory_goes_back_when_dropped
fi
# Whether a CUDA call under compute-sanitizer keeps its Python caller's caller's frame
# (and so that frame's locals) alive: frame_probe.py plain and under two tools, with and
# without host backtraces, then the pool-memory test again without them.
if wanted frames; then
    SAN="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
    step frames 200 bash -c "echo '--- plain'; python3 tests/gpu/sanitize/frame_probe.py; \
        for tool in synccheck memcheck; do for trace in yes no; do \
        echo \"--- \$tool, --show-backtrace \$trace\"; '$SAN' --tool \$tool \
        --show-backtrace \$trace python3 tests/gpu/sanitize/frame_probe.py | grep -v '^====='; \
        done; done; echo '--- poolsync, --show-backtrace no'; '$SAN' --tool synccheck \
        --show-backtrace no --target-processes all python3 -m pytest ${PYTEST_ARGS[*]} -q \
        tests/gpu/test_data_path_gpu.py::TestOrderingAndMemory::test_pool_memory_goes_back_when_dropped \
        | tail -n 5"
fi
# Sixteen 1080p30 NVDEC streams at two, four and eight slots a core, and with four
# decoded frames a source: does a deeper ring give a loop that the decoders' threads
# hold up enough room? (At 6accc63: no, 25.8 to 27.2 frames/s at every depth.)
if wanted depths; then
    step depths 240 bash -c "for spec in '2 2' '4 2' '8 2' '4 4'; do set -- \$spec; \
        timeout 55 python3 benchmarks/bench_video.py \"$OUT/streams-nvdec-spc\$1-mf\$2.json\" \
        --gpu --streams 16 --seconds 8 --decoder nvdec --streams-per-core \$1 \
        --max-frames \$2 | tail -n 30; done"
fi
# Two engines on one Cores on the CUDA runtime: utilisation, shares, the priority bound.
wanted shared && step shared 150 python3 benchmarks/bench_shared_cores.py --gpu --repeats 2 \
    --json "$OUT/shared-cores-standin.json"

echo
echo "=== summary"
for name in wheels build pytest sanitize bench kernels detect datapath faults isolation threads \
    profile video threaded isolated depths stalls poolsync frames shared; do
    [ -n "${STATUS[$name]+set}" ] && printf '%-8s exit %s\n' "$name" "${STATUS[$name]}"
done
echo "pytest:   $(grep -E '^=+ .* in [0-9.]+s' "$OUT/pytest.log" 2> /dev/null | tail -n 1)"
echo "_cuda.py: $(grep -E 'aiodla/runtime/_cuda.py' "$OUT/coverage-cuda.txt" 2> /dev/null | tail -n 1)"
echo "sanitizer: $(grep -E '^sanitizer: ' "$OUT/sanitize.log" 2> /dev/null | tail -n 1)"
grep -E 'x ideal|aiodla p50 / floor' "$OUT/bench.log" 2> /dev/null | sed 's/^/bench:  /'
grep -E '^target' "$OUT/detect.log" 2> /dev/null | sed 's/^/detect: /'
grep -E 'thread|process|recovery' "$OUT/isolation.log" 2> /dev/null | sed 's/^/isolation: /'
echo "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
# The device tool brings back only a few files: PACK=1 leaves one archive of them all.
if [ "${PACK:-0}" = 1 ]; then
    tar czf /tmp/device-out.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/device-out.tgz "$OUT/"
fi
