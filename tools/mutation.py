"""Mutation testing of aiodla's scheduler, element conversions and HTTP front (mutmut).

Each module's mutants run against the tests that cover it, no others: mutmut first runs
that selection once to learn which tests reach which function, then runs each mutant
against those tests only, stopping at the first failure. A module is mutated in its own
copy of a commit (``git archive``) under ``build/mutation/<module>/``, so a run says
which code it measured, and what it finished is kept there: running again resumes.

    pip install -e ".[test,mutation]"
    python tools/mutation.py                          # all three, HEAD
    python tools/mutation.py scheduler --ref main     # one module, another commit
    python tools/mutation.py convert --budget 1800    # stop after 30 minutes
    python tools/mutation.py http --report            # the figures of a run, no run
    python tools/mutation.py scheduler --recheck      # survivors again, on HEAD's tests
    python tools/mutation.py convert --only 'aiodla._convert.x__quantizer*'  # a subset

Prints, per module, how many mutants were killed (a test failed or timed out), survived,
and had no test reaching them, the kill ratio killed / (all - skipped - equivalent) and
the survivors by name; ``mutmut show NAME`` in the module's folder prints a mutant's
diff. The mutants named in EQUIVALENT were judged to change no behaviour (the reason
beside each) and are left out of the ratio. Runs under ``nice``; ``--children`` (default
1) mutants at a time.

``--recheck`` runs only the mutants a finished run left alive, on a new commit whose
module is unchanged (tests added since): the run before moves to ``<module>.before/``
and the figures combine both (a mutant's newer verdict wins).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SERVE_HTTP_TESTS = [
    f"tests/serve/test_serve_{name}.py"
    for name in (
        "budget",
        "errors",
        "json",
        "limits",
        "protocol",
        "values",
        "http_answers",
        "http_requests",
        "http_refusals",
        "http_front",
        "tls",
        "shutdown",
    )
]
TRACE_TESTS = [
    "tests/test_trace.py",
    "tests/test_trace_plot.py",
    "tests/test_bench_trace.py",
    "tests/video/test_video_trace.py",
    "tests/test_trace_edges.py",
]
MODULES: dict[str, tuple[str, list[str]]] = {
    "scheduler": (
        "aiodla/_scheduler.py",
        [
            "tests/test_scheduler.py",
            "tests/test_cancellation.py",
            "tests/test_reliability.py",
            "tests/test_accounting.py",
            "tests/test_fault_policy.py",
            "tests/test_offload_steps.py",
            "tests/test_core_choice.py",
        ],
    ),
    "convert": (
        "aiodla/_convert.py",
        [
            "tests/test_convert.py",
            "tests/test_layout.py",
            "tests/test_tensors.py",
            "tests/test_convert_threads.py",
            "tests/test_convert_edges.py",
        ],
    ),
    "http": ("aiodla/serve/_http.py", SERVE_HTTP_TESTS),
    # Issue 44's: the detector's definition, its step on the slot's stream, frame buffers.
    "detect_math": ("aiodla/_detect_math.py", ["tests/test_detect.py"]),
    "postprocess_stream": (
        "aiodla/_postprocess_stream.py",
        ["tests/test_postprocess_stream.py", "tests/test_detect_engine.py"],
    ),
    "frame_buffers": (
        "aiodla/_frame_buffers.py",
        ["tests/test_frame_buffers.py", "tests/test_detect_engine.py"],
    ),
    # Issue 44's too: the blocking API, the trace (its recorder and its events), batching.
    "blocking": (
        "aiodla/_blocking.py",
        ["tests/test_blocking.py", "tests/test_blocking_edges.py"],
    ),
    "trace": ("aiodla/_trace.py", TRACE_TESTS),
    "trace_events": ("aiodla/_trace_events.py", TRACE_TESTS),
    "batching": (
        "aiodla/_batching.py",
        ["tests/test_batching.py", "tests/test_batching_edges.py"],
    ),
    # Issue 44's as well: the steps done off the loop, the numpy post-processing step.
    "offload": (
        "aiodla/_offload.py",
        [
            "tests/test_offload_steps.py",
            "tests/test_offload_failures.py",
            "tests/test_offload_choice.py",
            "tests/test_cancellation.py",
            "tests/test_mutant_survivors.py",
        ],
    ),
    "postprocess": (
        "aiodla/_postprocess.py",
        [
            "tests/test_detect_engine.py",
            "tests/test_postprocess_once.py",
            "tests/test_offload_choice.py",
            "tests/test_postprocess_matching.py",
        ],
    ),
    # Issue 44's last: the shared cores' modules, as "One owner for each DLA core" made them.
    **{
        name: (
            f"aiodla/_{name}.py",
            [
                "tests/test_estimates.py",
                "tests/test_dispatch.py",
                "tests/test_shared_poller.py",
                "tests/test_scheduler.py",
                "tests/test_shared_cores.py",
                "tests/test_core_choice.py",
                "tests/test_statistics.py",
                "tests/test_accounting.py",
                "tests/test_core_record.py",
            ],
        )
        for name in ("core_record",)
    },
    # The dispatcher: every engine's flow asks it, so these are the tests of its rule
    # (depth, priority, weight, the core), its pairing of slots and its fault policy.
    "dispatch": (
        "aiodla/_dispatch.py",
        [
            "tests/test_dispatch.py",
            "tests/test_shared_cores.py",
            "tests/test_shared_cores_refusals.py",
            "tests/test_cores_lifetime.py",
            "tests/test_core_choice.py",
            "tests/test_scheduler.py",
            "tests/test_estimates.py",
            "tests/test_shared_poller.py",
            "tests/test_fault_policy.py",
            "tests/test_reliability.py",
            "tests/test_cancellation.py",
        ],
    ),
    "shared_cores": (
        "aiodla/_shared_cores.py",
        [
            "tests/test_shared_cores.py",
            "tests/test_shared_cores_refusals.py",
            "tests/test_cores_lifetime.py",
            "tests/test_shared_poller.py",
            "tests/test_dispatch.py",
            "tests/test_core_choice.py",
            "tests/test_trace.py",
            "tests/test_trace_edges.py",
            "tests/test_reliability.py",
            "tests/test_fault_policy.py",
        ],
    ),
    # Not one of the three above (issue 34's list): where the HTTP byte budget went.
    "budget": (
        "aiodla/serve/_budget.py",
        [f"tests/serve/test_serve_{name}.py" for name in ("budget", "uploads", "limits")],
    ),
}

# Mutants judged to change no behaviour any caller can see, each with why.
_SCRATCH_NAME = "a scratch buffer's name: any name no other buffer of the call uses is the same"
_CAST = "the casting keyword dropped: numpy's default (same_kind) allows this cast"
_SMALL = "where numpy's cast takes over, one element later: the kernels equal numpy bit for bit"
_CONSTANT = "the constant's cache key or lookup: it is made again, or kept apart, same value"
_SLOWER = "a faster path never taken: the binary64 or numpy path gives the same bits"
_VIEW_AGAIN = "the view's cache missed: the view is made again, of the same buffer"
_ZIP = "one value per output, one flag per output asked: zip's strictness never acts"
_WHERE_PARSED = "only whether the JSON is parsed on the loop or in a worker thread"
_WHERE_WRITTEN = "only whether the answer's JSON is written on the loop or in a worker thread"
_F32 = "the dtype named is the one the float32 arithmetic gives anyway"
_LOWER_BOUND = (
    "a lower prefilter bound (or none): more cells reach the exact test of step 3, which "
    "drops them; the same candidates, only slower"
)
_NEGATIVE_DIMENSION = "numpy (2.4) reads any negative dimension of a reshape as the one to infer"
_EQUIVALENT_BY_MODULE = {
    "aiodla._frame_buffers.": {
        **{
            f"x__bounds__mutmut_{n}": "an array has as many strides as dimensions: zip's "
            "strictness never acts"
            for n in (10, 13, 14)
        },
        "xǁFrameBuffersǁclose__mutmut_7": "numpy sets a flag to the truth of the value: None "
        "is False",
        "xǁ_Memoryǁ__init____mutmut_1": "nothing reads _Memory.buffer: the buffer list, then "
        "the finalizer, hold the buffer",
        **{
            f"xǁ_Memoryǁ__init____mutmut_{n}": "numpy (2.4) reads an array interface without "
            "looking at its version"
            for n in (12, 13, 14)
        },
        "xǁ_Stateǁ__init____mutmut_1": "closed is only tested for its truth: None is as False",
        **{
            f"x__bounds__mutmut_{n}": "a reach is a whole number of bytes: one of 0 moves "
            "neither end"
            for n in (23, 24)
        },
        "xǁHostMemoryǁhost_alloc__mutmut_1": "a Protocol's default: the runtimes' own apply",
    },
    "aiodla._detect_math.": {
        "x__best_class__mutmut_23": "take_along_axis's axis defaults to the last: 1 here",
        "x__corners__mutmut_4": _F32,
        **{f"x__distances__mutmut_{n}": _F32 for n in (38, 40)},
        **{f"x_exp32__mutmut_{n}": _F32 for n in (45, 47)},
        **{f"x_sigmoid32__mutmut_{n}": _F32 for n in (2, 4)},
        **{f"x_decode_cells__mutmut_{n}": _F32 for n in (145, 147, 170, 172)},
        **{f"x_frame_boxes__mutmut_{n}": _F32 for n in (3, 5)},
        **{
            f"x_sigmoid32__mutmut_{n}": (
                "exp32 rounds its argument to float32, and negation is exact: rounding "
                "-x equals negating the rounded x"
            )
            for n in (10, 12)
        },
        "x_exp32__mutmut_20": "n only scales a NaN: NaN either way",
        **{f"x__prefilter__mutmut_{n}": _LOWER_BOUND for n in (2, 8, 9, 10)},
        **{
            f"x_above__mutmut_{n}": "numpy shifts an int16 right by 16 to its sign, as by 15"
            for n in (33, 47)
        },
        **{
            f"x_above__mutmut_{n}": "the bound is a float16 scalar: the array is float16 anyway"
            for n in (39, 41)
        },
        "x_decode_cells__mutmut_71": "exp32 of one more column, which nothing reads",
        "x_decode_cells__mutmut_103": _NEGATIVE_DIMENSION,
        **{f"x_gather__mutmut_{n}": _NEGATIVE_DIMENSION for n in (11, 19)},
        "x_gather__mutmut_61": "ufunc.reduce's axis defaults to 0",
        "x_gather__mutmut_73": (
            "a best class value equal to conf passes the gather and fails step 3's strict "
            "test: the same candidates"
        ),
        **{
            f"x_merge__mutmut_{n}": "every Cells has the same fields: zip's strictness never acts"
            for n in (9, 11, 12)
        },
        "x_select__mutmut_129": (
            "the mask rebuilt at every kept box instead of every 256 rows: the same flags, slower"
        ),
        "x_select__mutmut_152": "with one candidate left, argmin over its one flag is 0 anyway",
        "x_select__mutmut_154": "with no candidate left the loop ends before step is read",
        **{
            f"x_select__mutmut_{n}": "order is numpy's intp: int64 on every 64-bit platform"
            for n in (168, 170)
        },
        "x_select__mutmut_32": "the arrays are n long: a slice to n is a slice to the end",
        **{
            f"x_select__mutmut_{n}": (
                "no finite division by zero: a union of 0 comes only with an intersection "
                "of 0 (0/0: invalid, still ignored)"
            )
            for n in (36, 39)
        },
        "x_select__mutmut_96": "a kept box's flag on itself: the greedy pass never looks back",
    },
    "aiodla._scheduler.": {
        "xǁRequestǁ__init____mutmut_4": "Engine._admit sets device_output on its one Request",
        "xǁRequestǁ__init____mutmut_6": "Engine._admit sets sources on its one Request",
        "xǁRequestǁ__init____mutmut_11": "outcome is read only once finish() set it",
        "xǁRequestǁ__init____mutmut_12": "reason is read only once finish() set it",
        "xǁSchedulerǁfinish__mutmut_3": "unreachable: no caller finishes a request that is DONE",
        "xǁSchedulerǁfinish__mutmut_14": "nothing reads a DONE request's arrays",
        "xǁSchedulerǁrecount_as_cancelled__mutmut_2": (
            "for CANCELLED, minus one plus one is no change; None is unreachable (DONE only)"
        ),
    },
    "aiodla._convert.": {
        **{f"xǁ_Scratchǁconstant__mutmut_{n}": _CONSTANT for n in (3, 4, 5, 6, 9)},
        "x__cast__mutmut_6": "_cast is chosen only for casts same_kind allows",
        "x__rounded_to_half_spacing__mutmut_29": _SCRATCH_NAME,
        **{f"x__half_from_float32__mutmut_{n}": _SCRATCH_NAME for n in (13, 19, 20)},
        **{f"x__half_from_float64__mutmut_{n}": _SCRATCH_NAME for n in (14, 20, 21, 41, 47, 48)},
        **{f"x__half_from_integers__mutmut_{n}": _SCRATCH_NAME for n in (11, 17, 18)},
        **{f"x__float32_from_half__mutmut_{n}": _SCRATCH_NAME for n in (12, 18, 19, 30, 36, 37)},
        **{f"x__half_from_float64__mutmut_{n}": _CAST for n in (7, 37, 54, 90, 100)},
        **{f"x__half_from_integers__mutmut_{n}": _CAST for n in (7, 24)},
        **{f"x__float32_from_half__mutmut_{n}": _CAST for n in (7, 25, 52)},
        "x__half_from_float32__mutmut_7": _CAST,
        **{f"x__{f}__mutmut_1": _SMALL for f in ("half_from_float32", "half_from_float64")},
        **{f"x__{f}__mutmut_1": _SMALL for f in ("half_from_integers", "float32_from_half")},
        "x__half_from_float64__mutmut_22": _SLOWER,
        "x__is_power_of_two__mutmut_2": _SLOWER,
        "x__is_power_of_two__mutmut_4": _SLOWER,
        **{f"x__half_from_float32__mutmut_{n}": _CAST for n in (36, 76)},
        "xǁ_Scratchǁ_make__mutmut_7": (
            "a buffer of just the size is made again: scratch is written before it is "
            "read, a constant's is filled again"
        ),
        **{
            f"xǁ_Scratchǁ_make__mutmut_{n}": (
                "the cache of views starts again one view sooner or later: " + _VIEW_AGAIN
            )
            for n in (23, 24)
        },
        "xǁ_Scratchǁ_make__mutmut_27": _VIEW_AGAIN,
        **{f"xǁ_Scratchǁarray__mutmut_{n}": _VIEW_AGAIN for n in (1, 2, 3)},
    },
    "aiodla.serve._http.": {
        "x__http_error__mutmut_6": "aiohttp's HTTPException carries no Content-Length",
        "x__http_error__mutmut_7": "aiohttp's HTTPException carries no Content-Length",
        **{
            f"x__http_error__mutmut_{n}": (
                "unreachable: only the router raises an HTTPException (404, 405: above)"
            )
            for n in (12, 13, 14, 15)
        },
        **{f"xǁHttpFrontǁmetrics__mutmut_{n}": "header names are case-insensitive" for n in (7, 8)},
        **{
            f"x__answer__mutmut_{n}": "one value per output asked: zip's strictness never acts"
            for n in (19, 22, 23)
        },
        **{f"x__dumps__mutmut_{n}": "whitespace between JSON tokens only" for n in (2, 4)},
        **{f"x__outputs__mutmut_{n}": _ZIP for n in (71, 74, 75)},
        **{f"xǁHttpFrontǁ_infer__mutmut_{n}": _ZIP for n in (42, 45, 46)},
        "x__json_length__mutmut_1": _WHERE_PARSED,
        **{f"xǁHttpFrontǁ_infer__mutmut_{n}": _WHERE_PARSED for n in (4, 7)},
        **{f"xǁHttpFrontǁ_infer__mutmut_{n}": _WHERE_WRITTEN for n in (49, 50)},
        **{
            f"xǁHttpFrontǁ_infer__mutmut_{n}": "media types are case-insensitive (RFC 9110)"
            for n in (77, 87)
        },
        **{
            f"xǁHttpFrontǁ_infer__mutmut_{n}": (
                "aiohttp's content type for a bytes body is application/octet-stream anyway"
            )
            for n in (79, 82)
        },
        "x__timeout__mutmut_15": "a timeout one part in a million longer: no client can tell",
        "x__inputs__mutmut_65": "an integer array's values are finite: the check passes them",
        **{
            f"x_max_depth__mutmut_{n}": (
                "a model without inputs: every emulator op needs one, a DLA network has one"
            )
            for n in (3, 5, 6)
        },
        "x__split__mutmut_7": "any negative cut is outside the body",
        **{
            f"xǁHttpFrontǁ_receive__mutmut_{n}": "the client is gone: no one reads the message"
            for n in (35, 38, 39)
        },
        "xǁHttpFrontǁ_read__mutmut_9": "sys.version_info (3, 11, x, ...) > (3, 11) as well",
        "xǁHttpFrontǁstop_listening__mutmut_2": (
            "stop_listening runs once (the one stopping task of Server.stop)"
        ),
        **{
            f"xǁHttpFrontǁ_read__mutmut_{n}": (
                "uncancel() skipped: only a timeout or task group opened later in the task "
                "reads cancelling(); the handler answers at once and aiohttp writes the "
                "answer with neither, in a task of this request alone"
            )
            for n in (10, 11)
        },
        **{
            f"xǁHttpFrontǁ__init____mutmut_{n}": (
                "auto_describe only has register() collect once to look for names taken "
                "twice: the two collectors' families never overlap"
            )
            for n in (3, 4)
        },
        "xǁHttpFrontǁ__init____mutmut_17": "EngineCollector's naming is aiodla by default",
        **{
            f"xǁHttpFrontǁ__init____mutmut_{n}": (
                "client_max_size bounds request.read() only: the front reads bodies by "
                "the chunk under its own limit (413)"
            )
            for n in (25, 27)
        },
        **{
            f"xǁHttpFrontǁ__init____mutmut_{n}": "port is read only once start() has set it"
            for n in (91, 92)
        },
    },
}
_FALSY = "the flag is only tested for truth: None and False read alike"
_SAME_AT_EQUALITY = "where the two are equal, either branch gives the same value"
_EXTRA_WAKE = (
    "one more wake-up of the loop per request, which finds the inbox taken already: "
    "the same requests reach the loop in the same order"
)
_ALWAYS_THERE = "every engine's Request has arrays and sources (slots set in its __init__)"
_COMPACT = "the JSON's whitespace only: the same document, parsed"
_SAME_CODEC = "'UTF-8' and 'utf-8' name the same codec"
_SAME_FLOAT = "float() reads '-INF' as '-inf'"
_SAME_LENGTHS = "one recorder per engine, made from the same list: zip's strictness never acts"
_EQUIVALENT_BY_MODULE.update(
    {
        "aiodla._blocking.": {
            "xǁBlockingEngineǁ__init____mutmut_11": _FALSY,
            "xǁBlockingEngineǁ_take_inbox__mutmut_2": _FALSY,
            "xǁBlockingEngineǁ_start__mutmut_9": _EXTRA_WAKE,
            "xǁBlockingEngineǁ_start__mutmut_10": _EXTRA_WAKE,
        },
        "aiodla._trace.": {
            **{f"xǁTraceRecorderǁ_note_frame__mutmut_{n}": _ALWAYS_THERE for n in (3, 6, 11, 14)},
            **{f"xǁTraceRecorderǁwrite__mutmut_{n}": _COMPACT for n in (3, 5)},
            "xǁTraceRecorderǁwrite__mutmut_14": _SAME_CODEC,
            "xǁCoresTracingǁ__init____mutmut_11": "the clock left out is time.monotonic anyway",
            **{f"xǁCoresTracingǁ__aenter____mutmut_{n}": _SAME_LENGTHS for n in (4, 7, 8)},
            **{f"xǁCoresTracingǁ__aexit____mutmut_{n}": _SAME_LENGTHS for n in (3, 6, 7)},
            "x_active_recorder__mutmut_6": "every Engine has _flow (None until it opens)",
            **{
                f"x_trace_name__mutmut_{n}": (
                    "unreachable: a model path with an empty stem ('/', '.') is no file "
                    "an engine opens, and the trace is named at its open"
                )
                for n in (3, 4)
            },
        },
        "aiodla._trace_events.": {
            **{
                f"x_core_tid__mutmut_{n}": (
                    "another numbering of the core tracks that keeps them apart and in "
                    "order, above the video tracks"
                )
                for n in (2, 4)
            },
            **{f"xǁCoresTraceǁwrite__mutmut_{n}": _COMPACT for n in (3, 5)},
            "xǁEventWriterǁ__init____mutmut_12": "parts() sets the tracks before any use",
            "xǁEventWriterǁparts__mutmut_39": (
                "a process_name event's tid: the format reads only its pid"
            ),
            "xǁCoresTraceǁwrite__mutmut_14": _SAME_CODEC,
            **{
                f"xǁCoresTraceǁtrace_events__mutmut_{n}": (
                    "the time zero of a trace with no engine: no event uses it"
                )
                for n in (3, 6)
            },
            "xǁEventWriterǁ_tasks__mutmut_3": (
                "a record's core and stream are set together (by assigned) or neither: "
                "'or' and 'and' read them alike"
            ),
            "xǁEventWriterǁ_tasks__mutmut_23": _SAME_FLOAT,
            "xǁEventWriterǁ_untangle__mutmut_21": _SAME_FLOAT,
            "xǁEventWriterǁ_untangle__mutmut_38": (
                "ts and dur are whole nanoseconds (3 decimals of a microsecond): their sum "
                "rounded to 4 decimals is the same whole nanosecond"
            ),
            "x_stream_tid__mutmut_4": (
                "another numbering of a core's stream tracks that keeps them apart, in "
                "order and below their core's"
            ),
            "xǁEventWriterǁslice__mutmut_33": (
                "us() rounds both ends to whole nanoseconds: their difference rounded to 4 "
                "decimals is the same whole nanosecond"
            ),
        },
        "aiodla._postprocess.": {
            **{
                f"xǁPostprocessǁframe_of__mutmut_{n}": (
                    "the name is read only by _frame_size's refusal, and the request's frame "
                    "passed that same check, under its input's name, when it was admitted"
                )
                for n in (6, 10, 11)
            },
        },
        "aiodla._batching.": {
            "xǁItemǁ__init____mutmut_8": (
                "an item's batch is read only once it runs, and _send gives it its batch then"
            ),
            "xǁBatchǁ__init____mutmut_3": "_send sets the batch's task as soon as it makes it",
            "xǁBatcherǁend__mutmut_4": (
                "an ended item's arrays are never read again: () and None let them go alike"
            ),
            "x_open_batcher__mutmut_24": "the batcher keeps the outputs but never reads them",
            "xǁBatcherǁ_dispatch__mutmut_9": _FALSY,
            **{f"xǁBatcherǁ__init____mutmut_{n}": _FALSY for n in (32, 38)},
            "xǁBatcherǁ__init____mutmut_6": "the batcher keeps the outputs but never reads them",
            **{
                f"xǁBatcherǁ__init____mutmut_{n}": (
                    "an item's spec serves check_array alone, which reads neither strides "
                    "nor nbytes"
                )
                for n in (13, 14)
            },
            **{
                f"xǁBatcherǁitem__mutmut_{n}": (
                    "inputs_in_order gives one value per item spec: zip's strictness never acts"
                )
                for n in (37, 40, 41)
            },
            "xǁBatcherǁadmit__mutmut_1": "its one caller, Engine._admit, always passes wait",
            "xǁBatcherǁ_send__mutmut_16": _FALSY,
            "xǁBatcherǁ_send__mutmut_35": (
                "RUNNING is only ever told apart from WAITING and DONE: None is neither too"
            ),
            **{
                f"xǁBatcherǁ_assemble__mutmut_{n}": (
                    "one array per input, made from the same list: zip's strictness never acts"
                )
                for n in (23, 26, 27)
            },
        },
        "aiodla._shared_cores.": {
            "xǁCoresǁ__init____mutmut_12": _FALSY,
            **{
                f"xǁCoresǁ__init____mutmut_{n}": (
                    "_owns_runtime is read only beside a runtime chosen here, and "
                    "runtime_for sets both together"
                )
                for n in (15, 16)
            },
            **{
                f"xǁCoresǁ__init____mutmut_{n}": (
                    "open() sets it before the state is OPEN, and only an open Cores reads it"
                )
                for n in (17, 18)
            },
        },
        "aiodla._dispatch.": {
            "xǁDispatcherǁtask_ended__mutmut_4": (
                "a success's answer: the flow reads task_ended's answer only for a failed "
                "task (_task_failed) and drops a success's"
            ),
            "xǁDispatcherǁlost_slot__mutmut_2": (
                "fail_submission finishes the request at once, and nothing reads a DONE "
                "request's slot (give_back follows only steps that end before a submission)"
            ),
            "xǁDispatcherǁ_start_probes__mutmut_3": (
                "a probe due exactly now (a float of the clock read equal to it) starts on "
                "a timer of 0 s, one loop turn later, instead of now"
            ),
            "xǁDispatcherǁ_assign_at__mutmut_1": (
                "a timer due when the pending one is: it replaces that one, the same "
                "assignment at the same time"
            ),
            "xǁDispatcherǁ_reopened__mutmut_5": 'float("INF") equals float("inf")',
            "xǁFairSharesǁstart_tag__mutmut_6": (
                "before a priority's first grant every start tag is 1 unit instead of 0: "
                "all its tags move by one unit together, the order is the same"
            ),
            "xǁFairSharesǁstart_tag__mutmut_10": _SAME_AT_EQUALITY,
            "xǁDispatcherǁ_best_core__mutmut_26": _SAME_AT_EQUALITY,
            "xǁDispatcherǁ_has_room__mutmut_12": _SAME_AT_EQUALITY,
            **{
                f"xǁDispatcherǁ_grant__mutmut_{n}": (
                    "the shortcut lets a core just at its depth through to _has_room, which "
                    "refuses it there: the same grants, one look more"
                )
                for n in (5, 6)
            },
            "xǁDispatcherǁ_grant__mutmut_15": "sorting a list of one client leaves it as it is",
            "xǁDispatcherǁjoin__mutmut_1": (
                "its one caller, the flow, always passes the engine's probe_interval"
            ),
            **{f"xǁDispatcherǁassign__mutmut_{n}": _FALSY for n in (33, 36)},
            **{
                f"xǁDispatcherǁassign__mutmut_{n}": (
                    "an assignment asked from within a grant (flow.start) is followed anyway "
                    "by another _grant of the running loop, since that grant returns True: "
                    "the extra round _again asks for finds nothing more"
                )
                for n in (28, 29)
            },
            "xǁFairSharesǁjoined__mutmut_3": (
                "a joining client's finish tag of 0: start_tag takes the priority's clock "
                "over any tag behind it (the clock never goes back), so it starts there anyway"
            ),
            "xǁFairSharesǁjoined__mutmut_7": (
                "a client joining before its priority's first grant starts at 1 unit, not "
                "0: all its tags move by one unit together, the order is the same"
            ),
            **{f"xǁDispatcherǁ__init____mutmut_{n}": _FALSY for n in (6, 8)},
            "xǁDispatcherǁ__init____mutmut_9": "assign sets _again to False before it reads it",
            "xǁDispatcherǁ__init____mutmut_14": 'float("INF") equals float("inf")',
            **{
                f"xǁDispatcherǁ__init____mutmut_{n}": (
                    "_rank sets it at the first join, before anything reads it (every "
                    "assignment comes from an engine that joined)"
                )
                for n in (15, 17, 19, 21, 22, 23, 25, 27)
            },
            **{
                f"xǁDispatcherǁ_rank__mutmut_{n}": (
                    "the default is a core no engine uses: _top is read only for a core of "
                    "the engine asking (_has_room) or of engines on it (_room)"
                )
                for n in (10, 14)
            },
            "xǁDispatcherǁ_has_room__mutmut_13": (
                "work left exactly the lead (a float of the clock read to match it): the "
                "task starts on a timer of 0 s, one loop turn later, instead of now"
            ),
        },
        "aiodla._core_record.": {
            "x_expect__mutmut_4": "behind is only tested for truth until the poller sets it",
            "x_expect__mutmut_11": "free equal to now: free + service_time is now + service_time",
            **{
                f"x_forget__mutmut_{n}": (
                    "1.0 as 0.0: a time before any submission on the loop's clock, which "
                    "every later time passes"
                )
                for n in (2, 4)
            },
        },
        "aiodla._offload.": {
            "xǁStepperǁfinish__mutmut_1": "a Protocol's default: the flow's own finish applies",
        },
    }
)
EQUIVALENT: dict[str, str] = {
    module + name: why
    for module, names in _EQUIVALENT_BY_MODULE.items()
    for name, why in names.items()
}

KILLED = ("killed", "timeout", "segfault")
# Not run to the end: left out of every figure.
UNCHECKED = ("not checked", "check was interrupted by user", "skipped")


def prepare(name: str, ref: str, work: Path) -> str:
    """The module's folder holds ``ref``'s tree and mutmut's settings; returns the commit."""
    commit = subprocess.run(
        ["git", "rev-parse", ref], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    stamp = work / "COMMIT"
    if stamp.exists() and stamp.read_text().strip() == commit:
        return commit  # resume: mutmut keeps each mutant's result under mutants/
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(work)], input=archive.stdout, check=True)
    module, tests = MODULES[name]
    # setup.cfg, not pyproject.toml: each module its own selection, in its own copy.
    lines = [
        "[mutmut]",
        "source_paths = aiodla/",
        f"only_mutate = {module}",
        "pytest_add_cli_args_test_selection =",
        *(f"    {test}" for test in tests),
        "pytest_add_cli_args =",
        "    -p",
        "    no:cacheprovider",
        "    -x",
        "    -q",
        # The examples and benchmarks some tests run (mutmut copies only the sources and the tests).
        "also_copy =",
        "    examples/",
        "    benchmarks/",
        # gRPC (imported by the serve tests) is not safe to fork once it has run.
        "process_isolation = forkserver",
    ]
    (work / "setup.cfg").write_text("\n".join(lines) + "\n")
    stamp.write_text(commit + "\n")
    return commit


