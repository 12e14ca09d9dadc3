"""Why was this request slow: a finished request's timeline as parts that sum to its end-to-end
time, and one sentence naming the main cause. Pure Python over the timeline's dict (the one
GET /debug/requests/{id} returns), so it is tested on hand-built records.

The parts cut the request's life at its marks (seconds after the frontend handed it over, the
timeline's `t_s`; `frontend_s` before that):

| part | from | to |
|---|---|---|
| frontend | the HTTP request received | the engine took it in (checks, tokenizing, the pipe) |
| queue | the engine took it in | first scheduled |
| prefill | first scheduled | first token, less the preemptions before it |
| preemption | each preemption | the request had recomputed what it lost |
| decode | first token | the engine's last token, less the preemptions after the first token |
| stream | the engine's last token | the response finished (detokenize, stop strings, writes) |

so they sum to the end-to-end time exactly, up to rounding.
"""

from __future__ import annotations

PARTS = ("frontend", "queue", "prefill", "preemption", "decode", "stream")


def explain(timeline: dict) -> dict:
    """{"request_id", "tenant", "lora", "finish_reason", "e2e_s", "main_cause", "parts":
    [{"name", "seconds", "detail"}], "timeline"} for one finished sample's timeline ("lora": its
    LoRA adapter, None for the base model)."""
    seconds = part_seconds(timeline)
    details = part_details(timeline, seconds)
    parts = [{"name": name, "seconds": round(seconds[name], 6), "detail": details[name]}
             for name in PARTS]
    return {"request_id": timeline["request_id"], "tenant": timeline["tenant"],
            "lora": timeline.get("lora"), "finish_reason": timeline["finish_reason"],
            "e2e_s": round(e2e(timeline), 6), "main_cause": main_cause(timeline, seconds),
            "parts": parts, "timeline": timeline}


def timings(timeline: dict) -> dict[str, float]:
    """The parts in milliseconds, as llama.cpp's server reports `timings`, and the total."""
    seconds = part_seconds(timeline)
    return {**{f"{name}_ms": round(seconds[name] * 1e3, 3) for name in PARTS},
            "e2e_ms": round(e2e(timeline) * 1e3, 3), "prompt_n": timeline["prompt_tokens"],
            "predicted_n": timeline["output_tokens"]}


def e2e(timeline: dict) -> float:
    """From the HTTP request received to the response finished (or, before it has, to the
    frontend's record of the sample's end)."""
    end = timeline.get("response_end_s")
    return timeline.get("frontend_s", 0.0) + (timeline["e2e_s"] if end is None else end)


def marks(timeline: dict) -> dict[str, float]:
    """When the engine took the request in, first scheduled it, produced its first token and its
    last; a mark missing (it never got that far, or the frontend aborted it before the engine
    said anything) is the next one present, so its span is empty."""
    first: dict[str, float] = {}
    for event in timeline["events"]:
        first.setdefault(event["event"], event["t_s"])
    end = timeline.get("response_end_s")
    end = timeline["e2e_s"] if end is None else end
    finished = first.get("finished", end)
    first_token = first.get("first_token", finished)
    scheduled = first.get("scheduled", finished)
    return {"queued": first.get("queued", 0.0), "scheduled": scheduled,
            "first_token": first_token, "finished": finished, "end": max(end, finished)}


def part_seconds(timeline: dict) -> dict[str, float]:
    at = marks(timeline)
    preempted = timeline.get("preemptions", {})
    in_prefill = preempted.get("prefill_s", 0.0)
    in_decode = preempted.get("decode_s", 0.0)
    # A preemption ends at its step's end, a hair after the first token's mark: never below 0.
    prefill = max(at["first_token"] - at["scheduled"] - in_prefill, 0.0)
    decode = max(at["finished"] - at["first_token"] - in_decode, 0.0)
    return {"frontend": timeline.get("frontend_s", 0.0) + at["queued"],
            "queue": at["scheduled"] - at["queued"], "prefill": prefill,
            "preemption": in_prefill + in_decode, "decode": decode,
            "stream": at["end"] - at["finished"]}


def decode_inflation(decode: dict) -> float | None:
    """Seconds the decode steps that carried other requests' prefill tokens took beyond
    decode-only steps; None without both kinds of step to compare."""
    mixed, pure = decode.get("steps_with_prefill", 0), decode.get("steps", 0)
    pure -= mixed
    if not mixed or not pure:
        return None
    mixed_step = decode["with_prefill_s"] / mixed
    pure_step = decode["decode_only_s"] / pure
    return max(mixed_step - pure_step, 0.0) * mixed


