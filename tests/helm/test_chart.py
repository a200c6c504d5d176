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
                 "--set", "fanout.firehoseListener.enabled=true", "--set", "prometheusRule.enabled=true",
                 "--set", "serviceMonitor.enabled=true", "--set", "config.RELAY_GETREPO_PROXY=true"]


def helm(*args: str) -> str:
    assert Path(HELM).is_file(), f"{HELM} missing: ./run test installs it"
    done = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"helm {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def render_fails(*args: str) -> str:
    """``helm template`` that must fail; its error output."""
    done = subprocess.run([HELM, "template", "relay", str(CHART), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, f"helm template {' '.join(args)} rendered"
    return done.stderr


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
    # the only resources without a schema are the Prometheus Operator's (CRDs)
    unknown = re.findall(r"Couldn't find schema for kind (\w+)", done.stdout + done.stderr)
    assert set(unknown) <= {"ServiceMonitor", "PrometheusRule"}, unknown


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
    paths = ingress["spec"]["rules"][0]["http"]["paths"]
    assert routed(paths, "/xrpc/com.atproto.sync.requestCrawl") == "relay-atproto-relay-ingest"
    assert routed(paths, "/admin/hosts") == "relay-atproto-relay-ingest"
    assert routed(paths, "/xrpc/com.atproto.sync.subscribeRepos") == "relay-atproto-relay-fanout"
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
        {"series": f'relay_host_accounts{{{writer}, host="at.example"}}', "values": "100x40"},
        {"series": f'relay_host_account_limit{{{writer}, host="at.example"}}', "values": "100x40"},
        {"series": f"relay_resync_queue{{{writer}}}", "values": "5x40"},      # stuck: never drains
        {"series": f"relay_resync_queue{{{standby}}}", "values": "40-1x40"},  # draining
        {"series": f'relay_broadcast_events_total{{{fanout}, event="too_slow"}}', "values": "0+2x40"},
        {"series": f'relay_sibling_forwards_total{{{writer}, sibling="https://b.example", result="failed"}}',
         "values": "0x20 0+1x20"},  # one change given up per minute from minute 21 on
        {"series": f'relay_sibling_forwards_total{{{writer}, sibling="https://c.example", result="forwarded"}}',
         "values": "0+5x40"},  # all well with this one
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
            {"eval_time": "30m", "alertname": "RelayHostOverAccountLimit", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "relays", "host": "at.example"},
                 "exp_annotations": {"summary": "Host at.example has reached its account limit",
                                     "description": "Accounts beyond the limit are held as throttled until the "
                                                    "limit is raised."}}]},
            {"eval_time": "30m", "alertname": "RelayHostNearAccountLimit", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "relays", "host": host},
                 "exp_annotations": {"summary": f"Host {host} uses {share} of its account limit",
                                     "description": "Raise its limit (POST /admin/hosts/<host>/limits) before new "
                                                    "accounts are held as throttled."}}
                for host, share in (("at.example", "100%"), ("full.example", "95%"))]},
            {"eval_time": "35m", "alertname": "RelayResyncBacklogAging", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "relays", "job": "relay-atproto-relay-ingest",
                                "pod": "ingest-a"},
                 "exp_annotations": {"summary": "Resync backlog on ingest-a has not drained for 30m",
                                     "description": "5 accounts wait for a resync; see relay_resyncs_total{result} "
                                                    "for why they fail."}}]},
            {"eval_time": "10m", "alertname": "RelaySiblingForwardsLost", "exp_alerts": []},
            {"eval_time": "30m", "alertname": "RelaySiblingForwardsLost", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "relays", "pod": "ingest-a",
                                "sibling": "https://b.example"},
                 "exp_annotations": {"summary": "9 changes not passed on to sibling https://b.example in 15 min",
                                     "description": "Admin changes or requestCrawls made here were given up or "
                                                    "dropped for this sibling (the relay's log names each): repeat "
                                                    "them there."}}]},
            {"eval_time": "30m", "alertname": "RelayConsumersCutTooSlow", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "relays", "pod": "fanout-a"},
                 "exp_annotations": {"summary": "30 consumers cut as too slow on fanout-a in 15 min",
                                     "description": "Consumers fell RELAY_CONSUMER_MAX_LAG behind; if many, the "
                                                    "fan-out may be short of CPU or bandwidth."}}]},
        ]}, {
        # no ingest holds the writer lease: a standby waits, the writer is gone
        "interval": "1m", "input_series": [
            {"series": f'relay_sequencer_state{{{standby}, state="waiting"}}', "values": "1x20"},
            {"series": f'relay_sequencer_state{{{standby}, state="running"}}', "values": "0x20"},
            {"series": f'relay_sequencer_state{{{other}, state="running"}}', "values": "1x20"}],
        "alert_rule_test": [{"eval_time": "10m", "alertname": "RelayNoWriter", "exp_alerts": [
            {"exp_labels": {"severity": "critical"},
             "exp_annotations": {"summary": "No relay ingest is sequencing events",
                                 "description": "No pod has reported a running sequencer for 5m."}}]}]}]}
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    done = promtool("test", "rules", str(tmp_path / "tests.yaml"))
    assert done.returncode == 0, done.stdout + done.stderr


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(relay_[a-z_]+)\b", expr))