NICE = 15  # the machine is shared: mutants wait for everyone else


def run(work: Path, children: int, budget: float | None, names: list[str] | None = None) -> bool:
    """mutmut over the module (``names`` only, when given); False when the budget
    stopped it first."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the mutated copy wins
    command = ["nice", "-n", str(NICE), sys.executable, "-m", "mutmut", "run"]
    command += ["--max-children", str(children), *(names or [])]
    with open(work / "mutmut.log", "ab") as log:
        process = subprocess.Popen(
            command, cwd=work, env=env, stdout=log, stderr=log, start_new_session=True
        )
        try:
            process.wait(budget)
            return True
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            return False


def results(work: Path) -> dict[str, str]:
    """Each mutant's status as mutmut recorded it ("not checked" for those not run)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    listing = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        cwd=work,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found = {}
    for line in listing.splitlines():
        mutant, sep, status = line.strip().rpartition(": ")
        if sep and mutant.startswith("aiodla."):
            found[mutant] = status
    return found


def recheck(name: str, ref: str, work: Path, children: int, budget: float | None) -> bool:
    """Run again, on ``ref``, the mutants the finished run in ``work`` left alive."""
    before = work.with_name(name + ".before")
    old = (work / "COMMIT").read_text().strip()
    changed = subprocess.run(
        ["git", "diff", "--quiet", old, ref, "--", MODULES[name][0]], cwd=ROOT, check=False
    )
    if changed.returncode != 0:
        raise SystemExit(f"{MODULES[name][0]} changed since {old[:12]}: run it whole")
    alive = [m for m, s in results(work).items() if s not in (*KILLED, *UNCHECKED)]
    if before.exists():
        shutil.rmtree(before)
    work.rename(before)
    prepare(name, ref, work)
    return run(work, children, budget, alive) if alive else True


