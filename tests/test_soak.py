"""The soak (minipaged/tools/soak.py), short, on the tiny model: the same faults as the real
model's soak in docs/serving.md (dropped streams, bad requests of many kinds, an oversized
body, a full-context prompt, greedy requests compared alone and under load), bounded in
requests and time. The soak checks itself; this test reads its report."""

from __future__ import annotations

import json

from minipaged.tools import soak


def test_a_short_soak_finds_no_problem(long_model_dir_for_soak, tmp_path):
    out = tmp_path / "soak.json"
    code = soak.main(["--requests", "200", "--concurrency", "12", "--max-seconds", "180", "--oversized-mb", "20",
                      "--drop-fraction", "0.3", "--bad-fraction", "0.15", "--long-fraction", "0.1", "--seed", "3",
                      "--json", str(out), "--",
                      "--model", str(long_model_dir_for_soak), "--device", "cpu", "--num-blocks", "600",
                      "--block-size", "4", "--max-model-len", "2048",
                      "--log-stats-interval", "0"])
    report = json.loads(out.read_text())
    assert code == 0 and report["problems"] == [], report["problems"]
    assert report["skipped"] == 0 and report["requests"] == 200 + 8 + 2        # + greedy rechecks + 2 faults
    assert report["statuses"].get("5xx", 0) == 0 and report["statuses"]["200"] > 40
    assert report["statuses"]["413"] == 1                                       # the 20 MB body, over 16 MiB
    assert report["bad_requests"] > 0 and report["dropped_streams"] > 0 and report["greedy_compared"] == 8
    assert report["kv_blocks_held_after"] == 0
    assert report["itl_s"]["p99"] is not None and report["ttft_s"]["p50"] is not None