#: Units a metric name may carry, as its last word (before ``_total`` for a counter): base units only.
UNITS = ("seconds", "bytes")
#: Words that make a name something other than Prometheus style (a unit not in base form, an age
#: spelled as a phrase instead of ``_age_seconds``).
NOT_PROMETHEUS_STYLE = ("since", "ms", "milliseconds", "kb", "mb", "kib", "mib", "minutes", "hours")


def naming_problems(name: str) -> list[str]:
    """What is wrong with a family name (as the text parser gives it: a counter without
    ``_total``) by the Prometheus naming conventions: snake_case under ``relay_``, a unit only as
    the last word and only in base units."""
    words = name.split("_")
    problems = []
    if not re.fullmatch(r"relay_[a-z][a-z0-9_]*[a-z0-9]", name) or "" in words:
        problems.append(f"{name}: not snake_case under relay_")
    for unit in UNITS:
        if unit in words[:-1]:
            problems.append(f"{name}: the unit {unit!r} is not its last word")
    problems += [f"{name}: {word!r} is not Prometheus style" for word in words if word in NOT_PROMETHEUS_STYLE]
    return problems


def test_naming_problems_catch_what_they_should() -> None:
    assert naming_problems("relay_seconds_since_last_sequenced")  # the name it replaced
    assert naming_problems("relay_bytes_out")
    assert naming_problems("relay_fetch_ms")
    for good in ("relay_last_sequenced_age_seconds", "relay_consumer_sent_bytes", "relay_hosts",
                 "relay_ingest_to_broadcast_seconds", "relay_resync_held_bytes"):
        assert naming_problems(good) == [], good


async def test_every_metric_of_the_alerts_and_the_dashboard_is_on_a_running_relays_metrics(tmp_path: Path) -> None:
    """Each ``relay_*`` name in the rendered PrometheusRule and in the Grafana dashboard is on the
    ``/metrics`` of a relay that follows a simulated host, and every family there is named in
    Prometheus style (``naming_problems``) (a name is there when its family is
    declared: a labelled counter nothing has counted yet has no sample, but its name is right);
    the per-host account gauges carry that host."""
    from prometheus_client.parser import text_string_to_metric_families

    from sim import SimConfig, SimFleet
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
    # every relay_* family is named Prometheus style, with its unit (seconds, bytes) as the last word
    problems = [p for f in families if f.name.startswith("relay_") for p in naming_problems(f.name)]
    assert not problems, problems
    samples = {(s.name, s.labels.get("host")): s.value for f in families for s in f.samples}
    host = fleet.hosts[0].hostname
    assert samples[("relay_host_accounts", host)] == 1
    assert samples[("relay_host_account_limit", host)] == 7
    assert samples[("relay_ready", None)] == 1 and samples[("relay_bus_up", None)] == 1


def routed(paths: list[dict[str, Any]], url_path: str) -> str | None:
    """The Service an Ingress sends ``url_path`` to (Kubernetes' rules: an Exact match first,
    then the longest Prefix match by path element), or None."""
    for p in paths:
        if p["pathType"] == "Exact" and p["path"] == url_path:
            return str(p["backend"]["service"]["name"])
    best: tuple[int, str] | None = None
    for p in paths:
        prefix = p["path"].rstrip("/")
        if p["pathType"] == "Prefix" and (url_path == prefix or url_path.startswith(prefix + "/")):
            if best is None or len(prefix) > best[0]:
                best = (len(prefix), str(p["backend"]["service"]["name"]))
    return best[1] if best else None


def test_ingress_serves_the_public_paths_and_not_metrics() -> None:
    for values in (EVERYTHING_ON, ["-f", str(PRODUCTION)]):
        ingress = by_kind(render(*values), "Ingress")["relay-atproto-relay"]
        paths = ingress["spec"]["rules"][0]["http"]["paths"]
        for path in ("/metrics", "/metrics/", "/_ready"):
            assert routed(paths, path) is None, path
        fanout = "relay-atproto-relay-fanout"
        for path in ("/", "/xrpc/com.atproto.sync.subscribeRepos", "/xrpc/com.atproto.sync.getRepo",
                     "/subscribe", "/dashboard", "/dashboard/data", "/_health"):
            assert routed(paths, path) == fanout, path
        assert routed(paths, "/xrpc/com.atproto.sync.requestCrawl") == "relay-atproto-relay-ingest"


