"""deploy/: the Kubernetes manifests, the compose file, the image and the Grafana dashboard.

Checked offline, against the real thing each refers to:

* every Kubernetes manifest validates (strictly) against the Kubernetes schemas of
  ``kubernetes-validate``; the Prometheus Operator's CRDs, which it has no schema for,
  at least name real ports and Secret keys;
* every ``kvxfer serve`` / ``kvxfer-proxy`` command line in the manifests, the compose
  file and the Dockerfile parses with the CLI's own parsers (so each flag exists and
  each value is one it accepts); every ``KVXFER_*`` variable they set is one that
  command's ``--help`` names;
* ports, probes, Secret keys and the proxy's instance list agree with the workloads;
* every metric the dashboard queries is exported by a running sidecar or proxy.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from sidecars import ProxyProcess, SidecarGroup, Spec, start_proxies

from kvxfer.cli import build_parser as kvxfer_parser
from proxy.__main__ import build_parser as proxy_parser
from proxy.__main__ import config_from_args

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
K8S_VERSION = "1.30.0"    # the oldest release these manifests promise to work with
SECRET = "kvxfer-keys"
POD_IP = "10.0.0.7"       # stands in for $(POD_IP) when parsing command lines


def manifests(folder: Path = K8S) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted(folder.glob("*.yaml")):
        out += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def workloads() -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, pod template spec) of every Deployment and StatefulSet."""
    for _, doc in manifests():
        if doc["kind"] in ("Deployment", "StatefulSet"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for name, pod in workloads():
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            yield f"{name}/{container['name']}", container


def by_name(kind: str, name: str) -> dict[str, Any]:
    found = [doc for _, doc in manifests() if doc["kind"] == kind
             and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} manifests"
    return found[0]


# -- the schemas ----------------------------------------------------------------------------

@pytest.mark.parametrize("version", [K8S_VERSION, "latest"])
def test_manifests_validate_against_the_kubernetes_schemas(version: str) -> None:
    want = kubernetes_validate.latest_version() if version == "latest" else version
    docs = manifests()
    assert {doc["kind"] for _, doc in docs} >= {"Namespace", "Service", "StatefulSet",
                                               "Deployment"}
    for path, doc in docs:
        try:
            kubernetes_validate.validate(doc, want, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message}")
        assert doc["kind"] == "Namespace" or doc["metadata"]["namespace"] == "kvxfer", path


def test_pod_monitors_name_real_ports_and_keys() -> None:
    monitors = manifests(K8S / "prometheus-operator")
    assert monitors
    for path, doc in monitors:
        assert doc["kind"] == "PodMonitor", path
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # a CRD, no schema
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        for endpoint in doc["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] == "http"
            assert endpoint["path"] == "/metrics"
            credentials = endpoint["authorization"]["credentials"]
            assert credentials["name"] == SECRET
            assert credentials["key"] in secret_keys()


# -- command lines against the CLI ---------------------------------------------------------

def expand_k8s(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args, for the variables the container defines."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), arg)


def expand_compose(arg: str) -> str:
    """Compose's ${VAR:-default} with every variable unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg)


def check_command(argv: list[str], where: str) -> str:
    """Parse ``argv`` (``kvxfer serve ...`` or ``kvxfer-proxy ...``) with the real
    parser; the --help text of that command."""
    if argv[:2] == ["kvxfer", "serve"]:
        parser = kvxfer_parser()
        serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        try:
            parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{where}: `kvxfer serve` refuses {shlex.join(argv[2:])} (see above)")
        return serve.choices["serve"].format_help()
    assert argv[0] == "kvxfer-proxy", f"{where}: runs neither kvxfer serve nor the proxy"
    parser = proxy_parser()
    try:
        config_from_args(parser.parse_args(argv[1:]))
    except SystemExit:
        pytest.fail(f"{where}: `kvxfer-proxy` refuses {shlex.join(argv[1:])} (see above)")
    return parser.format_help()


def check_env(names: list[str], help_text: str, where: str) -> None:
    for name in names:
        if name.startswith("KVXFER_"):
            assert f"${name}" in help_text, f"{where}: sets {name}, which --help never names"


def test_kubernetes_command_lines_parse_with_the_cli() -> None:
    seen = set()
    for where, container in containers():
        argv = [*container.get("command", []), *container.get("args", [])]
        if argv[0] not in ("kvxfer", "kvxfer-proxy"):
            continue
        env = {e["name"]: e.get("value", POD_IP) for e in container.get("env", [])}
        help_text = check_command([expand_k8s(a, env) for a in argv], where)
        check_env(list(env), help_text, where)
        seen.add(argv[0] if argv[0] == "kvxfer-proxy" else " ".join(argv[:2]))
    assert seen == {"kvxfer serve", "kvxfer-proxy"}


def test_compose_command_lines_parse_with_the_cli() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    assert set(compose["services"]) == {"prefill", "decode", "proxy"}
    for name, service in compose["services"].items():
        argv = [expand_compose(a) for a in service["command"]]
        help_text = check_command(argv, f"compose.yaml:{name}")
        check_env(list(service.get("environment") or {}), help_text, f"compose.yaml:{name}")
        if argv[0] == "kvxfer-proxy":  # instances by service name, on the sidecars' port
            args = proxy_parser().parse_args(argv[1:])
            assert args.prefiller_hosts == ["prefill"] and args.decoder_hosts == ["decode"]
            assert args.prefiller_ports == args.decoder_ports == [8000]


def _sent_to_the_build(path: str, rules: list[str]) -> bool:
    """Whether ``.dockerignore``'s ``rules`` let ``path`` into the build context: the
    last rule that matches it or a folder above it decides (``!`` lets it in)."""
    import fnmatch

    parts = path.strip("/").split("/")
    sent = True
    for rule in rules:
        negated, pattern = rule.startswith("!"), rule.lstrip("!").strip("/")
        for depth in range(1, len(parts) + 1):
            here = "/".join(parts[:depth])
            if fnmatch.fnmatch(here, pattern) or (
                    pattern.startswith("**/") and fnmatch.fnmatch(parts[depth - 1],
                                                                pattern[3:])):
                sent = negated
                break
    return sent


def test_every_file_the_image_copies_is_in_the_build_context() -> None:
    """A COPY of a path that .dockerignore keeps out fails the image build ("not found")."""
    rules = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    copied = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            copied += [w for w in words[1:-1] if not w.startswith("--")]
    assert "setup.py" in copied and "kvxfer" in copied
    for path in copied:
        assert (ROOT / path).exists(), f"the Dockerfile copies {path}, which is not here"
        assert _sent_to_the_build(path, rules), f".dockerignore keeps {path} out of the build"
    assert not _sent_to_the_build("kvxfer/transfer/converted/x.so", rules)  # built in the image
    assert not _sent_to_the_build("tests", rules)


def test_image_default_command_parses_and_matches_exposed_ports() -> None:
    text = (ROOT / "Dockerfile").read_text()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M)[1])  # type: ignore[index]
    check_command(cmd, "Dockerfile CMD")
    exposed = re.search(r"^EXPOSE (.*)$", text, re.M)[1].split()  # type: ignore[index]
    assert exposed == ["8000", "5600"]
    assert cmd[cmd.index("--port") + 1] == "8000"
    assert cmd[cmd.index("--side-channel-port") + 1] == "5600"
    assert re.search(r"^USER kvxfer$", text, re.M), "the image must not run as root"
    assert "HEALTHCHECK" in text and "/health" in text


# -- the manifests agree with each other ----------------------------------------------------

def flag_value(args: list[str], flag: str) -> str:
    for i, arg in enumerate(args):
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
        if arg == flag:
            return args[i + 1]
    raise AssertionError(f"{flag} missing from {args}")


def flag_values(args: list[str], flag: str) -> list[str]:
    """The values of an nargs="+" flag given as separate items."""
    start = args.index(flag) + 1
    end = next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
    return args[start:end]


def secret_keys() -> set[str]:
    """The keys of Secret kvxfer-keys that the README's `kubectl create secret` makes."""
    readme = (K8S / "README.md").read_text()
    command = readme[readme.index("create secret generic"):].split("```")[0]
    return set(re.findall(r"--from-(?:literal|file)=([\w-]+)=", command))


def test_ports_and_probes_agree_with_the_command_lines() -> None:
    for where, container in containers():
        if "args" not in container:
            continue
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        assert int(flag_value(container["args"], "--port")) == ports["http"], where
        assert flag_value(container["args"], "--host") == "0.0.0.0", where
        if container["args"][:2] == ["kvxfer", "serve"]:  # peers are told the pod IP
            assert flag_value(container["args"], "--advertise-host") == "$(POD_IP)", where
        if "--side-channel-port" in " ".join(container["args"]):
            side = int(flag_value(container["args"], "--side-channel-port"))
            assert side == ports["side-channel"], where
            assert flag_value(container["args"], "--side-channel-host") == "0.0.0.0"
        assert container["readinessProbe"]["httpGet"]["path"] == "/health", where
        probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")
                  if p in container]
        for probe in probes:
            port = probe.get("httpGet", probe.get("tcpSocket"))["port"]
            assert port in ports, f"{where}: a probe names port {port!r}"
        assert container["resources"]["requests"]["cpu"], where
        assert container["resources"]["requests"]["memory"], where


def test_services_select_their_pods_and_name_their_ports() -> None:
    for role in ("prefill", "decode"):
        service, workload = by_name("Service", f"kvxfer-{role}"), by_name(
            "StatefulSet", f"kvxfer-{role}")
        assert service["spec"]["clusterIP"] == "None", "discovery needs a headless Service"
        assert workload["spec"]["serviceName"] == service["metadata"]["name"]
    for _, doc in manifests():
        if doc["kind"] != "Service":
            continue
        pods = [w for _, w in manifests() if w["kind"] in ("Deployment", "StatefulSet")
                and doc["spec"]["selector"].items()
                <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, f"Service {doc['metadata']['name']} selects {len(pods)} workloads"
        names = {p["name"] for c in pods[0]["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        for port in doc["spec"]["ports"]:
            assert port["targetPort"] in names, (doc["metadata"]["name"], port)


def test_the_proxy_discovers_the_sidecars_by_their_headless_services() -> None:
    proxy = by_name("Deployment", "kvxfer-proxy")["spec"]["template"]["spec"]["containers"][0]
    args = proxy["args"]
    config = config_from_args(proxy_parser().parse_args(args[1:]))
    for flag, role in (("--prefiller", "prefill"), ("--decoder", "decode")):
        workload = by_name("StatefulSet", f"kvxfer-{role}")
        service = f"{workload['spec']['serviceName']}.{workload['metadata']['namespace']}.svc"
        assert flag_values(args, f"{flag}-hosts") == [service]
        port = workload["spec"]["template"]["spec"]["containers"][0]["ports"][0]
        assert flag_values(args, f"{flag}-ports") == [str(port["containerPort"])]
        assert config.names(role) == ((service, port["containerPort"]),)
        assert config.urls(role) == ()  # every instance comes from the name
    assert config.resolve_interval <= 10


def test_the_kv_key_is_mounted_from_the_secret_as_kvxfer_accepts_it() -> None:
    """No copy step: the Secret's file is root:<fsGroup>, mode 0440, which the key
    check accepts (a group-readable file owned by root); others may never read it."""
    for name, pod in workloads():
        secret = [v["secret"] for v in pod.get("volumes", []) if "secret" in v]
        if not secret:
            continue
        assert "initContainers" not in pod, name
        assert secret[0]["defaultMode"] == 0o440, name
        assert pod["securityContext"]["fsGroup"], name
        assert pod["securityContext"]["runAsUser"] != 0, name


def test_keys_come_from_the_secret() -> None:
    keys = secret_keys()
    assert keys == {"api-key", "proxy-api-key", "kv-key"}
    used: set[str] = set()
    for where, container in containers():
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == SECRET and ref["key"] in keys, where
                used.add(ref["key"])
            assert "key" not in env["name"].lower() or "valueFrom" in env \
                or env["value"].startswith("/run/"), f"{where}: a key in plain text"
    for _, pod in workloads():
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] == SECRET
                used |= {item["key"] for item in volume["secret"]["items"]}
    assert used == keys


# -- the dashboard against real /metrics ---------------------------------------------------

def exposed_names(text: str) -> set[str]:
    """Every series name a scrape of this /metrics text can hold (declared families
    count even before their first sample: a labelled counter starts empty)."""
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                                 "_created"),
                "gauge": ("",), "info": ("_info",), "summary": ("_sum", "_count", "")}
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + s for s in suffixes.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


def dashboard_queries() -> list[str]:
    board = json.loads((DEPLOY / "grafana" / "kvxfer.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in board["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    return exprs


def test_dashboard_panels_are_well_formed() -> None:
    board = json.loads((DEPLOY / "grafana" / "kvxfer.json").read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for topic in ("errors by stage", "time to first token", "throughput", "descriptors",
                  "leases", "blocks"):
        assert topic in titles, f"no panel about {topic}"
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"


def test_every_dashboard_metric_is_exported(tmp_path: Path) -> None:
    with SidecarGroup(tmp_path) as group:
        sidecar = group.start_one(Spec("both"))
        proxy = ProxyProcess(tmp_path, [sidecar], [sidecar])
        try:
            start_proxies([proxy])
            exported = exposed_names(sidecar.get("/metrics").text)
            exported |= exposed_names(proxy.get("/metrics").text)
        finally:
            proxy.stop()
    queried = {name for expr in dashboard_queries()
               for name in re.findall(r"\b(kvxfer_\w+)", expr)}
    assert len(queried) >= 20
    missing = sorted(queried - exported)
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"


def test_the_base_image_mirror_comes_from_this_machines_apt_sources(tmp_path: Path) -> None:
    import subprocess

    script = (ROOT / "deploy" / "build-image.sh").read_text()
    function = re.search(r"^apt_mirror\(\) \{.*?^\}$", script, re.M | re.S)
    assert function, "build-image.sh defines apt_mirror"
    assert "DEBIAN_MIRROR:-http" not in script, "no archive is named as a default"

    def mirror(root: Path) -> str:
        done = subprocess.run(["bash", "-c", f"{function.group(0)}\napt_mirror"],
                              env={"APT_ROOT": str(root), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, check=True, timeout=10)
        return done.stdout.strip()

    apt = tmp_path / "etc" / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    assert mirror(tmp_path) == "", "none named: the script then asks for DEBIAN_MIRROR"
    (apt / "sources.list.d" / "debian.sources").write_text(
        "# a comment\nTypes: deb\nURIs: http://archive.test/debian\nSuites: bookworm\n")
    assert mirror(tmp_path) == "http://archive.test/debian"
    (apt / "sources.list").write_text("# deb http://commented.test/debian bookworm main\n"
                                      "deb [arch=amd64] https://first.test/debian bookworm main\n")
    assert mirror(tmp_path) == "https://first.test/debian"


def test_no_tracked_file_names_a_package_host() -> None:
    """Every http(s) URL in the repository names this machine, an address literal, or a
    placeholder host (one label, or under example/invalid/test/svc/local)."""
    import ipaddress
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    placeholder = re.compile(r"(^|\.)(example(\.\w+)?|invalid|test|svc|local|localhost)$")
    named: list[str] = []
    for name in files:
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for host in re.findall(r"https?://\[?([A-Za-z0-9_.:-]+)", text):
            host = host.split(":")[0] if host.count(":") == 1 else host
            try:
                ipaddress.ip_address(host.strip("[]"))
                continue
            except ValueError:
                pass
            if "." not in host or placeholder.search(host):
                continue
            named.append(f"{name}: {host}")
    assert named == [], named
