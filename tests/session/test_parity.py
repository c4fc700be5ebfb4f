"""v1 vs v2: identical on linear conversations (retries included), and different -- in the ways
stated here -- where the conversation branches or requests overlap."""

import json
import threading

from miles_core.ci.register import register_cpu_ci

register_cpu_ci(est_time=8, suite="stage-a-cpu")


def _exchanges(document):
    """Everything the agent and the engine saw, and the samples (minus the version label)."""
    steps = []
    for step in document["steps"]:
        step = dict(step)
        if step["op"] == "samples":
            reply = json.loads(step["reply"])
            assert reply.pop("version") == document["version"]
            step["reply"] = reply
        steps.append(step)
    return steps


def test_linear_scenarios_are_identical(linear_scenario, run_scenario) -> None:
    v1, v2 = run_scenario(linear_scenario, "v1"), run_scenario(linear_scenario, "v2")
    assert _exchanges(v1) == _exchanges(v2)
    assert v1["final"]["accumulated_token_ids"] == v2["final"]["accumulated_token_ids"]


def test_retries_differ_only_in_what_records_keep(run_scenario) -> None:
    """Same samples after a retry; v2's records keep the superseded turn, v1's do not."""
    v1, v2 = run_scenario("pure_retry", "v1"), run_scenario("pure_retry", "v2")
    assert [seq for seq, _ in v1["final"]["records"]] == [1, 3]
    assert [seq for seq, _ in v2["final"]["records"]] == [1, 2, 3]
    assert v2["final"]["records"][1][1] == v2["final"]["records"][2][1] == 1  # siblings


def test_deep_rollback_v1_rejects_v2_branches(run_scenario) -> None:
    v1, v2 = run_scenario("deep_rollback", "v1"), run_scenario("deep_rollback", "v2")
    statuses = lambda doc: [s["status"] for s in doc["steps"] if s["op"] == "chat"]  # noqa: E731
    assert statuses(v1) == [200, 200, 200, 400, 200]
    assert statuses(v2) == [200, 200, 200, 200, 200]
    assert "rollback failed" in json.loads(v1["steps"][3]["reply"])["error"]["message"]
    s1 = json.loads(v1["steps"][-1]["reply"])["samples"]
    s2 = json.loads(v2["steps"][-1]["reply"])["samples"]
    # v1: one trajectory. v2: the branch (leaf 4) and the continued trajectory (leaf 5).
    assert [s["metadata"]["turns"] for s in s1] == [[1, 2, 3, 4]]
    assert [s["metadata"]["turns"] for s in s2] == [[1, 4], [1, 2, 3, 5]]
    # The continued trajectory is token-identical in both versions up to its last completion
    # (the stub numbers its replies, and v2 made one more call) ...
    before_last = len(s1[0]["loss_mask"]) - _trailing_ones(s1[0]["loss_mask"])  # response tokens
    cut = s1[0]["prompt_length"] + before_last
    assert s2[1]["tokens"][:cut] == s1[0]["tokens"][:cut]
    assert s2[1]["rollout_log_probs"][:before_last] == s1[0]["rollout_log_probs"][:before_last]
    # ... but turn 1, shared with the branch, is trained once: in the branch, committed first.
    first_turn = s1[0]["loss_mask"].index(0)  # end of turn 1's completion in the response
    assert s2[1]["loss_mask"][:first_turn] == [0] * first_turn
    assert s2[0]["loss_mask"][:first_turn] == [1] * first_turn
    assert s2[1]["loss_mask"][first_turn:] == s1[0]["loss_mask"][first_turn:]


def _trailing_ones(mask):
    return len(mask) - len("".join(map(str, mask)).rstrip("1"))


def _race(harness, body):
    sid = harness.create()
    statuses = []
    threads = [threading.Thread(target=lambda: statuses.append(harness.chat(sid, body).status_code)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    records = harness.state(sid).json()["records"]
    samples = harness.client.post(f"/sessions/{sid}/samples").json()["samples"]
    return sorted(statuses), len(records), len(samples)


def test_concurrent_requests_v1_409_v2_siblings(serve) -> None:
    """Two requests on one session at once: v1 answers the second 409 (nothing is dropped
    silently); v2 generates both as sibling turns and samples the later one."""
    body = {"messages": [{"role": "user", "content": "race"}]}
    results = {version: _race(serve(version, stub_delay=0.3), body) for version in ("v1", "v2")}
    assert results["v1"] == ([200, 409], 1, 1)
    assert results["v2"] == ([200, 200], 2, 1)