def test_spark_cronjobs_have_deadlines_and_never_overlap() -> None:
    docs = render("--set", "spark.export.enabled=true", "--set", "spark.export.schedule=0 5 * * 6",
                  "--set", "spark.cronJobs.resync.activeDeadlineSeconds=600")
    cronjobs = by_kind(docs, "CronJob")
    assert set(cronjobs) == {f"relay-atproto-relay-spark-{j}" for j in ("reconcile", "resync", "export")}
    deadlines = {}
    for name, cron in cronjobs.items():
        assert cron["spec"]["concurrencyPolicy"] == "Forbid", name
        assert cron["spec"]["startingDeadlineSeconds"] == 3600, name
        deadlines[name.rsplit("-", 1)[1]] = cron["spec"]["jobTemplate"]["spec"]["activeDeadlineSeconds"]
    assert deadlines == {"reconcile": 21600, "resync": 600, "export": 86400}
    # without a value of its own, a job gets spark.activeDeadlineSeconds
    cron = by_kind(render("--set", "spark.cronJobs.reconcile.activeDeadlineSeconds=null",
                          "--set", "spark.activeDeadlineSeconds=999"), "CronJob")
    assert cron["relay-atproto-relay-spark-reconcile"]["spec"]["jobTemplate"]["spec"]["activeDeadlineSeconds"] == 999
    job = next(d for d in render("--set", "spark.export.enabled=true") if d["kind"] == "Job")
    assert job["spec"]["activeDeadlineSeconds"] == 86400


def test_only_the_relay_pods_get_the_admin_token() -> None:
    for values in ([], EVERYTHING_ON, ["-f", str(PRODUCTION)]):
        pods = pod_specs(render(*values))
        for name, pod in pods.items():
            env = {e["name"] for c in pod["containers"] for e in c.get("env", [])}
            assert {"RELAY_DATABASE_URL", "RELAY_REDIS_URL"} <= env, name
            assert ("RELAY_ADMIN_TOKEN" in env) == (not name.startswith("relay-atproto-relay-spark-")), name
        assert any(n.startswith("relay-atproto-relay-spark-") for n in pods)


def test_fanout_egress_to_pdses_only_with_the_getrepo_proxy() -> None:
    def internet(policy: dict[str, Any]) -> list[dict[str, Any]]:
        return [rule for rule in policy["spec"]["egress"] for peer in rule.get("to", [])
                if peer.get("ipBlock", {}).get("cidr") == "0.0.0.0/0"]

    blocked = yaml.safe_load((CHART / "values.yaml").read_text())["networkPolicy"]["blockedCidrs"]
    off = by_kind(render("--set", "networkPolicy.enabled=true"), "NetworkPolicy")
    assert internet(off["relay-atproto-relay-fanout"]) == []
    assert len(internet(off["relay-atproto-relay-ingest"])) == 1
    for value in ("true", "1"):
        on = by_kind(render("--set", "networkPolicy.enabled=true", "--set", f"config.RELAY_GETREPO_PROXY={value}"),
                     "NetworkPolicy")
        [rule] = internet(on["relay-atproto-relay-fanout"])
        assert rule["to"] == [{"ipBlock": {"cidr": "0.0.0.0/0", "except": blocked}}]  # not the cluster's ranges
        assert rule["ports"] == [{"port": 443, "protocol": "TCP"}, {"port": 80, "protocol": "TCP"}]
        assert on["relay-atproto-relay-ingest"] == off["relay-atproto-relay-ingest"]


def test_ingest_and_fanout_pods_spread_over_nodes() -> None:
    def anti(pod: dict[str, Any]) -> dict[str, Any]:
        return dict(pod["affinity"]["podAntiAffinity"])

    docs = render()
    pods = pod_specs(docs)
    deployments = by_kind(docs, "Deployment")
    for role in ("ingest", "fanout"):
        name = f"relay-atproto-relay-{role}"
        [term] = anti(pods[name])["preferredDuringSchedulingIgnoredDuringExecution"]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        # the term selects the workload's own pods (and only them)
        assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == deployments[name]["spec"]["selector"]["matchLabels"]
    production = pod_specs(render("-f", str(PRODUCTION)))
    [term] = anti(production["relay-atproto-relay-ingest"])["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "ingest"
    assert "affinity" not in pod_specs(render("--set", "fanout.podAntiAffinity="))["relay-atproto-relay-fanout"]
    own = pod_specs(render("--set", "fanout.affinity.nodeAffinity.x=y"))["relay-atproto-relay-fanout"]["affinity"]
    assert own == {"nodeAffinity": {"x": "y"}}
    assert "podAntiAffinity must be preferred, required or empty" in render_fails("--set", "ingest.podAntiAffinity=soft")


def test_fanout_drains_before_it_is_stopped() -> None:
    pod = pod_specs(render("--set", "fanout.preStopSleepSeconds=12", "--set", "fanout.terminationGracePeriodSeconds=40"))
    fanout = pod["relay-atproto-relay-fanout"]
    assert fanout["containers"][0]["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "12"]}}
    assert fanout["terminationGracePeriodSeconds"] == 40
    defaults = pod_specs(render())["relay-atproto-relay-fanout"]
    sleep = int(defaults["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    assert sleep > 0 and defaults["terminationGracePeriodSeconds"] >= sleep + 15
    # a grace period the sleep and the relay's shutdown do not fit in is refused
    assert "terminationGracePeriodSeconds must be at least" in render_fails("--set", "fanout.preStopSleepSeconds=20")
