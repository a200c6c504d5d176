"""The chart wires the operator console's scale-out path: fan-outs know the ingest's address
(``RELAY_CONSOLE_INGEST_URL``) and their NetworkPolicy lets them reach its HTTP port."""

from __future__ import annotations

from typing import Any

from tests.helm.test_chart import by_kind, pod_specs, render

FANOUT = "relay-atproto-relay-fanout"
INGEST = "relay-atproto-relay-ingest"


def _env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for c in pod["containers"] for e in c.get("env", [])}


def test_fanouts_forward_the_console_to_the_ingest_service() -> None:
    docs = render()
    pods = pod_specs(docs)
    port = by_kind(docs, "Service")[INGEST]["spec"]["ports"][0]["port"]
    assert _env(pods[FANOUT])["RELAY_CONSOLE_INGEST_URL"] == f"http://{INGEST}:{port}"
    assert "RELAY_CONSOLE_INGEST_URL" not in _env(pods[INGEST])
    # an operator's own value (in config:, rendered into the ConfigMap) is not overridden
    mine = pod_specs(render("--set", "config.RELAY_CONSOLE_INGEST_URL=http://elsewhere:1"))
    assert "RELAY_CONSOLE_INGEST_URL" not in _env(mine[FANOUT])


def test_networkpolicy_lets_fanouts_reach_the_ingest_port() -> None:
    docs = render("--set", "networkPolicy.enabled=true", "--set", "networkPolicy.allowFrom[0].ipBlock.cidr=10.9.0.0/16")
    policies = by_kind(docs, "NetworkPolicy")
    ingest_pod = pod_specs(docs)[INGEST]
    port = next(p["containerPort"] for p in ingest_pod["containers"][0]["ports"] if p["name"] == "http")

    def selects(peer: dict[str, Any], component: str) -> bool:
        return peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == component

    egress = policies[FANOUT]["spec"]["egress"]
    assert any(r.get("ports") == [{"port": port, "protocol": "TCP"}] and any(selects(p, "ingest") for p in r["to"])
               for r in egress)
    ingress = policies[INGEST]["spec"]["ingress"]
    assert any(any(selects(p, "fanout") for p in r.get("from", [])) for r in ingress)  # past a narrow allowFrom