def combined(work: Path) -> dict[str, str]:
    """The statuses of the run in ``work``, over those of the run it rechecked."""
    statuses = results(work)
    before = work.with_name(work.name + ".before")
    if before.exists():
        old = results(before)
        for mutant, status in statuses.items():
            if status in UNCHECKED and mutant in old:
                statuses[mutant] = old[mutant]
    return statuses


def overlaid(work: Path, later: list[Path]) -> dict[str, str]:
    """The statuses of the run in ``work``; each run in ``later`` (of the same module,
    on a commit whose module is unchanged, a subset of mutants) overrides those it ran."""
    statuses = combined(work)
    for other in later:
        for mutant, status in results(other).items():
            if status not in UNCHECKED:
                statuses[mutant] = status
    return statuses


def report(
    name: str, work: Path, commit: str, finished: bool, later: list[Path] | None = None
) -> dict[str, object]:
    statuses = overlaid(work, later or [])
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    killed = sum(counts.get(s, 0) for s in KILLED)
    equivalent = sorted(
        m for m, s in statuses.items() if m in EQUIVALENT and s not in (*KILLED, *UNCHECKED)
    )
    checked = sum(n for s, n in counts.items() if s not in UNCHECKED)
    ratio = killed / max(1, checked - len(equivalent))
    left = sorted(
        m for m, s in statuses.items() if s not in (*KILLED, *UNCHECKED) and m not in EQUIVALENT
    )
    print(f"== {name}: {MODULES[name][0]} at {commit}{'' if finished else ' (stopped)'}")
    print("   " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    print(
        f"   kill ratio {ratio:.1%} = {killed} killed / ({checked} checked - "
        f"{len(equivalent)} equivalent)"
    )
    for mutant in equivalent:
        print(f"   equivalent {mutant}: {EQUIVALENT[mutant]}")
    for mutant in left:
        print(f"   {statuses[mutant]}: {mutant}")
    return {
        "module": MODULES[name][0],
        "commit": commit,
        "finished": finished,
        "counts": counts,
        "kill_ratio": ratio,
        "equivalent": equivalent,
        "left": {m: statuses[m] for m in left},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help=f"of {', '.join(MODULES)} (default all)")
    parser.add_argument("--ref", default="HEAD", help="the commit to mutate (default HEAD)")
    parser.add_argument("--children", type=int, default=1, help="mutants at a time")
    parser.add_argument("--budget", type=float, help="seconds for each module at most")
    parser.add_argument("--report", action="store_true", help="print a past run's figures")
    parser.add_argument(
        "--recheck", action="store_true", help="run a finished run's survivors again on --ref"
    )
    parser.add_argument(
        "--only",
        action="append",
        help="mutants matching this pattern only (fnmatch, repeatable); the rest stay as they were",
    )
    parser.add_argument(
        "--also",
        type=Path,
        action="append",
        default=[],
        help="with --report: a later run's folder (--workdir of a subset run) whose "
        "verdicts override; repeatable, in order",
    )
    parser.add_argument("--workdir", type=Path, default=ROOT / "build" / "mutation")
    args = parser.parse_args()
    unknown = [name for name in args.modules if name not in MODULES]
    if unknown:
        parser.error(f"unknown module(s) {unknown}: choose from {list(MODULES)}")
    summary = []
    for name in args.modules or ["scheduler", "convert", "http"]:
        work = args.workdir / name
        if args.report:
            commit = (work / "COMMIT").read_text().strip()
            finished = True
        else:
            started = time.monotonic()
            if args.recheck:
                finished = recheck(name, args.ref, work, args.children, args.budget)
                commit = (work / "COMMIT").read_text().strip()
            else:
                commit = prepare(name, args.ref, work)
                finished = run(work, args.children, args.budget, args.only)
            print(f"-- {name}: {time.monotonic() - started:.0f} s")
        later = [folder / name for folder in args.also]
        commit = commit[:12]
        for folder in later:
            commit += " + " + (folder / "COMMIT").read_text().strip()[:12]
        summary.append(report(name, work, commit, finished, later))
    (args.workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
