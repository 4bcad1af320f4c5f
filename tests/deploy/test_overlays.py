"""What each overlay is for: dev (small, CPU), gpu (GPUs for compute and attention), production (HA)."""

from __future__ import annotations

from kubernetes.utils import parse_quantity

from infinite_llm.rpc.sizes import parse_size

from .manifests import all_containers, by_kind, config_data, expand, main_container, one, selected, workloads

NS = "infinite-llm"


def settings(docs: list[dict]) -> dict[str, str]:
    return config_data(docs, main_container(one(docs, "StatefulSet", "attention")))


def gpus(workload: dict) -> str | None:
    return main_container(workload)["resources"]["limits"].get("nvidia.com/gpu")


def test_dev_runs_one_replica_of_everything_with_small_kv(rendered):
    docs = rendered["dev"]
    assert {w["metadata"]["name"]: w["spec"].get("replicas") for w in workloads(docs)} == {
        "etcd": 1,
        "manager": 1,
        "compute": 1,
        "router": 1,
        "gateway": 1,
        "attention": None,
    }
    data = settings(docs)
    assert (data["ATTENTION_MIN_REPLICAS"], data["ATTENTION_MAX_REPLICAS"]) == ("1", "3")  # one server, can grow
    assert parse_size(data["ATTENTION_KV_MEMORY"]) == 64 << 20
    assert data["ATTENTION_DEVICE"] == "cpu"
    assert all(gpus(w) is None for w in workloads(docs))
    assert not by_kind(docs, "PodDisruptionBudget")
    # Fits a laptop: the whole mesh requests at most 4 CPUs and 6 GiB (one attention server).
    requests = [main_container(w)["resources"]["requests"] for w in workloads(docs)]
    cpu = sum(parse_quantity(r["cpu"]) for r in requests)
    memory = sum(parse_quantity(r["memory"]) for r in requests)
    assert cpu <= 4 and memory <= 6 * 2**30


def test_gpu_gives_compute_and_attention_a_gpu_each(rendered):
    docs = rendered["gpu"]
    for name, kind in (("compute", "Deployment"), ("attention", "StatefulSet")):
        w = one(docs, kind, name)
        assert gpus(w) == "1" and main_container(w)["resources"]["requests"]["nvidia.com/gpu"] == "1"
        assert w["spec"]["template"]["spec"]["tolerations"] == [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    for name in ("manager", "router", "gateway"):
        assert gpus(one(docs, "Deployment", name)) is None
    # a rollout must not wait for a spare GPU: no surge pod
    assert one(docs, "Deployment", "compute")["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
    }
    data = settings(docs)
    assert data["ATTENTION_DEVICE"] == "cuda" and parse_size(data["ATTENTION_KV_MEMORY"]) == 32 << 30
    assert arg_of(one(docs, "StatefulSet", "attention"), "--device") == "$(ATTENTION_DEVICE)"


def test_gpu_with_host_memory_keeps_attention_off_the_gpus(rendered):
    docs = rendered["gpu-host-memory"]
    attention = one(docs, "StatefulSet", "attention")
    assert gpus(attention) is None and "tolerations" not in attention["spec"]["template"]["spec"]
    assert settings(docs)["ATTENTION_DEVICE"] == "cpu"
    assert parse_size(settings(docs)["ATTENTION_KV_MEMORY"]) == 48 << 30
    assert gpus(one(docs, "Deployment", "compute")) == "1"


def test_production_runs_a_three_member_etcd_that_finds_its_peers(rendered):
    docs = rendered["production"]
    etcd = one(docs, "StatefulSet", "etcd")
    assert etcd["spec"]["replicas"] == 3 and etcd["spec"]["podManagementPolicy"] == "Parallel"
    env = {e["name"]: e.get("value") for e in main_container(etcd)["env"]}
    members = {}
    for entry in expand(env["ETCD_INITIAL_CLUSTER"], {"POD_NAMESPACE": NS}).split(","):
        name, url = entry.split("=", 1)
        members[name] = url
    # Each member's own advertised peer URL is its entry in the initial cluster.
    assert members == {
        f"etcd-{i}": expand(env["ETCD_INITIAL_ADVERTISE_PEER_URLS"], {"POD_NAME": f"etcd-{i}", "POD_NAMESPACE": NS})
        for i in range(3)
    }
    assert members["etcd-1"] == f"https://etcd-1.etcd.{NS}.svc:2380"  # peer TLS (test_etcd_tls.py)
    assert env["ETCD_NAME"] == "$(POD_NAME)"
    affinity = etcd["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert [w["metadata"]["name"] for w in selected(docs, term["labelSelector"], NS)] == ["etcd"]


def test_production_budgets_keep_quorum_and_capacity_through_drains(rendered):
    docs = rendered["production"]
    budgets = {}
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        (target,) = selected(docs, pdb["spec"]["selector"], NS)
        spec = {k: v for k, v in pdb["spec"].items() if k != "selector"}
        budgets[pdb["metadata"]["name"]] = (target["metadata"]["name"], target["spec"].get("replicas"), spec)
    assert budgets == {
        "etcd": ("etcd", 3, {"minAvailable": 2}),  # quorum of 3
        "attention": ("attention", None, {"maxUnavailable": 1}),  # rBlocks of one server are recomputed at a time
        "compute": ("compute", 2, {"minAvailable": 1}),
        "manager": ("manager", 2, {"minAvailable": 1}),  # the leader or its hot standby
        "router": ("router", 2, {"minAvailable": 1}),
        "gateway": ("gateway", 2, {"minAvailable": 1}),
    }
    data = settings(docs)
    assert int(data["ATTENTION_MIN_REPLICAS"]) >= 3
    assert one(docs, "StatefulSet", "etcd")["spec"]["volumeClaimTemplates"][0]["spec"]["resources"] == {
        "requests": {"storage": "10Gi"}
    }


def test_every_overlay_deploys_into_a_restricted_namespace(rendered):
    for render, docs in rendered.items():
        ns = one(docs, "Namespace", NS)
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted", render
        assert all(
            c["securityContext"]["allowPrivilegeEscalation"] is False
            for w in workloads(docs)
            for c in all_containers(w)
        )


def arg_of(workload: dict, flag: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in main_container(workload)["args"] if a.startswith(flag + "=")]
    return value
