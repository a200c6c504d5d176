"""The Helm chart (``helm/relay``): lint, render and schema-validate it, and check that what the
defaults render is a working install — a Secret for every reference, probes on the right
endpoints, hardened pods — and that every relay setting is reachable from the values.

``helm`` is the pinned binary ``./run`` installs into ``.tools/`` (``RELAY_HELM`` overrides);
schemas come from the ``kubernetes-validate`` package (``--strict``: unknown fields fail).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from relay.config import SETTINGS

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "relay"
PRODUCTION = CHART / "values-production.yaml"
HELM = os.environ.get("RELAY_HELM", str(ROOT / ".tools" / "helm"))
#: promtool from Debian's ``prometheus`` package (``./run test`` installs it; ``RELAY_PROMTOOL`` overrides)
PROMTOOL = os.environ.get("RELAY_PROMTOOL", shutil.which("promtool") or "/usr/bin/promtool")
#: Settings that do not come from ``.Values.config``: the Secret's three, and the bind addresses
#: (set per workload from its port).
NOT_IN_CONFIG = {"RELAY_DATABASE_URL", "RELAY_REDIS_URL", "RELAY_ADMIN_TOKEN", "RELAY_BIND", "RELAY_FIREHOSE_BIND"}
EVERYTHING_ON = ["--set", "networkPolicy.enabled=true", "--set", "ingress.enabled=true",
                 "--set", "spark.export.enabled=true", "--set", "grafanaDashboard.enabled=true",
                 "--set", "fanout.firehoseListener.enabled=true"]


def helm(*args: str) -> str:
    assert Path(HELM).is_file(), f"{HELM} missing: ./run test installs it"
    done = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"helm {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def render(*args: str) -> list[dict[str, Any]]:
    out = helm("template", "relay", str(CHART), "--namespace", "relays", *args)
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod template by workload name (Deployments, Jobs, CronJobs)."""
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "Job"):
            out[d["metadata"]["name"]] = d["spec"]["template"]["spec"]
        elif d["kind"] == "CronJob":
            out[d["metadata"]["name"]] = d["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return out


@pytest.mark.parametrize("values", [[], ["-f", str(PRODUCTION)]], ids=["default", "production"])
def test_lint_strict(values: list[str]) -> None:
    out = helm("lint", "--strict", str(CHART), *values)
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("values", [[], ["-f", str(PRODUCTION)], EVERYTHING_ON],
                         ids=["default", "production", "every-option"])
def test_rendered_manifests_pass_kubernetes_validate_strict(values: list[str], tmp_path: Path) -> None:
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(helm("template", "relay", str(CHART), *values))
    done = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", str(manifest)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # the only resource without a schema is the Prometheus Operator's ServiceMonitor (a CRD)
    assert re.findall(r"Couldn't find schema for kind (\w+)", done.stdout + done.stderr) in ([], ["ServiceMonitor"])


def test_defaults_render_a_working_install() -> None:
    docs = render()
    secrets = by_kind(docs, "Secret")
    assert list(secrets) == ["relay-atproto-relay-secrets"]
    data = secrets["relay-atproto-relay-secrets"]["stringData"]
    assert data["database-url"].startswith("postgresql://") and data["redis-url"].startswith("redis://")
    assert len(data["admin-token"]) >= 32  # generated when none is given: the admin API is on
    configmaps = by_kind(docs, "ConfigMap")
    pods = pod_specs(docs)
    assert set(pods) >= {"relay-atproto-relay-ingest", "relay-atproto-relay-fanout",
                         "relay-atproto-relay-spark-resync", "relay-atproto-relay-spark-reconcile"}
    accounts = by_kind(docs, "ServiceAccount")
    for name, pod in pods.items():
        # every Secret / ConfigMap a container needs is rendered: no pod stuck in CreateContainerConfigError
        for container in pod["containers"]:
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in secrets and ref["key"] in secrets[ref["name"]]["stringData"], (name, ref)
                    assert not ref.get("optional")
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in configmaps, name
            mounts = {m["name"] for m in container.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in pod.get("volumes", [])}, name
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/tmp"}, name  # writable scratch
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["serviceAccountName"] in accounts and pod["automountServiceAccountToken"] is False, name


def test_probes_mean_what_the_readme_says() -> None:
    pods = pod_specs(render())
    for role in ("ingest", "fanout"):
        container = pods[f"relay-atproto-relay-{role}"]["containers"][0]
        assert container["args"] == [role]
        # liveness and startup on /_health (never asks the database: a blip must not restart pods;
        # 200 in standby), readiness on /_ready (503 while starting, in standby or degraded)
        assert container["livenessProbe"]["httpGet"]["path"] == "/_health"
        assert container["startupProbe"]["httpGet"]["path"] == "/_health"
        assert container["readinessProbe"]["httpGet"]["path"] == "/_ready"
        assert {"name": "RELAY_BIND", "value": "0.0.0.0:2470"} in container["env"]


def test_scaling_and_disruption() -> None:
    docs = render()
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["relay-atproto-relay-fanout"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "relay-atproto-relay-fanout"
    assert hpa["spec"]["minReplicas"] >= 2
    deployments = by_kind(docs, "Deployment")
    assert "replicas" not in deployments["relay-atproto-relay-fanout"]["spec"]  # the HPA owns it
    assert deployments["relay-atproto-relay-ingest"]["spec"]["strategy"] == {"type": "Recreate"}
    pdbs = by_kind(docs, "PodDisruptionBudget")
    assert set(pdbs) == {"relay-atproto-relay-ingest", "relay-atproto-relay-fanout"}
    for pdb in pdbs.values():
        component = pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        assert deployments[f"relay-atproto-relay-{component}"]["spec"]["selector"] == pdb["spec"]["selector"]


def test_existing_secret_is_referenced_not_rendered() -> None:
    docs = render("--set", "secrets.existingSecret=mine")
    assert by_kind(docs, "Secret") == {}
    for pod in pod_specs(docs).values():
        refs = [e["valueFrom"]["secretKeyRef"]["name"] for e in pod["containers"][0]["env"] if "valueFrom" in e]
        assert refs and set(refs) == {"mine"}


def test_every_relay_setting_is_reachable_from_values() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values["config"]) == {s.env for s in SETTINGS} - NOT_IN_CONFIG
    defaults = {s.env: s.default for s in SETTINGS}
    assert {k: str(v) for k, v in values["config"].items()} == {k: defaults[k] for k in values["config"]}
    production = yaml.safe_load(PRODUCTION.read_text())
    assert set(production["config"]) <= {s.env for s in SETTINGS} - NOT_IN_CONFIG
    docs = render(*EVERYTHING_ON)
    config = by_kind(docs, "ConfigMap")["relay-atproto-relay-config"]["data"]
    fanout = pod_specs(docs)["relay-atproto-relay-fanout"]["containers"][0]
    reachable = set(config) | {e["name"] for e in fanout["env"]}
    assert reachable >= {s.env for s in SETTINGS}
    # a setting given on the command line of helm reaches the pods
    changed = by_kind(render("--set", "config.RELAY_REPLAY_WINDOW=24h"), "ConfigMap")["relay-atproto-relay-config"]
    assert changed["data"]["RELAY_REPLAY_WINDOW"] == "24h"


def test_optional_resources() -> None:
    docs = render(*EVERYTHING_ON)
    ingress = by_kind(docs, "Ingress")["relay-atproto-relay"]
    paths = {p["path"]: p["backend"]["service"]["name"] for p in ingress["spec"]["rules"][0]["http"]["paths"]}
    assert paths == {"/xrpc/com.atproto.sync.requestCrawl": "relay-atproto-relay-ingest",
                     "/admin": "relay-atproto-relay-ingest", "/": "relay-atproto-relay-fanout"}
    policies = by_kind(docs, "NetworkPolicy")
    assert set(policies) == {f"relay-atproto-relay-{c}" for c in ("ingest", "fanout", "spark")}
    export = next(d for d in docs if d["kind"] == "Job")
    container = export["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:5] == ["spark", "export", "--no-progress", "--out", "/export/latest"]
    claim = export["spec"]["template"]["spec"]["volumes"]
    assert {"name": "export", "persistentVolumeClaim": {"claimName": "relay-atproto-relay-export"}} in claim
    assert "relay-atproto-relay-export" in by_kind(docs, "PersistentVolumeClaim")
    dashboard = by_kind(docs, "ConfigMap")["relay-atproto-relay-grafana-dashboard"]
    assert json.loads(dashboard["data"]["atproto-relay.json"])["uid"] == "atproto-relay"
    for kind in ("Ingress", "NetworkPolicy", "Job", "PersistentVolumeClaim"):
        assert not by_kind(render(), kind), f"{kind} rendered although not enabled"


def rendered_rules(*args: str) -> dict[str, Any]:
    """The ``spec`` of the PrometheusRule the chart renders with ``prometheusRule.enabled=true``
    (a Prometheus rule file: ``{groups: [...]}``)."""
    rules = by_kind(render("--set", "prometheusRule.enabled=true", *args), "PrometheusRule")
    assert list(rules) == ["relay-atproto-relay"]
    spec: dict[str, Any] = rules["relay-atproto-relay"]["spec"]
    return spec


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert Path(PROMTOOL).is_file(), f"{PROMTOOL} missing: ./run test installs it (Debian package prometheus)"
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


def test_prometheus_rule_is_off_by_default_and_promtool_accepts_it(tmp_path: Path) -> None:
    assert not by_kind(render(), "PrometheusRule")
    spec = rendered_rules("--set", "prometheusRule.alertLabels.team=relay",
                          "--set", "prometheusRule.labels.release=kube-prometheus-stack")
    alerts = {r["alert"] for g in spec["groups"] for r in g["rules"]}
    assert alerts >= {"RelayNotReady", "RelayIngestLagHigh", "RelayNotSequencing", "RelayHostNearAccountLimit",
                      "RelayHostOverAccountLimit", "RelayConsumersCutTooSlow", "RelayResyncBacklogAging",
                      "RelayStoreRetrying", "RelayRedisUnavailable"}
    assert all(r["labels"]["team"] == "relay" for g in spec["groups"] for r in g["rules"])
    rule_file = tmp_path / "rules.yaml"
    rule_file.write_text(yaml.safe_dump(spec))
    done = promtool("check", "rules", str(rule_file))
    assert done.returncode == 0 and f"SUCCESS: {len(alerts)} rules found" in done.stdout, done.stdout + done.stderr
    # promtool does catch a broken expression (the check is not vacuous)
    spec["groups"][0]["rules"][0]["expr"] = "relay_ready{ == 0"
    rule_file.write_text(yaml.safe_dump(spec))
    assert promtool("check", "rules", str(rule_file)).returncode != 0


def test_alerts_fire_on_the_series_they_are_about(tmp_path: Path) -> None:
    """``promtool test rules``: the alerts fire on made-up series of this release's pods and stay
    quiet where they should (a hot standby is not ready by design; a host well below its limit)."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rendered_rules()))
    standby = 'namespace="relays", job="relay-atproto-relay-ingest", pod="ingest-b"'
    writer = 'namespace="relays", job="relay-atproto-relay-ingest", pod="ingest-a"'
    fanout = 'namespace="relays", job="relay-atproto-relay-fanout", pod="fanout-a"'
    other = 'namespace="elsewhere", job="relay-atproto-relay-ingest", pod="x"'
    series = [
        {"series": f"relay_ready{{{writer}}}", "values": "1x40"},
        {"series": f"relay_ready{{{standby}}}", "values": "0x40"},
        {"series": f'relay_sequencer_state{{{writer}, state="running"}}', "values": "1x40"},
        {"series": f'relay_sequencer_state{{{standby}, state="waiting"}}', "values": "1x40"},
        {"series": f"relay_ready{{{fanout}}}", "values": "1x5 0x35"},
        {"series": f"relay_bus_up{{{fanout}}}", "values": "1x5 0x35"},
        {"series": f"relay_bus_up{{{other}}}", "values": "0x40"},  # another release: not ours
        {"series": f'relay_host_accounts{{{writer}, host="full.example"}}', "values": "95x40"},
        {"series": f'relay_host_account_limit{{{writer}, host="full.example"}}', "values": "100x40"},
        {"series": f'relay_host_accounts{{{writer}, host="quiet.example"}}', "values": "50x40"},
        {"series": f'relay_host_account_limit{{{writer}, host="quiet.example"}}', "values": "100x40"},
        {"series": f'relay_host_accounts{{{writer}, host="unlimited.example"}}', "values": "5000x40"},
        {"series": f'relay_broadcast_events_total{{{fanout}, event="too_slow"}}', "values": "0+2x40"},
    ]
    tests = {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "alert_rule_test": [
            {"eval_time": "30m", "alertname": "RelayNotReady", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "relays", "job": "relay-atproto-relay-fanout",
                                "pod": "fanout-a"},
                 "exp_annotations": {"summary": "Relay pod fanout-a is not ready",
                                     "description": "/_ready has answered 503 for 5m: GET /_ready on the pod for "
                                                    "the reasons."}}]},
            {"eval_time": "30m", "alertname": "RelayRedisUnavailable", "exp_alerts": [
                {"exp_labels": {"severity": "critical", "namespace": "relays", "job": "relay-atproto-relay-fanout",
                                "pod": "fanout-a"},
                 "exp_annotations": {"summary": "Relay pod fanout-a cannot use Redis",
                                     "description": "Redis has not answered (or the bus has failed reads) for 2m."}}]},
            {"eval_time": "30m", "alertname": "RelayNoWriter", "exp_alerts": []},
            {"eval_time": "30m", "alertname": "RelayHostOverAccountLimit", "exp_alerts": []},
            {"eval_time": "30m", "alertname": "RelayHostNearAccountLimit", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "relays", "host": "full.example"},
                 "exp_annotations": {"summary": "Host full.example uses 95% of its account limit",
                                     "description": "Raise its limit (POST /admin/hosts/<host>/limits) before new "
                                                    "accounts are held as throttled."}}]},
            {"eval_time": "30m", "alertname": "RelayConsumersCutTooSlow", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "relays", "pod": "fanout-a"},
                 "exp_annotations": {"summary": "30 consumers cut as too slow on fanout-a in 15 min",
                                     "description": "Consumers fell RELAY_CONSUMER_MAX_LAG behind; if many, the "
                                                    "fan-out may be short of CPU or bandwidth."}}]},
        ]}]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    done = promtool("test", "rules", str(tmp_path / "tests.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(relay_[a-z_]+)\b", expr))


async def test_every_metric_of_the_alerts_and_the_dashboard_is_on_a_running_relays_metrics(tmp_path: Path) -> None:
    """Each ``relay_*`` name in the rendered PrometheusRule and in the Grafana dashboard is on the
    ``/metrics`` of a relay that follows a simulated host (a name is there when its family is
    declared: a labelled counter nothing has counted yet has no sample, but its name is right);
    the per-host account gauges carry that host."""
    from prometheus_client.parser import text_string_to_metric_families

    from relay.sim import SimConfig, SimFleet
    from tests.relay.e2e import Consumer, commits_of, crawl
    from tests.relay.helpers import running_relay

    dashboard = json.loads((CHART / "files" / "grafana-dashboard.json").read_text())
    in_dashboard = {m for panel in dashboard["panels"] for target in panel["targets"]
                    for m in metric_names(target["expr"])}
    in_rules = {m for g in rendered_rules()["groups"] for r in g["rules"] for m in metric_names(r["expr"])}
    assert in_dashboard and in_rules
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    fleet = SimFleet(SimConfig(hosts=1, accounts_per_host=1, seed=2901))
    await fleet.start()
    try:
        async with running_relay(database_url=str(tmp_path / "relay.sqlite"), allow_insecure_hosts=True,
                                 plc_url=fleet.plc_url, validation_workers=0, default_account_limit=7) as relay, \
                Consumer(relay.ws_url, cursor=0) as consumer:
            account = fleet.accounts[0]
            await crawl(relay.url, fleet.hosts[0].hostname)
            await fleet.generate(2)
            await consumer.wait_for(lambda evs: account.repo.rev in commits_of(consumer, account.did))
            async with httpx.AsyncClient(base_url=relay.url) as http:
                text = (await http.get("/metrics")).text
    finally:
        await fleet.stop()
    families = list(text_string_to_metric_families(text))
    exported = {f.name + suffix for f in families for suffix in suffixes.get(f.type, ("",))}
    assert not in_rules - exported, f"rules use names /metrics lacks: {sorted(in_rules - exported)}"
    assert not in_dashboard - exported, f"the dashboard uses names /metrics lacks: {sorted(in_dashboard - exported)}"
    samples = {(s.name, s.labels.get("host")): s.value for f in families for s in f.samples}
    host = fleet.hosts[0].hostname
    assert samples[("relay_host_accounts", host)] == 1
    assert samples[("relay_host_account_limit", host)] == 7
    assert samples[("relay_ready", None)] == 1 and samples[("relay_bus_up", None)] == 1