def part_details(timeline: dict, seconds: dict[str, float]) -> dict[str, str]:
    at = marks(timeline)
    queue = timeline.get("queue", {})
    chunks = timeline.get("prefill_chunks", [])
    preempted = timeline.get("preemptions", {})
    decode = timeline.get("decode", {})
    others = sum(c["others"] for c in chunks) / len(chunks) if chunks else 0.0
    inflation = decode_inflation(decode)
    count = preempted.get("count", 0)
    return {
        "frontend": f"validation, tokenizing, admission {span(timeline.get('frontend_s', 0.0))}"
                    f"; to the engine {span(at['queued'])}",
        "queue": f"behind {queue.get('waiting_ahead', 0)} waiting and "
                 f"{queue.get('running_ahead', 0)} running requests, "
                 f"{queue.get('tokens_ahead', 0)} tokens queued ahead" + lora_wait(timeline),
        "prefill": f"{timeline['prompt_tokens']} prompt tokens ({timeline['cached_tokens']} "
                   f"cached) in {len(chunks)} chunks, sharing steps with {others:.1f} others on "
                   f"average ({sum(c['others_prefill_tokens'] for c in chunks)} of their "
                   f"prefill tokens)",
        "preemption": (f"preempted {times(count)}, {preempted.get('recompute_tokens', 0)} tokens "
                       f"recomputed" if count else "never preempted"),
        "decode": f"{decode.get('steps', 0)} steps, average batch "
                  f"{decode.get('avg_batch', 0.0):.1f}; {decode.get('steps_with_prefill', 0)} "
                  f"steps carried others' prefill tokens"
                  + ("" if inflation is None else f", costing {span(inflation)} more than "
                                                  f"decode-only steps")
                  + speculation(decode),
        "stream": f"detokenize and write the response {span(seconds['stream'])} after the "
                  f"engine's last token",
    }


def lora_wait(timeline: dict) -> str:
    """The queue line's LoRA clause: the steps that passed the request over because its adapter
    would have made one too many running (--max-loras); nothing where none did."""
    steps = timeline.get("queue", {}).get("lora_cap_steps", 0)
    if not steps:
        return ""
    return (f"; passed over in {steps} steps for a LoRA slot: adapter {timeline.get('lora')} "
            f"would have made one more than --max-loras running")


def speculation(decode: dict) -> str:
    """The decode line's speculative-decoding clause: nothing where none was proposed."""
    proposed = decode.get("draft_tokens", 0)
    if not proposed:
        return ""
    accepted = decode.get("accepted_tokens", 0)
    return (f"; {accepted} of {proposed} proposed tokens accepted "
            f"({accepted / proposed:.0%}, speculative decoding)")


# Another tenant holding at least this share of the KV cache when a request arrived is named as
# the cause of its wait.
TENANT_CAUSE_SHARE = 0.5


def main_cause(timeline: dict, seconds: dict[str, float]) -> str:
    """One sentence on the largest part."""
    name = max(PARTS, key=lambda part: seconds[part])
    took = span(seconds[name])
    if name == "queue":
        queue = timeline.get("queue", {})
        ahead = queue.get("waiting_ahead", 0) + queue.get("running_ahead", 0)
        share = queue.get("top_tenant_kv_share", 0.0)
        if queue.get("lora_cap_steps"):  # seen by the scheduler, not guessed at arrival
            return (f"waited {took}, {queue['lora_cap_steps']} steps of it for a LoRA slot "
                    f"(adapter {timeline.get('lora')}): max-loras")
        if queue.get("top_tenant") and share >= TENANT_CAUSE_SHARE:
            return (f"waited {took}: tenant {queue['top_tenant']} held {share:.0%} of the KV "
                    f"cache")
        return (f"waited {took} behind {ahead} requests ({queue.get('tokens_ahead', 0)} tokens "
                f"queued ahead): queue")
    if name == "preemption":
        preempted = timeline.get("preemptions", {})
        return (f"preempted {times(preempted.get('count', 0))} for {took}, "
                f"{preempted.get('recompute_tokens', 0)} tokens recomputed: KV cache full")
    if name == "decode":
        decode = timeline.get("decode", {})
        inflation = decode_inflation(decode)
        if inflation is not None and inflation > 0.25 * seconds["decode"]:
            return (f"decode slowed {span(inflation)} by others' prefills in "
                    f"{decode['steps_with_prefill']} of {decode['steps']} steps: prefill "
                    f"interference")
        others = decode.get("avg_batch", 1.0) - 1
        if others >= 1:
            return f"decode steps shared with {others:.0f} others for {took}: batch"
        return f"generated {timeline['output_tokens']} tokens in {took}: decode"
    if name == "prefill":
        chunks = timeline.get("prefill_chunks", [])
        return (f"prefill of {timeline['prompt_tokens']} tokens took {took} in {len(chunks)} "
                f"chunks: prefill")
    if name == "frontend":
        in_flight = marks(timeline)["queued"]
        if in_flight > timeline.get("frontend_s", 0.0):  # the engine reads between steps
            return (f"reached the engine's queue after {took}, {span(in_flight)} of it waiting "
                    f"for the step in flight: frontend")
        return f"spent {took} before reaching the engine (tokenize, admission): frontend"
    return f"spent {took} detokenizing and writing the response: stream"


def times(count: int) -> str:
    return {1: "once", 2: "twice"}.get(count, f"{count} times")


def span(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1e3:.0f} ms"
