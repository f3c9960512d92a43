"""``aiodla verify``'s report as Markdown (``--report``) and as summary lines."""

from __future__ import annotations

from typing import Any

__all__ = ["THROUGHPUT_NOTE", "report_markdown", "summary_lines"]

#: What the throughput ratio means, printed under it.
THROUGHPUT_NOTE = (
    "(cores / median latency: the rate of each core serving one request at a time; above "
    "1 x, the engine overlaps each request's copies and conversion with the DLA's work on "
    "the one before; well below 1 x, the host, not the DLA, is the limit)"
)


def _tensors(entries: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"`{e['name']}` {'x'.join(map(str, e['shape']))} {e['dtype']} {e['format']}"
        + (f" scale {e['scale']:g}" if e.get("scale") else "")
        + (" (generated)" if e.get("source") == "generated" else "")
        for e in entries
    )


def summary_lines(document: dict[str, Any]) -> list[str]:
    """One line per finding, the verdict last."""
    lines = [
        f"model      {document['model']} ({document['precision'].upper()}, "
        f"{document['runtime']} runtime)"
    ]
    lines.append(f"inputs     {_tensors(document['inputs'])}; {document['samples']} sample(s)")
    agree = document["cores_agree"]
    cores = ", ".join(map(str, document["cores"]))
    if agree["identical"]:
        lines.append(f"cores      {cores}: identical bytes on every output")
    else:
        shown = "; ".join(
            f"core {d['core']} sample {d['sample']} output {d['output']!r} max abs "
            f"{d['max_abs']:.3g}"
            for d in agree["differences"][:3]
        )
        lines.append(f"cores      {cores} DIFFER from core {agree['against']}: {shown}")
    for entry in document.get("comparison", []):
        verdict = "pass" if entry["pass"] else "FAIL: " + "; ".join(entry["failures"])
        top1 = "" if entry["top1"] is None else f", top-1 {entry['top1']:.3f}"
        lines.append(
            f"vs onnx    {entry['output']!r}: max abs {entry['max_abs']:.3g}, max rel "
            f"{entry['max_rel']:.3g}, cosine {entry['cosine']:.6f}{top1}: {verdict}"
        )
    found = document.get("detections")
    if found is not None:
        for core, entry in found["cores"].items():
            verdict = "pass" if entry["pass"] else f"FAIL (under {found['min_matched']:.0%})"
            iou = "" if entry["mean_iou"] is None else (
                f", IoU mean {entry['mean_iou']:.3f} min {entry['min_iou']:.3f}, score "
                f"difference max {entry['max_score_difference']:.2g}"
            )  # fmt: skip
            lines.append(
                f"vs export  core {core}: {entry['matched']} of {entry['reference']} "
                f"{found['family']} detections matched ({entry['found']} found){iou}: {verdict}"
            )
    for core, figures in document["latency"].items():
        lines.append(
            f"latency    core {core}: median {figures['median_ms']:.3f} ms, p99 "
            f"{figures['p99_ms']:.3f} ms ({figures['requests']} requests, one at a time)"
        )
    rate = document["throughput"]
    lines.append(
        f"throughput {rate['requests_per_second']:.0f} req/s on {len(document['cores'])} "
        f"core(s) = {rate['ratio']:.2f} x cores / median latency ({rate['ideal']:.0f}); "
        f"{rate['requests']} requests, {rate['concurrency']} at a time"
    )
    lines.append(f"{'':<11}{THROUGHPUT_NOTE}")
    versions = ", ".join(f"{k} {v}" for k, v in document["versions"].items() if v)
    lines.append(f"versions   {versions}")
    lines.append(f"verdict    {document['verdict'].upper()}")
    return lines


def report_markdown(document: dict[str, Any]) -> str:
    """The report to attach to a bug: every figure, the tolerances, the versions."""
    out = [f"# aiodla verify: {document['model']}", ""]
    out.append(f"**Verdict: {document['verdict'].upper()}**")
    out.append("")
    out.append(f"- Precision: {document['precision'].upper()}; runtime: {document['runtime']}")
    out.append(f"- Inputs: {_tensors(document['inputs'])}; {document['samples']} sample(s)")
    out.append(f"- Outputs: {_tensors(document['outputs'])}")
    if document["onnx"]:
        out.append(f"- Reference: onnxruntime on `{document['onnx']}`")
    out += ["", "## Cores", ""]
    agree = document["cores_agree"]
    if agree["identical"]:
        out.append(f"Cores {document['cores']} gave identical bytes on every output.")
    else:
        out += ["| core | sample | output | max abs difference |", "|---|---|---|---|"]
        for d in agree["differences"]:
            out.append(f"| {d['core']} | {d['sample']} | `{d['output']}` | {d['max_abs']:.6g} |")
    if "comparison" in document:
        tol = document["tolerance"]
        out += ["", "## Against onnxruntime", ""]
        out.append(
            f"Tolerances ({document['precision'].upper()}): max relative error <= "
            f"{tol['max_rel']:g} (max abs error / the reference's largest magnitude), "
            f"cosine similarity >= {tol['min_cosine']:g}, top-1 agreement >= "
            f"{tol['min_top1']:g} (classifier outputs, NxCx1x1)."
        )
        out += ["", "| output | max abs | max rel | cosine | top-1 | verdict |"]
        out.append("|---|---|---|---|---|---|")
        for e in document["comparison"]:
            top1 = "" if e["top1"] is None else f"{e['top1']:.3f}"
            verdict = "pass" if e["pass"] else "**fail**: " + "; ".join(e["failures"])
            out.append(
                f"| `{e['output']}` | {e['max_abs']:.4g} | {e['max_rel']:.4g} | "
                f"{e['cosine']:.6f} | {top1} | {verdict} |"
            )
    out += ["", "## Speed", "", "| core | median ms | p99 ms | requests |", "|---|---|---|---|"]
    for core, f in document["latency"].items():
        out.append(f"| {core} | {f['median_ms']:.3f} | {f['p99_ms']:.3f} | {f['requests']} |")
    rate = document["throughput"]
    out += [
        "",
        f"Throughput on cores {document['cores']}: {rate['requests_per_second']:.0f} "
        f"requests/s, {rate['ratio']:.2f} x the cores / median latency figure "
        f"({rate['ideal']:.0f}/s), from {rate['requests']} requests, "
        f"{rate['concurrency']} at a time. {THROUGHPUT_NOTE}",
        "",
        "## Versions",
        "",
    ]
    for key, value in {**document["platform"], **document["versions"]}.items():
        out.append(f"- {key}: {value if value is not None else 'unknown'}")
    return "\n".join(out) + "\n"
