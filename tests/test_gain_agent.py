"""The tuning gain in the agent: the profile setting, measured once at start in enforce mode before
the first probe (no re-apply meanwhile), /gain, the metrics, the node summary and the fleet view."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from gpu_tune.serve.app import create_app
from gpu_tune.errors import InputError
from gpu_tune.cluster.fleet import fleet_report, render_table
from gpu_tune.cluster.labels import ANNOTATION_SUMMARY, CONDITION_TYPE, node_summary, summary_annotation
from gpu_tune.tune.profile import Profile
from gpu_tune.tune.policy import load_profile
from gpu_tune.serve.agent import Agent
from gpu_tune.serve.options import ServeOptions
from gpu_tune.serve.stages import default_stages

from .test_service import World


def measure(ratio, lo, hi, verdict):
    return {"ratio": ratio, "ci95": None if lo is None else [lo, hi], "verdict": verdict}


def gain_doc(verdict="gain", ratio=1.052, lo=1.021, hi=1.084, gpus=("0", "1")):
    return {"profile": "training", "regime": "launch_bound", "verdict": verdict, "targets": [
        {"gpu": g, "verdict": verdict, "measures": {
            "images_per_second": measure(ratio, lo, hi, verdict),
            "jitter_p99_over_p50": measure(0.9, 0.8, 1.01, "no significant difference"),
            "step_p50_seconds": measure(0.95, 0.92, 0.98, "gain")}} for g in gpus]}


class GainWorld(World):
    def __init__(self) -> None:
        super().__init__()
        self.order: list[str] = []
        self.gain_gate: threading.Event | None = None
        self.gain_started = threading.Event()
        self.gain_out = gain_doc()
        self.published_gain = []

    def gain(self, topology):
        self.gain_started.set()
        self._call("gain")
        self.order.append("gain")
        if self.gain_gate is not None:
            assert self.gain_gate.wait(10)
        return self.gain_out

    def probe(self, topology, previous):
        self.order.append("probe")
        return super().probe(topology, previous)

    def publish(self, verdict, topology, gpus, driver, *, gain=None, **kw):
        self.published_gain.append(gain)
        return super().publish(verdict, topology, gpus, driver, **kw)

    def stages(self, probe_interval: float = 0):
        s = super().stages(probe_interval)
        s.gain = self.gain
        return s


def test_profile_gain_setting_defaults_off_and_is_validated(tmp_path):
    assert Profile(name="p").gain.measure_on_start is False and Profile(name="p").gain.pairs is None
    assert load_profile("training").gain.measure_on_start is False
    for body, needle in (("gain:\n  pairs: 0\n", "gain.pairs"), ("gain:\n  measure_on_start: maybe\n", "gain.measure_on_start"),
                         ("gain:\n  window_seconds: -1\n", "gain.window_seconds"), ("gain:\n  pair: 3\n", "gain.pair: unknown key")):
        (tmp_path / "p.yaml").write_text("name: p\n" + body)
        with pytest.raises(InputError) as ei:
            load_profile("p", tmp_path)
        assert needle in str(ei.value) and str(tmp_path / "p.yaml") in str(ei.value)


def test_gain_runs_once_before_the_first_probe_and_holds_off_enforce():
    w = GainWorld()
    w.audit_doc = {**w.audit_doc, "compliant": False, "settings": [
        {**s, "status": "drift"} for s in w.audit_doc["settings"]]} if w.audit_doc.get("settings") else w.audit_doc
    agent = Agent(w.stages(), mode="enforce", enforce_min_interval=0)
    agent._started_at = agent.monotonic()  # as start() does: the first publish waits for the first probe
    agent.run_pass()
    assert agent._probe_request.is_set()
    w.gain_gate = threading.Event()
    th = threading.Thread(target=agent.run_probe_once)
    th.start()
    assert w.gain_started.wait(10)
    enforced = w.calls["enforce"]
    audits = w.calls["audit"]
    agent.run_pass()  # while the gain measures: read only, and the node is not published yet
    assert w.calls["enforce"] == enforced and w.calls["audit"] > audits
    assert w.calls["publish"] == 0  # the startup taint stays: nothing is published while it measures
    w.gain_gate.set()
    th.join(10)
    assert w.order == ["gain", "probe"]
    snap = agent.run_pass()
    assert snap.gain["verdict"] == "gain"
    assert w.published_gain[-1]["verdict"] == "gain"
    agent.run_probe_once()
    assert w.order == ["gain", "probe", "probe"]  # measured once per start
    client = TestClient(create_app(agent.state))
    r = client.get("/gain")
    assert r.status_code == 200 and r.json()["targets"][0]["gpu"] == "0"
    text = client.get("/metrics").text
    assert 'gpu_tune_tuning_gain_ratio{gpu="0",measure="images_per_second",regime="launch_bound"} 1.052' in text
    assert 'gpu_tune_tuning_gain_ratio_lower{gpu="1",measure="images_per_second",regime="launch_bound"} 1.021' in text
    assert 'gpu_tune_tuning_gain_ratio_upper{gpu="0",measure="jitter_p99_over_p50",regime="launch_bound"} 1.01' in text
    assert "step_p50" not in text  # two measures per GPU only
    series = [ln for ln in text.splitlines() if ln.startswith("gpu_tune_tuning_gain")]
    assert len(series) == 2 * 2 * 3 + 2  # 2 GPUs x 2 measures x (ratio, lower, upper), and a verdict per GPU
    assert 'gpu_tune_tuning_gain_verdict{gpu="0",verdict="gain"} 1.0' in text


def test_no_gain_in_audit_mode_and_no_series_without_it():
    w = GainWorld()
    agent = Agent(w.stages(), mode="audit")
    agent.run_pass()
    agent.run_probe_once()
    agent.run_pass()
    assert w.calls["gain"] == 0
    client = TestClient(create_app(agent.state))
    r = client.get("/gain")
    assert r.status_code == 503 and "measure_on_start" in r.json()["detail"]
    assert "gpu_tune_tuning_gain" not in client.get("/metrics").text


def test_a_failing_gain_is_reported_and_the_probe_still_runs():
    w = GainWorld()
    w.fail["gain"] = RuntimeError("lock busy")
    agent = Agent(w.stages(), mode="enforce")
    agent.run_pass()
    agent.run_probe_once()
    snap = agent.run_pass()
    assert w.order == ["probe"] and w.calls["gain"] == 1
    assert snap.gain["verdict"] == "error" and "lock busy" in snap.gain["error"]
    assert "gpu_tune_tuning_gain_ratio{" not in snap.metrics_body.decode()


def test_too_few_pairs_export_no_ratio():
    w = GainWorld()
    w.gain_out = gain_doc("inconclusive", None, None, None, gpus=("0",))
    agent = Agent(w.stages(), mode="enforce")
    agent.run_pass()
    agent.run_probe_once()
    snap = agent.run_pass()
    body = snap.metrics_body.decode()
    assert 'measure="images_per_second"' not in body and 'measure="jitter_p99_over_p50"' in body


def test_default_stages_measure_only_in_enforce_mode_with_the_setting(make_host, tmp_path):
    root = make_host("small-2cpu")
    (tmp_path / "p.yaml").write_text("name: p\ngain:\n  measure_on_start: true\n  pairs: 4\n")
    base = dict(root=str(root), gpu_backend="none", policy_dir=str(tmp_path), profile="p", no_kube=True)
    assert default_stages(ServeOptions(**base, mode="enforce")).gain is not None
    assert default_stages(ServeOptions(**base, mode="audit")).gain is None
    (tmp_path / "p.yaml").write_text("name: p\n")
    assert default_stages(ServeOptions(**base, mode="enforce")).gain is None


def test_summary_annotation_carries_verdict_ratio_and_interval_coarsely():
    s = node_summary(audit=None, checks=[], probes=[], gain=gain_doc())
    assert s["gain"] == {"verdict": "gain", "ratio": 1.05, "ci95": [1.02, 1.08]}
    # a slightly different measurement rounds to the same annotation: no write
    a = summary_annotation(node_summary(audit=None, checks=[], probes=[], gain=gain_doc(ratio=1.0531, lo=1.0213)))
    assert a == summary_annotation(s)
    s = node_summary(audit=None, checks=[], probes=[], gain=gain_doc("inconclusive", None, None, None))
    assert s["gain"] == {"verdict": "inconclusive"}  # never a ratio without its interval
    assert "gain" not in node_summary(audit=None, checks=[], probes=[])


def node(name, gain=None, model="NVIDIA-H100-80GB-HBM3"):
    summary = {"v": 1, "drift": 0, "failing": [], "probe": {}}
    if gain is not None:
        summary["gain"] = gain
    return {"metadata": {"name": name, "labels": {"gpu-tune.io/profile": "training", "gpu-tune.io/gpu-product": model,
                                                   "gpu-tune.io/gpu-count": "8"},
                         "annotations": {ANNOTATION_SUMMARY: summary_annotation(summary)}},
            "status": {"conditions": [{"type": CONDITION_TYPE, "status": "True",
                                       "lastTransitionTime": "2026-01-01T00:00:00Z",
                                       "lastHeartbeatTime": "2026-01-01T00:00:00Z"}]}}


def test_fleet_gain_column_and_median_per_model():
    from gpu_tune.timestamps import parse_rfc3339

    now = parse_rfc3339("2026-01-01T00:05:00Z")
    nodes = [node("a", {"verdict": "gain", "ratio": 1.05, "ci95": [1.02, 1.08]}),
             node("b", {"verdict": "no significant difference", "ratio": 1.01, "ci95": [0.97, 1.05]}),
             node("c", {"verdict": "loss", "ratio": 0.92, "ci95": [0.88, 0.96]}),
             node("d"), node("e", {"verdict": "inconclusive"}, model="NVIDIA-L4")]
    rep = fleet_report(nodes, now=now)
    text = render_table(rep)
    rows = {ln.split()[0]: ln for ln in text.splitlines() if ln and ln.split()[0] in "abcde"}
    gi = text.splitlines()[0].split().index("GAIN") + 1  # GPUS takes two words: "8x <model>"
    assert rows["a"].split()[gi] == "+5%" and rows["b"].split()[gi] == "~0%"
    assert "LOSS -8%" in rows["c"] and rows["d"].split()[gi] == "-" and rows["e"].split()[gi] == "?"
    assert ("NVIDIA-H100-80GB-HBM3: 4 nodes: 4 ready, 0 not ready, 0 not reporting; median tuning gain +1.0% "
            "over 3 nodes; LOSS on 1 node") in text
    assert "NVIDIA-L4: 1 node: 1 ready, 0 not ready, 0 not reporting" in text.splitlines()
    doc = rep.as_dict()
    h100 = next(m for m in doc["summary"] if m["gpu_model"] == "NVIDIA-H100-80GB-HBM3")
    assert h100["gain"] == {"median_ratio": 1.01, "nodes_measured": 3, "losses": 1}
    assert next(n for n in doc["nodes"] if n["node"] == "c")["gain"]["verdict"] == "loss"
