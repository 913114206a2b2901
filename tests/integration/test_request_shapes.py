"""What HTTP generate takes and gives, through a real tritonserver (docs/clients.md, "Request
shapes"): the speculation counters a user reads, `stop` as a JSON array, and the shapes Triton's
own HTTP frontend decides (a chat's messages, stream on /generate, one-element outputs)."""
from __future__ import annotations

import json

import pytest

from clients import event_ids, generate, generate_stream, grpc_one

SCRIPT_STOP = " STOP"   # in the scripted model's cycle (serverkit.SCRIPT), several tokens long


@pytest.mark.parametrize("max_tokens", [9, 10, 11, 12, 20])
def test_streamed_speculation_counters_count_only_committed_drafts(server, max_tokens):
    """The scripted model's draft is accepted almost always and k = 3, so a step commits 4
    tokens: with 1 to 3 tokens left, a step that verified 3 drafts would count drafts the output
    never held. Per response: the drafts counted accepted are among its tokens, and the drafts
    verified fit in what the request had left."""
    call = grpc_one(server.urls["grpc"], "scripted", prompt="日本", stream=True,
                    sampling={"max_tokens": max_tokens, "ignore_eos": True},
                    return_num_output_tokens=True)
    made = drafted = accepted = 0
    for i, r in enumerate(call.responses):
        new = int(r.outputs["num_output_tokens"][0])
        now_d = int(r.outputs["total_draft_tokens"][0])
        now_a = int(r.outputs["total_accepted_draft_tokens"][0])
        assert now_a - accepted <= new, (
            f"response {i}: {now_a - accepted} drafts counted accepted, {new} tokens sent")
        assert now_d - drafted <= max_tokens - made, (
            f"response {i}: {now_d - drafted} drafts verified with {max_tokens - made} tokens left")
        made, drafted, accepted = made + new, now_d, now_a
        rate = float(r.outputs["acceptance_rate"][0])
        assert rate == pytest.approx(now_a / now_d if now_d else 0.0, abs=1e-6)
    assert made == max_tokens and 0 < accepted <= drafted <= max_tokens - 1


def test_a_stop_list_at_the_top_level_of_generate_stops(server):
    """`"stop": [...]` beside text_input reaches the model as its `stop` input (Triton refuses a
    JSON array as a request parameter: "parameter 'stop' has invalid type")."""
    body = {"text_input": "日本", "exclude_input_in_output": True, "max_tokens": 40}
    status, whole = generate(server.urls["http"], "scripted", body)
    assert status == 200 and SCRIPT_STOP in whole["text_output"], whole
    expected = whole["text_output"][:whole["text_output"].index(SCRIPT_STOP)]
    status, stopped = generate(server.urls["http"], "scripted",
                               {**body, "stop": ["never seen", SCRIPT_STOP], "return_finish_reason": True})
    assert status == 200, stopped
    assert (stopped["text_output"], stopped["finish_reason"]) == (expected, "stop"), stopped


def test_messages_go_as_a_json_string_and_triton_refuses_an_array(server):
    """A chat on /generate: `messages` as JSON text is served; as a JSON array of objects
    Triton's HTTP frontend refuses it before the model sees it (its words, HTTP 500), so the
    docs say to send the string."""
    chat = [{"role": "user", "content": "hi"}]
    status, body = generate(server.urls["http"], "exspec", {"messages": json.dumps(chat), "max_tokens": 3})
    assert status == 200 and len(event_ids(body)) == 3, body
    status, body = generate(server.urls["http"], "exspec", {"messages": chat, "max_tokens": 3})
    assert status == 500 and "Unable to parse JSON bytes array" in body["error"], (status, body)


def test_stream_true_on_generate_is_triton_s_error_and_generate_stream_serves_it(server):
    """/generate takes one response; `stream: true` there is answered by Triton, HTTP 200 with
    an error body naming generate_stream, which serves the same body."""
    body = {"text_input": "hello", "stream": True, "max_tokens": 8}
    status, answer = generate(server.urls["http"], "exspec", body)
    assert status == 200 and "use generate stream" in answer.get("error", ""), answer
    status, events = generate_stream(server.urls["http"], "exspec", body)
    assert status == 200 and sum(len(event_ids(e)) for e in events) == 8, events


def test_one_element_outputs_are_scalars_in_generate_json_and_finish_reason_is_none_text(server):
    """Triton's generate JSON writes a one-element tensor as a scalar whatever its dims, so a
    one-token event's output_ids is a number and a longer one's a list (clients read both:
    event_ids, exspec_client.wire); before the last event finish_reason is "None", the vLLM
    backend's str(None)."""
    status, events = generate_stream(server.urls["http"], "scripted", {
        "text_input": "日本", "stream": True, "max_tokens": 6, "return_finish_reason": True})
    assert status == 200, events
    assert isinstance(events[0]["output_ids"], int), events[0]   # the first token goes alone
    assert [e["finish_reason"] for e in events] == ["None"] * (len(events) - 1) + ["length"]
    assert sum(len(event_ids(e)) for e in events) == 6
